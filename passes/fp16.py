"""The half-float conversion passes: `ConvertToFp16` and `ConvertToBf16` (`ConvertToHalf` in a `HalfFloat`) rewrite
the graph to compute in fp16 or bf16 (initializers stored in it, Casts at its float inputs and outputs), except the
nodes that keep fp32 (passes/half_regions.py), which get Casts around them; `RoundToBf16` writes the fp32 graph
that computes `ConvertToBf16`'s values. TensorRT's strongly typed networks take the precision from these types, and
FP16 LayerNorm overflows, so LayerNormalization stays fp32 by default. bf16 has fp32's range, so its LayerNorm
would not overflow; bf16 regions keep it in fp32 all the same (the same default: bf16's 8-bit mantissa is coarser
than fp16's 11, and TensorRT's bf16 LayerNorm was not measured here; `RoundToBf16`'s graph cannot tell, ONNX
Runtime runs LayerNorm in fp32 either way).

ONNX Runtime's CPU provider has no bf16 MatMul kernel, so a bf16 graph's accuracy is measured on `RoundToBf16`'s
graph instead: fp32 throughout, rounded to bf16 (Cast to bfloat16 and back) wherever `ConvertToBf16`'s graph holds
a tensor in bf16, the same choice of tensors made by the same code (`half_regions`).

fp16's range is ±65504 (passes/half_float.py): a weight beyond it is not clipped but keeps its readers in fp32, as
do the writers and readers of the `out_of_range` activations; each node kept for range is named in the report's
`kept_fp32_for_range`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from tensorsmith.core.mapped_graph import convert_values
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.half_float import BF16_FLOAT, BFLOAT16, FLOAT, FP16_FLOAT, HalfFloat, element_type
from tensorsmith.passes.half_regions import KEEP_FP32, RangeKept, bodies_of, half_readers, half_regions

logger = logging.getLogger(__name__)


class HalfDetails(PassDetails):
    kept_fp32_for_range: dict[str, RangeKept] = Field(default_factory=dict)  # node → why it keeps fp32 for range


@dataclass
class ConvertToHalf:
    """Rewrite the graph to compute in `half` with `keep_fp32` ops wrapped in Casts to and from fp32, and, where
    `half` is narrower than fp32, the nodes whose weights or activations (`out_of_range`) leave its range."""

    keep_fp32: Sequence[str] = KEEP_FP32
    name: str = ""  # default: convert_to_<half.name>
    half: HalfFloat = FP16_FLOAT
    # activations that leave `half`'s range on the fp32 graph: tensor name → max |x| (their writers and readers
    # keep fp32); compiler/variants/fp16_range.py measures them
    out_of_range: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.name or f"convert_to_{self.half.name}"

    def __call__(self, graph: gs.Graph) -> PassReport:
        half = self.half
        regions = half_regions(graph, self.keep_fp32, half, self.out_of_range)
        for tensor in regions.constants:  # converted as they are written, one at a time
            convert_values(tensor, half.constant, half.values_dtype)
        for node in regions.constant_nodes:
            value = node.attrs["value"]
            node.attrs["value"] = gs.Constant(value.name, half.constant(value.values))
        for node in regions.float_casts:
            node.attrs["to"] = half.onnx_type
        constants = len(regions.constants) + len(regions.constant_nodes)
        # Every float intermediate is now half (types are re-inferred on export); graph I/O stays fp32 via Casts.
        for tensor in regions.variables:
            tensor.dtype = half.variable_dtype
        casts = 0
        for tensor in list(graph.inputs):
            if element_type(tensor) == half.onnx_type:
                tensor.dtype = np.float32
                inside = gs.Variable(f"{tensor.name}/{half.name}", half.variable_dtype, tensor.shape)
                for user in list(tensor.outputs):
                    user.inputs[user.inputs.index(tensor)] = inside
                graph.nodes.append(gs.Node("Cast", f"{tensor.name}/Cast", {"to": half.onnx_type}, [tensor], [inside]))
                casts += 1
        for index, tensor in enumerate(list(graph.outputs)):
            if element_type(tensor) == half.onnx_type:
                outside = gs.Variable(tensor.name, np.float32, tensor.shape)
                tensor.name = f"{tensor.name}/{half.name}"
                graph.nodes.append(gs.Node("Cast", f"{outside.name}/Cast", {"to": FLOAT}, [tensor], [outside]))
                graph.outputs[index] = outside
                casts += 1
        # One fp32 tensor per half tensor that kept ops read: a kept op's own output before its narrowing Cast,
        # else one Cast for all its readers (two LayerNorms of one residual stream must not make two `x/fp32`).
        # A kept op's output that only kept ops read, or that leaves the graph, stays fp32; a graph output's
        # other readers read a half copy.
        kept_ids = {id(node) for node in regions.kept}
        wide: dict[int, gs.Variable] = {}
        for tensor in regions.stay_fp32:
            if element_type(tensor) not in (None, FLOAT) or not (readers := half_readers(tensor, kept_ids)):
                continue
            narrow = gs.Variable(f"{tensor.name}/{half.name}", half.variable_dtype, tensor.shape)
            for user in readers:
                user.inputs[user.inputs.index(tensor)] = narrow
            graph.nodes.append(gs.Node("Cast", f"{tensor.name}/Cast", {"to": half.onnx_type}, [tensor], [narrow]))
            casts += 1
        staying = {id(tensor) for tensor in regions.stay_fp32}
        for node in regions.kept:
            for position, tensor in enumerate(list(node.outputs)):
                if id(tensor) in staying or element_type(tensor) not in (None, half.onnx_type):  # an int output
                    continue
                narrow_from = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                node.outputs[position] = narrow_from
                graph.nodes.append(
                    gs.Node("Cast", f"{tensor.name}/Cast", {"to": half.onnx_type}, [narrow_from], [tensor])
                )
                wide[id(tensor)] = narrow_from
                casts += 1
        for node in regions.kept:
            for position, tensor in enumerate(list(node.inputs)):
                if isinstance(tensor, gs.Variable) and element_type(tensor) == half.onnx_type:
                    if id(tensor) not in wide:
                        wide[id(tensor)] = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                        graph.nodes.append(
                            gs.Node("Cast", f"{tensor.name}/fp32/Cast", {"to": FLOAT}, [tensor], [wide[id(tensor)]])
                        )
                        casts += 1
                    node.inputs[position] = wide[id(tensor)]
        constants += _subgraphs_in_half(graph, half, kept_ids)
        counts = {"constants_converted": constants, "casts_inserted": casts, "kept_fp32": len(regions.kept)}
        if half.narrower_than_fp32:
            counts["kept_fp32_for_range"] = len(regions.for_range)
        if regions.for_range:
            logger.debug("%s: kept in fp32 for range: %s", self.name, regions.for_range)
        details = HalfDetails(kept_fp32_for_range=regions.for_range)
        return PassReport(self.name, changed=True, counts=counts, details=details)


def _subgraphs_in_half(graph: gs.Graph, half: HalfFloat, kept_ids: set[int]) -> int:
    """The branches of control-flow nodes (If: compiler/frontend/routed_experts.py) in `half` throughout: their
    float constants (their own, and the outer graph's that only they read), Casts to float and float tensors.
    Nothing in them keeps fp32, unless their node does (a Scan's body: all of it); returns the constants
    converted."""
    converted: set[int] = set()  # a constant two branches read is converted once
    for branch in bodies_of([node for node in graph.nodes if id(node) not in kept_ids]):
        wide = _weights_dequantized_in_fp32(branch, half)
        for inner in branch.nodes:
            if id(inner) in wide:
                continue
            for tensor in inner.inputs:
                if isinstance(tensor, gs.Constant) and element_type(tensor) == FLOAT and id(tensor) not in converted:
                    convert_values(tensor, half.constant, half.values_dtype)
                    converted.add(id(tensor))
            if inner.op == "Cast" and inner.attrs.get("to") == FLOAT:
                inner.attrs["to"] = half.onnx_type
            if inner.op == "Constant" and element_type(inner.attrs["value"]) == FLOAT:
                value = inner.attrs["value"]
                inner.attrs["value"] = gs.Constant(value.name, half.constant(value.values))
        fp32 = {id(output) for node in branch.nodes if id(node) in wide for output in node.outputs}
        for tensor in [*(output for inner in branch.nodes for output in inner.outputs), *branch.outputs]:
            if element_type(tensor) == FLOAT and id(tensor) not in fp32:
                tensor.dtype = half.variable_dtype
    return len(converted)


def _weights_dequantized_in_fp32(branch: gs.Graph, half: HalfFloat) -> set[int]:
    """A branch's weight DequantizeLinear (stored codes: passes/weight_formats/stacked.py) computes in fp32 and its
    output is cast to `half`: its scales (NVFP4's folded into one level, small MXFP4 powers of two) may be
    subnormal in fp16, as fp8-weight's are at the top level (passes/half_regions.py). Returns those nodes' ids."""
    wide = set()
    for index, node in reversed(list(enumerate(branch.nodes))):
        if node.op != "DequantizeLinear" or not isinstance(node.inputs[0], gs.Constant) or len(node.outputs) != 1:
            continue
        (output,) = node.outputs
        computed = gs.Variable(f"{output.name}/fp32", np.float32, output.shape)
        node.outputs = [computed]
        cast = gs.Node("Cast", f"{node.name}/to_half", {"to": half.onnx_type}, inputs=[computed], outputs=[output])
        branch.nodes.insert(index + 1, cast)
        wide.add(id(node))
    return wide


@dataclass
class ConvertToFp16(ConvertToHalf):
    """The graph in fp16 (stand-ins for infinity clipped to ±65504), LayerNormalization in fp32, and the nodes whose
    weights or `out_of_range` activations leave fp16's range."""

    half: HalfFloat = field(default=FP16_FLOAT, init=False)


@dataclass
class ConvertToBf16(ConvertToHalf):
    """The graph in bf16 (constants as ml_dtypes.bfloat16 values), LayerNormalization in fp32. tensorrt-rtx 1.7
    builds it for SM86, SM89 and SM120 (checked), not for Turing: "the model contains HW-specific datatypes: b16"."""

    half: HalfFloat = field(default=BF16_FLOAT, init=False)


@dataclass
class RoundToBf16:
    """The fp32 graph whose values are those of `ConvertToBf16`'s graph (keep_fp32 alike): constants rounded to
    bf16 values (stored fp32), and every tensor that graph holds in bf16 — each float graph input, the fp32 outputs
    of every node, a kept op's float outputs included (narrowed there) unless only kept ops read them or they leave
    the graph (a graph output's other readers read a rounded copy) — passed through Cast(to=BFLOAT16) →
    Cast(to=FLOAT). ONNX Runtime's CPU provider runs it (its Cast rounds to nearest even, as ml_dtypes does); each
    op computes in fp32 and rounds once, so TensorRT's bf16 kernels, which may keep more internally, can differ
    from it by a bf16 ulp here and there. Node outputs without a type are left unrounded (counted, and logged):
    run shape inference first."""

    keep_fp32: Sequence[str] = KEEP_FP32
    name: str = "round_to_bf16"

    def __call__(self, graph: gs.Graph) -> PassReport:
        bf16 = BF16_FLOAT
        regions = half_regions(graph, self.keep_fp32, bf16)
        nodes = list(graph.nodes)  # before the Casts below
        for tensor in regions.constants:
            tensor.values = bf16.round(tensor.values)
        for node in regions.constant_nodes:
            value = node.attrs["value"]
            node.attrs["value"] = gs.Constant(value.name, bf16.round(value.values))
        kept_ids = {id(node) for node in regions.kept}
        rounded = {id(tensor) for tensor in regions.variables}
        casts, untyped = 0, 0
        for tensor in list(graph.inputs):
            if id(tensor) in rounded:
                inside = gs.Variable(f"{tensor.name}/rounded", np.float32, tensor.shape)
                for user in list(tensor.outputs):
                    user.inputs[user.inputs.index(tensor)] = inside
                graph.nodes.extend(_round_trip(tensor, inside))
                casts += 2
        staying = {id(tensor) for tensor in regions.stay_fp32}
        for tensor in regions.stay_fp32:
            if element_type(tensor) in (None, FLOAT) and (readers := half_readers(tensor, kept_ids)):
                inside = gs.Variable(f"{tensor.name}/rounded", np.float32, tensor.shape)
                for user in readers:
                    user.inputs[user.inputs.index(tensor)] = inside
                graph.nodes.extend(_round_trip(tensor, inside))
                casts += 2
        for node in nodes:
            for position, tensor in enumerate(list(node.outputs)):
                # ConvertToHalf narrows every float or untyped output of a kept op but those that stay fp32
                if id(tensor) in staying or (id(node) in kept_ids and element_type(tensor) not in (None, FLOAT)):
                    continue
                if id(tensor) not in rounded and id(node) not in kept_ids:
                    untyped += tensor.dtype is None
                    continue
                unrounded = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                node.outputs[position] = unrounded
                graph.nodes.extend(_round_trip(unrounded, tensor))
                casts += 2
        if untyped:
            logger.warning("round_to_bf16: %d node outputs have no type and were not rounded", untyped)
        return PassReport(
            self.name,
            changed=True,
            counts={
                "constants_rounded": len(regions.constants) + len(regions.constant_nodes),
                "casts_inserted": casts,
                "kept_fp32": len(regions.kept),
                "untyped_outputs": untyped,
            },
        )


def _round_trip(source: gs.Variable, target: gs.Variable) -> list[gs.Node]:
    """Cast(to=BFLOAT16) → Cast(to=FLOAT): `target` is `source` rounded to the nearest bf16 (ties to even)."""
    narrow = gs.Variable(f"{target.name}/bf16", BFLOAT16, source.shape)
    return [
        gs.Node("Cast", f"{target.name}/Cast_bf16", {"to": BFLOAT16}, [source], [narrow]),
        gs.Node("Cast", f"{target.name}/Cast_fp32", {"to": FLOAT}, [narrow], [target]),
    ]
