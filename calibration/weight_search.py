"""Per-layer weight precision for decoders under a budget: each weight MatMul in int4, int8 (weight-only) or its
float precision, chosen so that the budget holds and the weights take the fewest bytes (what decoding pays).

One ONNX Runtime session over a *switched* graph evaluates any assignment: layer i's weight is
W + s4_i·(W4_i − W) + s8_i·(W8_i − W), with W4 and W8 the weights as the int4 and int8 variants compute them
(AWQ's scales folded back in), and the switches a graph input. Sensitivity: the metric with one layer moved.
Moves (fp16 → int8, int8 → int4) are ordered by metric lost per byte saved; the longest prefix of moves whose
assignment meets the budget is found by bisection. The compiler then verifies the real variant.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core.metrics import Budget
from tensorsmith.core.progress import LogReporter, Reporter
from tensorsmith.core.sessions import session_for

logger = logging.getLogger(__name__)

SWITCHES = "tensorsmith_weight_switches"
LEVELS = ("fp16", "int8", "int4")  # from the most bytes to the fewest


@dataclass(frozen=True)
class LayerOptions:
    """One weight MatMul: its weight as each precision computes it, and the bytes each stores."""

    int4: np.ndarray
    int8: np.ndarray
    bytes: Mapping[str, int]  # level → bytes stored


@dataclass
class WeightSearchResult:
    assignment: dict[str, str]  # layer → fp16 | int8 | int4
    moves: list[tuple[str, str]]  # (layer, level it moves to), cheapest per byte first
    chosen: int  # how many of `moves` the assignment takes
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)  # layer → level → metric
    estimate: float = 0.0
    evaluations: int = 0


def assignment_of(moves: list[tuple[str, str]], layers: list[str]) -> dict[str, str]:
    """Each layer at the deepest level the moves take it to (fp16 when none does)."""
    assignment = dict.fromkeys(layers, "fp16")
    for layer, level in moves:
        if LEVELS.index(level) > LEVELS.index(assignment[layer]):
            assignment[layer] = level
    return assignment


class WeightSearch:
    def __init__(
        self, model: onnx.ModelProto, options: Mapping[str, LayerOptions], feeds: dict[str, np.ndarray], budget: Budget
    ) -> None:

        self.layers = list(options)
        self.options = options
        self.budget = budget
        self.feeds = feeds
        graph = gs.import_onnx(model)
        switches = gs.Variable(SWITCHES, dtype=np.float32, shape=[2 * len(self.layers)])
        graph.inputs.append(switches)
        nodes = {node.name: node for node in graph.nodes}
        for index, name in enumerate(self.layers):
            node, option = nodes[name], options[name]
            weight = node.inputs[1]
            original = np.asarray(weight.values, np.float32)
            blended = weight
            for offset, level in ((0, option.int4), (len(self.layers), option.int8)):
                (switch,) = graph.layer(op="Gather", inputs=[switches, np.array(index + offset, np.int64)],
                                        outputs=[f"{name}/switch_{offset}"])  # fmt: skip
                delta = gs.Constant(f"{name}/delta_{offset}", (level - original).astype(np.float32))
                (moved,) = graph.layer(op="Mul", inputs=[delta, switch], outputs=[f"{name}/moved_{offset}"])
                (blended,) = graph.layer(op="Add", inputs=[blended, moved], outputs=[f"{name}/weight_{offset}"])
                switch.dtype = moved.dtype = blended.dtype = np.float32
            node.inputs[1] = blended
        self.session = session_for(gs.export_onnx(graph))
        self.output_names = [output.name for output in self.session.get_outputs()]
        self.evaluations = 0
        self.reference = self._run({})

    def _run(self, assignment: Mapping[str, str]) -> list[np.ndarray]:
        switches = np.zeros(2 * len(self.layers), np.float32)
        for index, name in enumerate(self.layers):
            level = assignment.get(name, "fp16")
            if level == "int4":
                switches[index] = 1.0
            elif level == "int8":
                switches[len(self.layers) + index] = 1.0
        return list(self.session.run(self.output_names, {**self.feeds, SWITCHES: switches}))

    def evaluate(self, assignment: Mapping[str, str]) -> float:
        self.evaluations += 1
        return self.budget.measure(self.reference, self._run(assignment))

    def search(self, reporter: Reporter | None = None) -> WeightSearchResult:
        reporter = reporter or LogReporter()
        baseline = self.evaluate({})
        sensitivity: dict[str, dict[str, float]] = {}
        with reporter.task("weight precision: sensitivity per layer (int8, int4)", 2 * len(self.layers)) as advance:
            for name in self.layers:
                sensitivity[name] = {level: self.evaluate({name: level}) for level in ("int8", "int4")}
                advance(2)

        def lost(value: float, before: float) -> float:
            return max(before - value if self.budget.higher_is_better else value - before, 1e-12)

        costs = []
        for name in self.layers:
            saved = self.options[name].bytes
            int8, int4 = sensitivity[name]["int8"], sensitivity[name]["int4"]
            costs.append((lost(int8, baseline) / max(saved["fp16"] - saved["int8"], 1), name, "int8"))
            costs.append((lost(int4, int8) / max(saved["int8"] - saved["int4"], 1), name, "int4"))
        moves = [(name, level) for _, name, level in sorted(costs, key=lambda cost: cost[0])]
        low, high, best = 0, len(moves), baseline  # invariant: the first `low` moves meet the budget
        with reporter.task("weight precision: bisecting the moves within budget", None) as advance:
            while low < high:
                middle = (low + high + 1) // 2
                value = self.evaluate(assignment_of(moves[:middle], self.layers))
                advance(1)
                if self.budget.met(value):
                    low, best = middle, value
                else:
                    high = middle - 1
        assignment = assignment_of(moves[:low], self.layers)
        logger.info("%d of %d moves within %s (estimate %.6f)", low, len(moves), self.budget, best)
        return WeightSearchResult(assignment, moves, low, sensitivity, best, self.evaluations)
