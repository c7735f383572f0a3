"""Per-layer weight precision for decoders under a budget: each weight MatMul in int4, one byte a weight (int8
weight-only, or int8 / fp8 with calibrated activations where the targets run them) or its float precision,
chosen so that the budget holds and the weights take the fewest bytes (what decoding pays).

One ONNX Runtime session over a *switched* graph evaluates any assignment: layer i's weight is W_l where its
switch s_il is on (W_l the weight as level l computes it, AWQ's scales folded back in for int4; W where none is),
and its input QDQ_l(x) for the levels that quantize activations (an If: the Q/DQ runs only when on); the
switches are a graph input.
Sensitivity: the metric with one layer moved. At one byte a weight, a layer takes the level that loses least
(weight-only int8 on a tie). Moves (float → one byte, one byte → int4) are ordered by metric lost per byte
saved; the longest prefix of moves whose assignment meets the budget is found by bisection. The compiler then
verifies the real variant.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core import precisions
from tensorsmith.core.budget_search import largest_prefix
from tensorsmith.core.metrics import Budget
from tensorsmith.core.progress import LogReporter, Reporter
from tensorsmith.core.sessions import session_for
from tensorsmith.passes.quantize import quantize_activation, switched

logger = logging.getLogger(__name__)

SWITCHES = "tensorsmith_weight_switches"
FLOAT = precisions.float_regions(on_gpu=True).name  # a layer left in the variant's float type (fp32 in the cpu variant)


def depth(level: str) -> int:
    """How far a level narrows a weight: 0 in float, 16 / bits beyond (fewer bytes deeper)."""
    record = precisions.precision(level)
    return 0 if record.is_float else 16 // record.element.bits


def by_bits(levels: Collection[str]) -> list[tuple[str, ...]]:
    """The quantized levels among `levels` grouped by the bits a weight takes, most first; in a group weight-only
    first, then in the table's order: a tie between levels of one group goes to the first."""
    records = [record for record in precisions.decoder_levels() if record.name in levels]
    records.sort(key=lambda record: (-record.element.bits, record.quantizes_activations))
    groups: dict[int, tuple[str, ...]] = {}
    for record in records:
        groups[record.element.bits] = (*groups.get(record.element.bits, ()), record.name)
    return list(groups.values())


def bytes_in_words(level: str) -> str:
    """What one weight takes at `level`, as precision.json says it."""
    bits = precisions.precision(level).element.bits
    return {8: "one byte", 4: "half a byte"}.get(bits, f"{bits} bits")


@dataclass(frozen=True)
class LayerOptions:
    """One weight MatMul: its weight as each level computes it, the bytes each level stores, its input activation
    and the per-tensor scale of that input for the levels that quantize it."""

    weights: Mapping[str, np.ndarray]  # level → the weight it computes with (every level but FLOAT)
    bytes: Mapping[str, int]  # level → bytes stored (FLOAT too)
    activation: str = ""
    activation_scales: Mapping[str, float] = field(default_factory=dict)  # W8A8 level → scale of `activation`
    pinned: str | None = None  # a level fixed by an override: never moved


@dataclass
class WeightSearchResult:
    assignment: dict[str, str]  # layer → level
    moves: list[tuple[str, str]]  # (layer, level it moves to), cheapest per byte first
    chosen: int  # how many of `moves` the assignment takes
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)  # layer → level → metric
    estimate: float = 0.0
    evaluations: int = 0
    pinned: dict[str, str] = field(default_factory=dict)  # layer → level an override fixed

    def assignment_at(self, chosen: int) -> dict[str, str]:
        """The assignment of the first `chosen` moves (with the pinned layers)."""
        return assignment_of(self.moves[:chosen], list(self.assignment), self.pinned)


def assignment_of(
    moves: list[tuple[str, str]], layers: list[str], pinned: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Each layer at the deepest level the moves take it to (FLOAT when none does, its pin when pinned)."""
    assignment = dict.fromkeys(layers, FLOAT) | dict(pinned or {})
    for layer, level in moves:
        if depth(level) > depth(assignment[layer]):
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
        self.slots = {
            (name, level): index
            for index, (name, level) in enumerate(
                (name, level) for name in self.layers for level in options[name].weights
            )
        }
        graph = gs.import_onnx(model)
        switches = gs.Variable(SWITCHES, dtype=np.float32, shape=[len(self.slots)])
        graph.inputs.append(switches)
        nodes = {node.name: node for node in graph.nodes}

        def switch(index: int) -> gs.Variable:
            (value,) = graph.layer(op="Gather", inputs=[switches, np.array(index, np.int64)], outputs=["switch"])
            value.dtype = np.float32
            return value

        for name in self.layers:
            node, option = nodes[name], options[name]
            node.inputs[1] = self._chosen_weight(graph, switches, name, node.inputs[1], option)
            activation = node.inputs[0]
            for level in option.weights:
                if precisions.precision(level).quantizes_activations:
                    own = f"{node.inputs[0].name}/{level}/{name}"
                    scale = option.activation_scales[level]
                    quantize = functools.partial(
                        quantize_activation, tensor=node.inputs[0], scale=scale, precision=level, name=own
                    )
                    activation = switched(graph, activation, switch(self.slots[name, level]), own, quantize)
            node.inputs[0] = activation
        self.session = session_for(gs.export_onnx(graph))
        self.output_names = [output.name for output in self.session.get_outputs()]
        self.evaluations = 0
        self.reference = self._run({})

    def _chosen_weight(
        self, graph: gs.Graph, switches: gs.Variable, name: str, weight: gs.Tensor, option: LayerOptions
    ) -> gs.Variable:
        """Layer `name`'s weight at the level its switches choose: a Gather from its float weight and every level's,
        stacked, at index Σ_l (l + 1)·s_l (one level of a layer is on at a time; none keeps the float weight). One
        copy of the chosen weight a run; a sum of every level's difference scaled by its switch was two passes over
        the weight a level, in every run."""
        levels = list(option.weights)
        stack = np.stack([np.asarray(weight.values, np.float32), *(option.weights[level] for level in levels)])
        slots = np.array([self.slots[name, level] for level in levels], np.int64)
        (own,) = graph.layer(op="Gather", inputs=[switches, slots], outputs=[f"{name}/switches"])
        (counted,) = graph.layer(
            op="Mul", inputs=[own, np.arange(1, len(levels) + 1, dtype=np.float32)], outputs=[f"{name}/counted"]
        )
        (total,) = graph.layer(op="ReduceSum", inputs=[counted], outputs=[f"{name}/level"], attrs={"keepdims": 0})
        (index,) = graph.layer(
            op="Cast", inputs=[total], outputs=[f"{name}/level_index"], attrs={"to": onnx.TensorProto.INT64}
        )
        (chosen,) = graph.layer(
            op="Gather",
            inputs=[gs.Constant(f"{name}/weights_by_level", stack), index],
            outputs=[f"{name}/weight_chosen"],
            attrs={"axis": 0},
        )
        own.dtype, counted.dtype, total.dtype, chosen.dtype = np.float32, np.float32, np.float32, np.float32
        index.dtype = np.int64
        return chosen

    def _run(self, assignment: Mapping[str, str]) -> list[np.ndarray]:
        switches = np.zeros(len(self.slots), np.float32)
        for name, level in assignment.items():
            if level != FLOAT:
                switches[self.slots[name, level]] = 1.0
        return list(self.session.run(self.output_names, {**self.feeds, SWITCHES: switches}))

    def evaluate(self, assignment: Mapping[str, str]) -> float:
        self.evaluations += 1
        return self.budget.measure(self.reference, self._run(assignment))

    def search(self, reporter: Reporter | None = None) -> WeightSearchResult:
        reporter = reporter or LogReporter()
        pinned = {name: option.pinned for name, option in self.options.items() if option.pinned is not None}
        free = [name for name in self.layers if name not in pinned]
        baseline = self.evaluate(pinned)
        sensitivity: dict[str, dict[str, float]] = {}
        runs = sum(len(self.options[name].weights) for name in free)
        with reporter.task("weight precision: sensitivity per layer and level", runs) as advance:
            for name in free:
                sensitivity[name] = {}
                for level in self.options[name].weights:
                    sensitivity[name][level] = self.evaluate({**pinned, name: level})
                    advance(1)

        def lost(value: float, before: float) -> float:
            return before - value if self.budget.higher_is_better else value - before

        costs = []
        for name in free:
            stored, measured = self.options[name].bytes, sensitivity[name]
            before, level_before = baseline, FLOAT
            for group in by_bits(measured):  # float → the most bits → … → the fewest, one move a step
                # the level of the group that loses least (the first on a tie)
                level = min(group, key=lambda level: (lost(measured[level], baseline), group.index(level)))
                saved = max(stored[level_before] - stored[level], 1)
                costs.append((max(lost(measured[level], before), 1e-12) / saved, name, level))
                before, level_before = measured[level], level
        moves = [(name, level) for _, name, level in sorted(costs, key=lambda cost: cost[0])]
        with reporter.task("weight precision: bisecting the moves within budget", None) as advance:
            prefix = largest_prefix(
                len(moves),
                lambda n: self.evaluate(assignment_of(moves[:n], self.layers, pinned)),
                self.budget.met,
                baseline,
                advance,
            )
        low, best = prefix.length, prefix.value
        assignment = assignment_of(moves[:low], self.layers, pinned)
        logger.info("%d of %d moves within %s (estimate %.6f)", low, len(moves), self.budget, best)
        return WeightSearchResult(assignment, moves, low, sensitivity, best, self.evaluations, pinned)
