"""A mixture of experts' stacked weights in a weight format: each expert's [K, N] slice quantized as a 2-D
weight is, blocks along K.

    W [E, K, N] ──► codes [E, K, N], scales [E, K/B, N] ──► DequantizeLinear(axis 1, block_size B) ──►
    Gather / GatherND (the routed branch) or MatMul (the every-expert branch); a weight stored [E, N, K] keeps
    its layout: codes [E, N, K], scales [E, N, K/B], axis 2

The export holds each stacked weight as an initializer of the If branch that reads it (compiler/frontend/
routed_experts.py: a branch gathers the chosen experts' weights, the other multiplies every expert); each copy
gets its DequantizeLinear where it is read, from codes made once per weight (and written once: core/
branch_copies.py). K is the axis the MatMul contracts: the middle one of x @ W, the last one of W @ x or behind
a Transpose; a weight whose K no MatMul shows, or whose K the format's block does not divide, stays float. In fp16
regions its DequantizeLinear computes in fp32 and its output is cast (passes/fp16.py): NVFP4's scales folded into
one level, or small MXFP4 powers of two, may be subnormal in fp16.

Checked with tensorrt-rtx 1.7: INT4 codes [E, N, K] through a DequantizeLinear and a Gather build for SM86 and
SM120 and the engine keeps the codes in 4 bits (8 experts of 256 x 512: 0.82 MB against 4.3 MB from fp32
weights); a Gather of the codes before the DequantizeLinear is refused (TensorRT's INT4 tensors feed a
DequantizeLinear only; ONNX Runtime's Gather takes no int4). ONNX Runtime dequantizes every expert at each run
of such a graph (610 ms against 30 ms a decode step of DeepSeek-V2-Lite's 64 experts, measured), so the cpu
variant keeps its experts in float.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.errors import PassError
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.weight_formats.base import Quantized, WeightFormat, stored_constant


def graphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """`graph` and every subgraph under it (If branches, Loop and Scan bodies)."""
    yield graph
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                yield from graphs(value)


def stacked_weights(graph: gs.Graph) -> dict[str, int]:
    """Each stacked experts' weight (a float 3-D constant whose experts a Gather or GatherND picks, or a MatMul
    multiplies, in any graph) → the axis of its K, from the MatMul that contracts it (through the Gather of the
    chosen experts and a Transpose). A weight no MatMul is found to contract stays out: nothing says where K is."""
    found: dict[str, set[int]] = {}
    for sub in graphs(graph):
        for node in sub.nodes:
            for tensor in node.inputs:
                if _stacked_weight(node, tensor):
                    axis = _contracted_axis(tensor)
                    found.setdefault(tensor.name, set()).update({axis} if axis is not None else set())
    return {name: axes.pop() for name, axes in found.items() if len(axes) == 1}  # copies that disagree stay out


def _stacked_weight(node: gs.Node, tensor: gs.Tensor) -> bool:
    """Whether `node` reads `tensor` as a float [experts, ·, ·] weight: the data a Gather picks experts from
    (axis 0), a GatherND's data (no batch dims, one index a row), or a MatMul's operand."""
    if not isinstance(tensor, gs.Constant) or len(tensor.shape) != 3 or not np.issubdtype(tensor.dtype, np.floating):
        return False
    if node.op == "Gather":
        return node.inputs[0] is tensor and int(node.attrs.get("axis", 0)) == 0
    if node.op == "GatherND":
        index = node.inputs[1].shape
        rows = index is not None and len(index) > 0 and index[-1] == 1
        return node.inputs[0] is tensor and int(node.attrs.get("batch_dims", 0)) == 0 and rows
    return node.op == "MatMul" and tensor in node.inputs[:2]


def _contracted_axis(tensor: gs.Tensor, swapped: bool = False) -> int | None:
    """The weight's axis a MatMul contracts: its second input's middle axis (x @ W reads W [E, K, N]), its first
    input's last (W @ x: [E, N, K], as a gathered expert's product is written), either swapped behind a Transpose of
    the last two axes; None where no MatMul is found."""
    for user in tensor.outputs:
        if user.op == "MatMul" and tensor in user.inputs[:2]:
            middle = user.inputs[1] is tensor
            return 1 if middle != swapped else 2
        if user.op in ("Gather", "GatherND") and user.inputs[0] is tensor:
            return _contracted_axis(user.outputs[0], swapped)
        if user.op == "Transpose" and list(user.attrs.get("perm", [])) == [0, 2, 1]:
            return _contracted_axis(user.outputs[0], not swapped)
    return None


class StackedDetails(PassDetails):
    precision: str
    weights: dict[str, list[int]]  # stacked weight → its shape
    block_sizes: list[int]  # rows of K a scale covers
    weight_bytes: int  # codes and scales, once per weight (an If's branches read the same bytes)
    skipped: dict[str, str]  # stacked weight → why it stays float
    stored: int = 0  # weights whose codes are a checkpoint's own, as stored


@dataclass
class StackedWeightOnly:
    """The stacked experts' weights of the graph in `format` (the module's sketch); in the graph ONNX Runtime
    measures (`measured`) where it cannot run the format, the same values in float32."""

    format: WeightFormat
    block: int
    measured: bool = False
    stored: Mapping[str, Callable[[], Quantized]] = field(default_factory=dict)  # a checkpoint's own [E, K, N]
    name: str = ""
    made: dict[str, Quantized] = field(default_factory=dict)  # weight → its codes, made once for every copy
    copies: dict[str, int] = field(default_factory=dict)  # weight → DequantizeLinear written for it so far

    def __post_init__(self) -> None:
        self.name = self.name or f"stacked_{self.format.record.name.replace('-', '_')}"

    def __call__(self, graph: gs.Graph) -> PassReport:
        found = stacked_weights(graph)
        shapes: dict[str, list[int]] = {}
        skipped = {  # the format's block must divide K (TensorRT takes whole blocks only), else the weight stays float
            name: f"its K ({graph_shape[axis]}) is not a multiple of a {self.format.record.name} block"
            for name, (graph_shape, axis) in _shapes(graph, found).items()
            if self.format.block_for(graph_shape[axis], self.block) is None
        }
        axes = {name: axis for name, axis in found.items() if name not in skipped}
        for sub in graphs(graph):
            for node in list(sub.nodes):
                for index, tensor in enumerate(node.inputs):
                    if isinstance(tensor, gs.Constant) and tensor.name in axes:
                        shapes[tensor.name] = list(tensor.shape)
                        node.inputs[index] = self._read(sub, tensor, axes[tensor.name])
        bits = self.format.record.element.bits
        report = PassReport(
            self.name,
            changed=bool(shapes),
            counts={"stacked_weights": len(shapes)},
            details=StackedDetails(
                precision=self.format.record.name,
                weights=shapes,
                block_sizes=sorted({q.codes.shape[axes[n]] // q.scales.shape[axes[n]] for n, q in self.made.items()}),
                weight_bytes=sum(q.codes.size * bits // 8 + q.scales.nbytes for q in self.made.values()),
                stored=sum(self._stored(name) is not None for name in shapes),
                skipped=skipped,
            ),
        )
        self.made.clear()  # each weight's codes live in the graph now: held here too, a model's experts twice
        return report

    def _quantized(self, tensor: gs.Constant, axis: int) -> Quantized:
        """Each expert's [K, N] slice in the format, stacked back in the weight's layout: codes as the weight,
        scales [E, K/B, N] (or [E, N, K/B] for K last)."""
        if tensor.name not in self.made:
            weight = np.asarray(tensor.values, np.float32)
            slices = weight if axis == 1 else np.swapaxes(weight, 1, 2)  # [E, K, N]
            stored = self._stored(tensor.name)
            own = stored() if stored is not None else None
            if own is not None:
                if not all(np.array_equal(_values(own, 1, expert), slices[expert]) for expert in range(len(slices))):
                    raise PassError(
                        f"{tensor.name}: the graph's weight is not the checkpoint's {self.format.record.name} codes "
                        "times their scales",
                        hint="please report this with -v",
                    )
                codes, scales = own.codes, own.scales
            else:
                block = self.format.block_for(slices.shape[1], self.block)
                each = [self.format.quantize(np.ascontiguousarray(part), block) for part in slices]
                codes = np.stack([q.codes for q in each])
                scales = np.stack([q.one_level_scales().reshape(-1, q.codes.shape[1]) for q in each])
            if axis == 2:
                codes, scales = np.swapaxes(codes, 1, 2), np.swapaxes(scales, 1, 2)
            compact = codes.astype(self.format.record.element.numpy_dtype())  # a byte a code, not float32's four
            self.made[tensor.name] = Quantized(np.ascontiguousarray(compact), np.ascontiguousarray(scales))
            del weight, slices, codes
        return self.made[tensor.name]

    def _stored(self, name: str) -> Callable[[], Quantized] | None:
        """The checkpoint's own codes of the graph's weight `name`: stored under its name, or under the name the
        checkpoint gives it inside the exported module (`model.` + the checkpoint's)."""
        for stored, quantized in self.stored.items():
            if name == stored or name.endswith(f".{stored}"):
                return quantized
        return None

    def _read(self, graph: gs.Graph, tensor: gs.Constant, axis: int) -> gs.Tensor:
        """The weight as the format stores it, read where `graph` reads it: a DequantizeLinear first in `graph`
        (its inputs are constants), or the measured values."""
        made = self._quantized(tensor, axis)
        rows, groups = made.codes.shape[axis], made.scales.shape[axis]
        if self.measured and not self.format.onnxruntime_runs:
            scales = np.repeat(made.scales, rows // groups, axis=axis)
            return gs.Constant(
                f"{tensor.name}/{self.format.record.name}_values", made.codes.astype(np.float32) * scales
            )
        element = self.format.record.element
        inputs = [
            stored_constant(f"{tensor.name}/codes", made.codes, element),
            gs.Constant(f"{tensor.name}/scales", made.scales.astype(np.float32)),
        ]
        if element.is_integer:
            inputs.append(stored_constant(f"{tensor.name}/zero_point", np.zeros(made.scales.shape), element))
        # one name per copy: the branches of an If may read one weight, and TensorRT names its layers by them
        copy = self.copies[tensor.name] = self.copies.get(tensor.name, -1) + 1
        suffix = f"_{copy}" if copy else ""
        dequantized = gs.Variable(f"{tensor.name}/dequantized{suffix}", dtype=np.float32, shape=list(made.codes.shape))
        graph.nodes.insert(
            0,
            gs.Node(
                "DequantizeLinear",
                name=f"{tensor.name}/DequantizeLinear{suffix}",
                attrs={"axis": axis, "block_size": rows // groups},
                inputs=inputs,
                outputs=[dequantized],
            ),
        )
        return dequantized


def _shapes(graph: gs.Graph, axes: Mapping[str, int]) -> dict[str, tuple[list[int], int]]:
    """Each of the stacked weights' shape and K axis."""
    return {
        tensor.name: (list(tensor.shape), axes[tensor.name])
        for sub in graphs(graph)
        for node in sub.nodes
        for tensor in node.inputs
        if isinstance(tensor, gs.Constant) and tensor.name in axes
    }


def _values(stacked: Quantized, axis: int, expert: int | None = None) -> np.ndarray:
    """Stacked codes times their scales (one expert's, where given), each scale repeated over its block along
    `axis` (K): float32."""
    block = stacked.codes.shape[axis] // stacked.scales.shape[axis]
    if expert is None:
        return stacked.codes.astype(np.float32) * np.repeat(stacked.scales.astype(np.float32), block, axis=axis)
    scales = np.repeat(stacked.scales[expert].astype(np.float32), block, axis=axis - 1)
    return stacked.codes[expert].astype(np.float32) * scales
