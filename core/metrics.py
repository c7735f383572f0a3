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
from tensorsmith.core.formats import absolute_max
from tensorsmith.core.importing import import_factory
from tensorsmith.core.language import language_model_metrics

Outputs = Sequence[np.ndarray]


# Elements compared at once (16 MB in float32): a decoder's evaluation outputs (logits for every position) are
# hundreds of MB, and each float64 copy of the whole put 1 GB more on the INT4 variants' peak at SmolLM-135M.
CHUNK_ELEMENTS = 1 << 22


def _sample_chunks(reference: np.ndarray, actual: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Both arrays as [samples, elements] (axis 0 is the sample), in float32 (or float64 where given so), a few
    whole samples at a time."""
    r, a = _per_sample(reference), _per_sample(actual)
    step = max(1, CHUNK_ELEMENTS // max(1, r.shape[1]))
    for start in range(0, len(r), step):
        yield _real(r[start : start + step]), _real(a[start : start + step])


def _real(array: np.ndarray) -> np.ndarray:
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float32)


def _per_sample(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)


def sample_cosines(reference: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """The cosine between each sample's (axis 0) flattened outputs."""
    running = RunningAccuracy(1)
    running.add([reference], [actual])
    return running.cosines(0)


def relative_error(reference: np.ndarray, actual: np.ndarray) -> float:
    """max |actual - reference| / max |reference|: the error relative to the output's scale."""
    running = RunningAccuracy(1)
    running.add([reference], [actual])
    return running.figures()["max_relative_error"]


def mean_cosine(reference: np.ndarray, actual: np.ndarray) -> float:
    """Mean over samples (axis 0) of the cosine between each sample's flattened outputs."""
    return float(np.mean(sample_cosines(reference, actual)))


def _worst(*values: float) -> float:
    """The largest of `values`, NaN if any is (Python's max passes over a NaN after the first value: a variant that
    overflows would measure an error of 0)."""
    return float(np.max(values))


def _figure(name: str) -> Callable[[Outputs, Outputs], float]:
    def measure(reference: Outputs, actual: Outputs) -> float:
        running = RunningAccuracy(len(reference))
        running.add(reference, actual)
        return running.figure(name)

    return measure


Metric = Callable[[Outputs, Outputs], float]
METRICS: dict[str, tuple[Metric, bool]] = {  # name → (function, higher is better)
    "cosine": (_figure("cosine"), True),
    "min-cosine": (_figure("min-cosine"), True),
    "max-abs": (_figure("max-abs"), False),
    "sqnr-db": (_figure("sqnr-db"), True),
}
# A metric's value for a variant equal to its reference: how far a layer's sensitivity is from it is what quantizing
# that layer alone costs (the report's sensitivity chart); a metric without one (sqnr-db, perplexity) is ranked only.
LOSSLESS = {"cosine": 1.0, "min-cosine": 1.0, "max-abs": 0.0, "perplexity-ratio": 1.0, "next-token-agreement": 1.0}
LANGUAGE_METRICS = {"perplexity-ratio": False, "next-token-agreement": True, "perplexity": False}  # higher better?


def accuracy(reference: Outputs, actual: Outputs) -> dict[str, float]:
    """The figures recorded for every variant: cosine, min-cosine, sqnr-db and max_relative_error."""
    running = RunningAccuracy(len(reference))
    running.add(reference, actual)
    return running.figures()


class RunningAccuracy:
    """accuracy()'s figures (and max-abs) from outputs given a few samples at a time: a decoder's evaluation
    outputs are its logits at every position, and a variant's need never be held whole beside the reference's."""

    def __init__(self, count: int) -> None:
        self._cosines: list[list[np.ndarray]] = [[] for _ in range(count)]
        self._signal, self._noise = [0.0] * count, [0.0] * count
        self._scale, self._difference = [0.0] * count, [0.0] * count

    def add(self, reference: Outputs, actual: Outputs) -> None:
        """The next samples (axis 0) of every output, in order."""
        for index, (ref, act) in enumerate(zip(reference, actual, strict=True)):
            for r, a in _sample_chunks(ref, act):
                # per sample: |r|², |a|² and |a - r|², products summed in float64 without a float64 copy (4.7x
                # faster than the copies at SmolLM-135M's logits); the cosine from them as 1 - (|d|² - (|a| -
                # |r|)²) / 2|r||a|, exact algebra that keeps a cosine near 1 as precise as |d|² is
                difference = a - r
                signal, power, noise = (np.einsum("ij,ij->i", x, x, dtype=np.float64) for x in (r, a, difference))
                norms = np.sqrt(signal * power)
                with np.errstate(invalid="ignore", divide="ignore"):
                    cosines = 1.0 - (noise - (np.sqrt(power) - np.sqrt(signal)) ** 2) / (2.0 * norms)
                self._cosines[index].append(np.where(norms == 0, 1.0, cosines))  # a NaN sample's cosine stays NaN
                if r.size:
                    self._signal[index] += float(np.sum(signal))
                    self._noise[index] += float(np.sum(noise))
                    self._scale[index] = _worst(self._scale[index], float(absolute_max(r)))
                    self._difference[index] = _worst(self._difference[index], float(absolute_max(difference)))

    def cosines(self, index: int) -> np.ndarray:
        """Output `index`'s cosine per sample so far."""
        chunks = self._cosines[index]
        return np.concatenate(chunks) if chunks else np.ones(0)

    def figures(self) -> dict[str, float]:
        """What a variant record's accuracy holds: cosine, min-cosine, sqnr-db and max_relative_error, each the
        worst output's."""
        cosines = [self.cosines(index) if self._cosines[index] else np.ones(1) for index in range(len(self._cosines))]
        sqnr = [
            np.inf if noise == 0 else 10 * np.log10(signal / noise)
            for signal, noise in zip(self._signal, self._noise, strict=True)
        ]
        relative = [
            difference / scale if scale > 0 else difference
            for scale, difference in zip(self._scale, self._difference, strict=True)
        ]
        worst_relative = _worst(*relative) if relative else 0.0
        return {
            "cosine": float(np.min([np.mean(c) for c in cosines])),  # np.min: a NaN is the worst, never passed over
            "min-cosine": float(np.min([np.min(c) for c in cosines])),
            "sqnr-db": float(np.min(sqnr)),
            "max_relative_error": worst_relative,
        }

    def figure(self, name: str) -> float:
        """One of METRICS' figures (max-abs: the largest absolute difference of any output)."""
        return _worst(0.0, *self._difference) if name == "max-abs" else self.figures()[name]


_BUDGET = re.compile(r"^\s*([A-Za-z0-9_.\-:]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class BudgetTerms:
    """A budget's text read as it is written: `metric`, `comparison` (">=" or "<="), `value`."""

    metric: str
    comparison: str
    value: float

    @property
    def higher_is_better(self) -> bool:
        return self.comparison == ">="


def budget_terms(text: str) -> BudgetTerms | None:
    """The terms of a budget's text, None if it has not that form; unlike `Budget.parse`, it imports no user
    function (the report reads budgets back this way)."""
    match = _BUDGET.match(text)
    return BudgetTerms(match.group(1), match.group(2), float(match.group(3))) if match else None


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
        name, comparison, value = terms.metric, terms.comparison, terms.value
        function: Metric | None
        if name in METRICS:
            function, higher = METRICS[name]
        elif name in LANGUAGE_METRICS:
            function, higher = None, LANGUAGE_METRICS[name]
        elif ":" in name:
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

    @property
    def met_by_the_reference(self) -> bool:
        """Whether the fp32 reference, what every variant is measured against, meets this budget: a metric's
        lossless value meets it (False where the metric has none: sqnr-db, perplexity, a function of yours)."""
        lossless = LOSSLESS.get(self.metric)
        return lossless is not None and self.met(lossless)

    def __str__(self) -> str:
        return f"{self.metric}{self.comparison}{self.value:g}"


def loss(metric: str, higher_is_better: bool, value: float) -> float | None:
    """What `value` of `metric` costs against the reference (negative: better than it), None where the metric
    has no lossless value."""
    lossless = LOSSLESS.get(metric)
    if lossless is None:
        return None
    return lossless - value if higher_is_better else value - lossless
