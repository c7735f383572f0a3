"""Accuracy of a variant against the fp32 reference, and the accuracy budget a precision plan must meet.

Metrics compare every output and report the worst one: `cosine` (mean per-sample cosine), `min-cosine`
(the worst sample's), `max-abs` (largest absolute difference), `sqnr-db` (signal-to-quantization-noise ratio),
or a user function `pkg.module:function(reference, outputs) -> float` over the lists of output arrays. A
decoder's budgets may also be language-model metrics of its first output (the logits) on token windows:
`perplexity-ratio` (variant over fp32), `next-token-agreement`, `perplexity` (core/language.py).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tensorsmith.core.errors import ConfigError
from tensorsmith.core.language import language_model_metrics

Outputs = Sequence[np.ndarray]


# Elements compared at once in float64 (32 MB): a decoder's evaluation outputs (logits for every position) are
# hundreds of MB, and each float64 copy of the whole put 1 GB more on the INT4 variants' peak at SmolLM-135M.
CHUNK_ELEMENTS = 1 << 22


def _sample_chunks(reference: np.ndarray, actual: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Both arrays as [samples, elements] (axis 0 is the sample), in float64, a few whole samples at a time."""
    r, a = _per_sample(reference), _per_sample(actual)
    step = max(1, CHUNK_ELEMENTS // max(1, r.shape[1]))
    for start in range(0, len(r), step):
        yield r[start : start + step].astype(np.float64), a[start : start + step].astype(np.float64)


def _per_sample(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)


def relative_error(reference: np.ndarray, actual: np.ndarray) -> float:
    """max |actual - reference| / max |reference|: the error relative to the output's scale."""
    scale = difference = 0.0
    for r, a in _sample_chunks(reference, actual):
        if r.size:
            scale = max(scale, float(np.max(np.abs(r))))
            difference = max(difference, float(np.max(np.abs(a - r))))
    return difference / scale if scale > 0 else difference


def sample_cosines(reference: np.ndarray, actual: np.ndarray) -> np.ndarray:
    chunks = []
    for a, b in _sample_chunks(reference, actual):
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        chunks.append(np.where(norms > 0, np.einsum("ij,ij->i", a, b) / np.where(norms > 0, norms, 1.0), 1.0))
    return np.concatenate(chunks) if chunks else np.ones(0)


def mean_cosine(reference: np.ndarray, actual: np.ndarray) -> float:
    """Mean over samples (axis 0) of the cosine between each sample's flattened outputs."""
    return float(np.mean(sample_cosines(reference, actual)))


def _cosine(reference: Outputs, actual: Outputs) -> float:
    return min(mean_cosine(r, a) for r, a in zip(reference, actual, strict=True))


def _min_cosine(reference: Outputs, actual: Outputs) -> float:
    return min(float(np.min(sample_cosines(r, a))) for r, a in zip(reference, actual, strict=True))


def _max_abs(reference: Outputs, actual: Outputs) -> float:
    return max(
        max((float(np.max(np.abs(a - r))) for r, a in _sample_chunks(ref, act) if r.size), default=0.0)
        for ref, act in zip(reference, actual, strict=True)
    )


def _sqnr_db(reference: Outputs, actual: Outputs) -> float:
    worst = np.inf
    for ref, act in zip(reference, actual, strict=True):
        signal = noise = 0.0
        for r, a in _sample_chunks(ref, act):
            signal += float(np.sum(r**2))
            noise += float(np.sum((a - r) ** 2))
        worst = min(worst, np.inf if noise == 0 else 10 * np.log10(signal / noise))
    return float(worst)


Metric = Callable[[Outputs, Outputs], float]
METRICS: dict[str, tuple[Metric, bool]] = {  # name → (function, higher is better)
    "cosine": (_cosine, True),
    "min-cosine": (_min_cosine, True),
    "max-abs": (_max_abs, False),
    "sqnr-db": (_sqnr_db, True),
}
LANGUAGE_METRICS = {"perplexity-ratio": False, "next-token-agreement": True, "perplexity": False}  # higher better?


def accuracy(reference: Outputs, actual: Outputs) -> dict[str, float]:
    """The figures recorded for every variant: cosine, min-cosine, sqnr-db and max_relative_error."""
    cosines = [sample_cosines(r, a) for r, a in zip(reference, actual, strict=True)]  # once for both figures
    return {
        "cosine": min(float(np.mean(c)) for c in cosines),
        "min-cosine": min(float(np.min(c)) for c in cosines),
        "sqnr-db": _sqnr_db(reference, actual),
        "max_relative_error": max(relative_error(r, a) for r, a in zip(reference, actual, strict=True)),
    }


_BUDGET = re.compile(r"^\s*([A-Za-z0-9_.\-:]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


def budget_terms(text: str) -> tuple[str, str, float] | None:
    """(metric, ">=" or "<=", value) of a budget's text, None if it has not that form; unlike `Budget.parse`, it
    imports no user function (the report reads budgets back this way)."""
    match = _BUDGET.match(text)
    return (match.group(1), match.group(2), float(match.group(3))) if match else None


@dataclass(frozen=True)
class Budget:
    """`metric >= value` or `metric <= value`, e.g. 'cosine>=0.995', 'max-abs<=0.05'."""

    metric: str
    comparison: str
    value: float
    function: Metric | None  # None for a language-model metric, measured on `tokens`
    higher_is_better: bool
    tokens: np.ndarray | None = None  # [rows, length]: the windows a language-model metric is measured on

    @classmethod
    def parse(cls, text: str) -> Budget:
        terms = budget_terms(text)
        if terms is None:
            raise ConfigError(
                f"budget {text!r} is not METRIC>=VALUE or METRIC<=VALUE",
                hint=f"e.g. --budget 'cosine>=0.995'; metrics: {', '.join(METRICS)} or pkg.module:function",
            )
        name, comparison, value = terms
        function: Metric | None
        if name in METRICS:
            function, higher = METRICS[name]
        elif name in LANGUAGE_METRICS:
            function, higher = None, LANGUAGE_METRICS[name]
        elif ":" in name:
            from tensorsmith.core.importing import import_factory

            function, higher = import_factory(name), comparison == ">="
        else:
            raise ConfigError(
                f"unknown metric {name!r} in budget {text!r}",
                hint=f"metrics: {', '.join([*METRICS, *LANGUAGE_METRICS])}",
            )
        if (comparison == ">=") != higher:
            raise ConfigError(
                f"budget {text!r} asks {name} to be {'at most' if comparison == '<=' else 'at least'} a value, "
                f"but {'higher' if higher else 'lower'} {name} is better",
                hint=f"use {name}{'>=' if higher else '<='}{value:g}",
            )
        return cls(name, comparison, value, function, higher)

    @property
    def is_language(self) -> bool:
        return self.function is None

    def on_tokens(self, tokens: np.ndarray) -> Budget:
        """This budget measured on `tokens` (the rows of the feeds its outputs come from, in order)."""
        return replace(self, tokens=tokens)

    def measure(self, reference: Outputs, actual: Outputs) -> float:
        if self.function is not None:
            return float(self.function(reference, actual))
        if self.tokens is None:
            raise ConfigError(
                f"budget {self} is a language-model metric, measured on a decoder's text only",
                hint="use it with a text-generation source and --calibration/--eval-data text",
            )
        rows = len(actual[0])  # a search measures the first rows of the evaluation feeds
        return language_model_metrics(self.tokens[:rows], reference[0][:rows], actual[0])[self.metric]

    def met(self, measured: float) -> bool:
        compare = operator.ge if self.comparison == ">=" else operator.le
        return bool(compare(measured, self.value))

    def __str__(self) -> str:
        return f"{self.metric}{self.comparison}{self.value:g}"
