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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tensorsmith.core.errors import ConfigError
from tensorsmith.core.language import language_model_metrics

Outputs = Sequence[np.ndarray]


def relative_error(reference: np.ndarray, actual: np.ndarray) -> float:
    """max |actual - reference| / max |reference|: the error relative to the output's scale."""
    reference = np.asarray(reference, dtype=np.float64)
    actual = np.asarray(actual, dtype=np.float64)
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    difference = float(np.max(np.abs(actual - reference))) if reference.size else 0.0
    return difference / scale if scale > 0 else difference


def _per_sample(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array, dtype=np.float64)
    return array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)


def sample_cosines(reference: np.ndarray, actual: np.ndarray) -> np.ndarray:
    a, b = _per_sample(reference), _per_sample(actual)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.where(norms > 0, np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1.0), 1.0)


def mean_cosine(reference: np.ndarray, actual: np.ndarray) -> float:
    """Mean over samples (axis 0) of the cosine between each sample's flattened outputs."""
    return float(np.mean(sample_cosines(reference, actual)))


def _cosine(reference: Outputs, actual: Outputs) -> float:
    return min(mean_cosine(r, a) for r, a in zip(reference, actual, strict=True))


def _min_cosine(reference: Outputs, actual: Outputs) -> float:
    return min(float(np.min(sample_cosines(r, a))) for r, a in zip(reference, actual, strict=True))


def _max_abs(reference: Outputs, actual: Outputs) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r, np.float64))))
        for r, a in zip(reference, actual, strict=True)
    )


def _sqnr_db(reference: Outputs, actual: Outputs) -> float:
    worst = np.inf
    for r, a in zip(reference, actual, strict=True):
        signal = float(np.sum(np.asarray(r, np.float64) ** 2))
        noise = float(np.sum((np.asarray(a, np.float64) - np.asarray(r, np.float64)) ** 2))
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
    return {
        "cosine": _cosine(reference, actual),
        "min-cosine": _min_cosine(reference, actual),
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
