"""A small benchmark runner: time callables side by side, report min/median/max and ratios, write markdown.

Measurements alternate A, B, A, B… so drift in the machine's speed hits both sides alike; ratios are taken
pair by pair and summarized by their median. Every script in bench/ uses this and prints a markdown table; its
figures go into docs/benchmarks.md (tables there put each figure beside its anchor's).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Timing:
    name: str
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def summary(self) -> str:
        ms = [s * 1e3 for s in self.seconds]
        return f"{min(ms):.2f} / {statistics.median(ms):.2f} / {max(ms):.2f}"


def compare(
    candidates: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3
) -> tuple[dict[str, Timing], dict[str, float]]:
    """Time each candidate `repeats` times, interleaved. Returns the timings and, for every candidate after the
    first, the median of its pairwise ratio to the first (candidate / first)."""
    timings = {name: Timing(name) for name in candidates}
    for _ in range(warmup):
        for function in candidates.values():
            function()
    for _ in range(repeats):
        for name, function in candidates.items():
            started = time.perf_counter()
            function()
            timings[name].seconds.append(time.perf_counter() - started)
    names = list(candidates)
    baseline = timings[names[0]].seconds
    ratios = {
        name: statistics.median(t / b for t, b in zip(timings[name].seconds, baseline, strict=True))
        for name in names[1:]
    }
    return timings, ratios


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
