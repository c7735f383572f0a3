"""The two searches every precision family runs against an accuracy budget, written once.

- `largest_prefix`: candidates ordered cheapest first, the longest prefix whose metric meets the budget, by
  bisection (log2(n) + 1 evaluations): the layer search, the weight-level search and the cpu's dynamic
  quantization all use it.
- `give_back`: a verified variant missed the budget the estimate promised: drop the costliest eighth of what was
  chosen (at least one) and verify again, a bounded number of times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_VERIFY_RETRIES = 4


@dataclass(frozen=True)
class Prefix:
    length: int  # how many candidates the chosen prefix takes
    value: float  # its metric (the baseline's when it is 0)


def largest_prefix(
    count: int,
    measure: Callable[[int], float],
    met: Callable[[float], bool],
    baseline: float,
    advance: Callable[[int], None] | None = None,
) -> Prefix:
    """The largest n in [0, count] whose `measure(n)` is `met`, assuming that holds for every shorter prefix;
    `baseline` is the metric of n = 0 (not measured again)."""
    low, high, best = 0, count, baseline  # invariant: the first `low` candidates meet the budget
    while low < high:
        middle = (low + high + 1) // 2
        value = measure(middle)
        if advance is not None:
            advance(1)
        if met(value):
            low, best = middle, value
        else:
            high = middle - 1
    return Prefix(low, best)


def given_back(chosen: int) -> int:
    """How many of `chosen` remain once the costliest eighth (at least one) is given back."""
    return chosen - max(1, chosen // 8)


@dataclass(frozen=True)
class GiveBack:
    chosen: int  # the last count tried
    tries: int  # verifications it took


def give_back_until_met(chosen: int, attempt: Callable[[int], bool], retries: int = MAX_VERIFY_RETRIES) -> GiveBack:
    """Give back and verify (`attempt(n)` writes and measures the variant of n, True when it holds) until it
    holds, nothing is left, or `retries` runs out."""
    tries = 0
    while tries < retries and chosen > 0:
        chosen, tries = given_back(chosen), tries + 1
        if attempt(chosen):
            break
    return GiveBack(chosen, tries)


def quantized_fraction(sizes: dict[str, int], quantized: set[str] | frozenset[str]) -> float:
    """The share of `sizes` (FLOPs or weight elements per layer) that the `quantized` layers cover."""
    total = max(sum(sizes.values()), 1)
    return sum(size for name, size in sizes.items() if name in quantized) / total
