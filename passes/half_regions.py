"""Which nodes keep fp32 when a graph is converted to a half type, and so which of its tensors the half type holds
(`HalfRegions`): found before anything changes, by the one function (`half_regions`) that both `ConvertToHalf`
and `RoundToBf16` (passes/fp16.py) read.

A node keeps fp32 for what it is — an op named in `keep_fp32` (LayerNormalization by default: FP16 LayerNorm
overflows), NVFP4's scale-computing DequantizeLinear, fp8-weight's DequantizeLinear — or, where the half type is
narrower than fp32 (fp16), for range: the readers of a weight beyond it (a bf16 checkpoint's outlier, not
clipped), through the ops that only move values (an embedding table's Gather), and the writers and readers of
the activations named in `out_of_range`
(those that leave the range on the fp32 graph: compiler/variants/fp16_range.py measures them). Each node kept for
range is named, with the tensor and its max |x|, in `HalfRegions.for_range`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import BaseModel, ConfigDict

from tensorsmith.core.mapped_graph import values_unkept
from tensorsmith.passes.fp8_weights import CODES_SUFFIX
from tensorsmith.passes.half_float import FLOAT, HalfFloat, is_fp32, largest_outside

logger = logging.getLogger(__name__)

# LayerNormalization: fp16's overflows; Scan: linear attention's recurrent state, which sums over every token so
# far (compiler/frontend/linear_attention.py), in fp32 as transformers and the FLA kernels keep it
KEEP_FP32 = ("LayerNormalization", "Scan")
# Ops whose outputs hold their input's values, moved: an out-of-range weight read through one (an embedding table's
# Gather) is out of range at the op's readers too
MOVES_VALUES = frozenset(
    {
        "Gather",
        "GatherElements",
        "GatherND",
        "Transpose",
        "Reshape",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Slice",
        "Concat",
        "Split",
        "Expand",
        "Tile",
        "Identity",
        "Pad",
    }
)


class RangeKept(BaseModel):
    """Why a node keeps fp32 for range: `tensor`, which it reads (`reason` input or weight) or writes (output),
    reaches `max_abs`, beyond the half type's range; `module`: its module path, where the export recorded one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    tensor: str
    reason: str
    max_abs: float
    module: str | None = None


@dataclass(frozen=True)
class HalfRegions:
    """Where a graph computes in the half type once converted: what both passes change, found before either
    changes anything."""

    kept: list[gs.Node]  # the ops that keep fp32
    stay_fp32: list[gs.Variable]  # their outputs that need no narrowing: graph outputs, or read by kept ops only
    constants: list[gs.Constant]  # fp32 constants stored in half (not those read only by kept ops)
    constant_nodes: list[gs.Node]  # Constant / ConstantOfShape nodes whose fp32 value becomes half
    float_casts: list[gs.Node]  # Cast(to=FLOAT) nodes, which cast to half instead
    variables: list[gs.Variable]  # fp32 tensors held in half (graph inputs and outputs stay fp32 through Casts)
    for_range: dict[str, RangeKept]  # node → why it keeps fp32 for range


def _computes_a_scale(node: gs.Node) -> bool:
    """NVFP4's first DequantizeLinear (fp8 block scales × an fp32 tensor scale, read as the weight's DequantizeLinear
    scale): kept fp32, as Model Optimizer keeps it. In fp16 the tensor scale (amax / 2688) turns subnormal below
    an amax of about 0.16 and flushes to 0 below about 4e-5."""
    if node.op != "DequantizeLinear" or len(node.outputs) != 1 or not node.outputs[0].outputs:
        return False
    scale = node.outputs[0]
    return all(
        user.op == "DequantizeLinear" and len(user.inputs) > 1 and user.inputs[1] is scale for user in scale.outputs
    )


def _dequantizes_fp8_weights(node: gs.Node) -> bool:
    """An fp8-weight DequantizeLinear (passes/fp8_weights.py): its scales (amax / 448, times any factor folded
    into the weight) may be subnormal in fp16, so it computes in fp32 and its output is cast."""
    codes = node.inputs[0] if node.op == "DequantizeLinear" and node.inputs else None
    return isinstance(codes, gs.Constant) and codes.name.endswith(CODES_SUFFIX)


def _own_fp32_constants(kept: list[gs.Node], kept_ids: set[int]) -> None:
    """Kept ops read their own fp32 copy of a constant that other ops read too: exporters store equal weights
    once (a fresh checkpoint's LayerNorm bias and a projection's bias are the same zeros), and the copy the other
    ops read becomes half."""
    copies: dict[int, gs.Constant] = {}
    for node in kept:
        for position, tensor in enumerate(node.inputs):
            if not isinstance(tensor, gs.Constant) or not is_fp32(tensor):
                continue
            if all(id(user) in kept_ids for user in tensor.outputs):
                continue
            if id(tensor) not in copies:
                copies[id(tensor)] = gs.Constant(f"{tensor.name}/fp32", np.array(tensor.values))
            node.inputs[position] = copies[id(tensor)]


def _kept_for_range(
    graph: gs.Graph, half: HalfFloat, out_of_range: Mapping[str, float]
) -> dict[int, tuple[gs.Node, RangeKept]]:
    """Nodes that keep fp32 because a tensor they read or write leaves `half`'s range: the readers of a weight
    beyond it, and the writers and readers of the `out_of_range` activations (name → max |x| on the fp32 graph). A
    reader too, since a kept op's output is narrowed to half for every op that does not keep fp32."""
    found: dict[int, tuple[gs.Node, RangeKept]] = {}
    if not half.narrower_than_fp32:
        return found

    def keep(node: gs.Node, tensor: str, reason: str, magnitude: float) -> None:
        if id(node) not in found:
            found[id(node)] = (node, RangeKept(op=node.op, tensor=tensor, reason=reason, max_abs=magnitude))

    def keep_readers(tensor: gs.Tensor, name: str, reason: str, magnitude: float) -> None:
        """`tensor`'s readers, and through the ops that only move values (an embedding's Gather) theirs too."""
        for user in tensor.outputs:
            if id(user) in found:
                continue
            keep(user, name, reason, magnitude)
            if user.op in MOVES_VALUES:
                for output in user.outputs:
                    keep_readers(output, name, reason, magnitude)

    def beyond(value: object) -> float:  # an fp32 constant's largest |value| beyond the range
        if not isinstance(value, gs.Constant) or not is_fp32(value):
            return 0.0
        return largest_outside(values_unkept(value), half.max)

    tensors = graph.tensors()
    for tensor in tensors.values():
        if magnitude := beyond(tensor):
            keep_readers(tensor, tensor.name, "weight", magnitude)
    for node in graph.nodes:
        if node.op in ("Constant", "ConstantOfShape") and (magnitude := beyond(node.attrs.get("value"))):
            keep(node, node.outputs[0].name, "weight", magnitude)
            keep_readers(node.outputs[0], node.outputs[0].name, "weight", magnitude)
    for name, magnitude in out_of_range.items():
        activation = tensors.get(name)
        if activation is None:
            logger.warning("%s: no tensor '%s' to keep in fp32 for range", half.name, name)
            continue
        for producer in activation.inputs:
            keep(producer, name, "output", magnitude)
        keep_readers(activation, name, "input", magnitude)
    return found


def half_regions(
    graph: gs.Graph,
    keep_fp32: Sequence[str],
    half: HalfFloat,
    out_of_range: Mapping[str, float] | None = None,
) -> HalfRegions:
    """`graph`'s half regions in `half`: the ops in `keep_fp32`, NVFP4's scale-computing DequantizeLinear and
    (fp16) the nodes kept for range keep fp32, and every other fp32 tensor and constant becomes half."""
    by_op = {
        id(node)
        for node in graph.nodes
        if node.op in keep_fp32 or _computes_a_scale(node) or _dequantizes_fp8_weights(node)
    }
    for_range = _kept_for_range(graph, half, out_of_range or {})
    for node_id in by_op:  # kept whatever their range: not named for it
        for_range.pop(node_id, None)
    kept = [node for node in graph.nodes if id(node) in by_op or id(node) in for_range]
    kept_ids = {id(node) for node in kept}
    _own_body_constants(kept)
    _own_fp32_constants(kept, kept_ids)
    outputs = {id(tensor) for tensor in graph.outputs}
    stay_fp32 = [
        tensor
        for node in kept
        for tensor in node.outputs
        if id(tensor) in outputs or all(id(user) in kept_ids for user in tensor.outputs)
    ]
    # a graph input only kept ops read (a recurrent state) is not narrowed on its way in
    read_kept = [t for t in graph.inputs if t.outputs and all(id(user) in kept_ids for user in t.outputs)]
    staying = {id(tensor) for tensor in [*stay_fp32, *read_kept]}
    constants = []
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and is_fp32(tensor):
            if tensor.outputs and all(id(user) in kept_ids for user in tensor.outputs):
                continue
            constants.append(tensor)
    constant_nodes, float_casts = [], []
    for node in graph.nodes:
        value = node.attrs.get("value")
        if id(node) in kept_ids:
            continue
        if node.op in ("Constant", "ConstantOfShape") and isinstance(value, gs.Constant) and is_fp32(value):
            constant_nodes.append(node)
        elif node.op == "Cast" and node.attrs.get("to") == FLOAT:
            float_casts.append(node)
    variables = [
        t for t in graph.tensors().values() if isinstance(t, gs.Variable) and is_fp32(t) and id(t) not in staying
    ]
    labels = {node.name or node.outputs[0].name: record for node, record in for_range.values()}
    return HalfRegions(kept, stay_fp32, constants, constant_nodes, float_casts, variables, labels)


def bodies_of(nodes: list[gs.Node]) -> list[gs.Graph]:
    """The subgraphs of control-flow `nodes` (If branches, Scan and Loop bodies), nested ones included."""
    bodies = [value for node in nodes for value in node.attrs.values() if isinstance(value, gs.Graph)]
    return [*bodies, *(inner for body in bodies for inner in body.subgraphs(recursive=True))]


def _own_body_constants(kept: list[gs.Node]) -> None:
    """Each float constant a kept op's body reads (a Scan's, which the exporter may share with the graph outside
    it) replaced there by its own copy: the body stays fp32 whatever the graph outside converts."""
    for body in bodies_of(kept):
        for inner in body.nodes:
            for index, tensor in enumerate(inner.inputs):
                if isinstance(tensor, gs.Constant) and is_fp32(tensor):
                    inner.inputs[index] = gs.Constant(f"{tensor.name}/{inner.name}/fp32", np.array(tensor.values))


def half_readers(tensor: gs.Tensor, kept_ids: set[int]) -> list[gs.Node]:
    """`tensor`'s readers that compute in the half type (not among `kept_ids`)."""
    return [user for user in tensor.outputs if id(user) not in kept_ids]
