"""Choose which layers to quantize so that an accuracy budget holds.

One ONNX Runtime session over the *switched* graph (passes/quantize.py) evaluates any subset of quantized
layers by feeding a vector of 0s and 1s. Sensitivity: the metric with only that layer quantized. Search: layers
ordered by the metric they cost per FLOP they save (cheapest first, so big, robust layers go first), the
largest prefix that meets the budget found by bisection: log2(n) + 1 full evaluations after the n sensitivity
runs. The compiler then verifies the real variant graph.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core.budget_search import largest_prefix
from tensorsmith.core.metrics import Budget
from tensorsmith.core.progress import LogReporter, Reporter
from tensorsmith.core.sessions import session_for
from tensorsmith.passes import run_passes
from tensorsmith.passes.quantize import SWITCHES, InsertQDQ, Precision

logger = logging.getLogger(__name__)


@dataclass
class SearchResult:
    quantized: list[str]  # the chosen prefix of `order`
    order: list[str]  # every candidate, cheapest (metric lost per FLOP) first
    sensitivity: dict[str, float]  # the metric with only that layer quantized
    estimate: float  # the metric of the chosen set on the switched graph
    baseline: float  # the metric with nothing quantized (1.0 for cosine, up to float noise)
    evaluations: int


class PrecisionSearch:
    def __init__(
        self,
        model: onnx.ModelProto,
        precision: Precision,
        scales: Mapping[str, float],
        candidates: Sequence[str],
        feeds: dict[str, np.ndarray],
        budget: Budget,
        flops: Mapping[str, int] | None = None,
    ) -> None:

        self.candidates = list(candidates)
        self.flops = dict(flops or {})
        self.budget = budget
        self.feeds = feeds
        graph = gs.import_onnx(model)
        run_passes(graph, [InsertQDQ(precision, scales, nodes=self.candidates, switched=True)])
        self.session = session_for(gs.export_onnx(graph))
        self.output_names = [output.name for output in self.session.get_outputs()]
        self.evaluations = 0
        self.reference = self._run(set())

    def _run(self, quantized: set[str]) -> list[np.ndarray]:
        switches = np.array([1.0 if name in quantized else 0.0 for name in self.candidates], np.float32)
        return list(self.session.run(self.output_names, {**self.feeds, SWITCHES: switches}))

    def evaluate(self, quantized: set[str]) -> float:
        """The budget's metric with exactly `quantized` layers quantized (all zeros: the float graph's values)."""
        self.evaluations += 1
        return self.budget.measure(self.reference, self._run(quantized))

    def search(self, reporter: Reporter | None = None) -> SearchResult:
        reporter = reporter or LogReporter()
        sensitivity = {}
        with reporter.task("sensitivity per layer", len(self.candidates)) as advance:
            for name in self.candidates:
                sensitivity[name] = self.evaluate({name})
                advance(1)
        baseline = self.evaluate(set())

        def cost(name: str) -> float:  # metric lost per FLOP quantized (a tiny floor keeps free layers ordered)
            lost = baseline - sensitivity[name] if self.budget.higher_is_better else sensitivity[name] - baseline
            return max(lost, 1e-12) / max(self.flops.get(name, 1), 1)

        order = sorted(self.candidates, key=cost)
        with reporter.task("bisecting the largest set within budget", None) as advance:
            prefix = largest_prefix(
                len(order), lambda n: self.evaluate(set(order[:n])), self.budget.met, baseline, advance
            )
        low, best_value = prefix.length, prefix.value
        logger.info("%d of %d layers within %s (estimate %.6f)", low, len(order), self.budget, best_value)
        return SearchResult(order[:low], order, sensitivity, best_value, baseline, self.evaluations)
