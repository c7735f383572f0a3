"""Half-precision float regions: the graph computes in fp16 or bf16 (initializers stored in it, Casts at its float
inputs and outputs), except ops that must keep fp32, which get Casts around them. TensorRT's strongly typed
networks take the precision from these types, and FP16 LayerNorm overflows, so LayerNormalization stays fp32 by
default. bf16 has fp32's range, so its LayerNorm would not overflow; bf16 regions keep it in fp32 all the same
(the same default: bf16's 8-bit mantissa is coarser than fp16's 11, and TensorRT's bf16 LayerNorm was not measured
here; `RoundToBf16`'s graph cannot tell, ONNX Runtime runs LayerNorm in fp32 either way).

ONNX Runtime's CPU provider has no bf16 MatMul kernel, so a bf16 graph's accuracy is measured on `RoundToBf16`'s
graph instead: fp32 throughout, rounded to bf16 (Cast to bfloat16 and back) wherever `ConvertToBf16`'s graph holds
a tensor in bf16, the same choice of tensors made by the same code (`_half_regions`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core.precisions import BF16, FP16
from tensorsmith.passes.base import PassReport

logger = logging.getLogger(__name__)

FP16_MAX = float(np.finfo(np.float16).max)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
KEEP_FP32 = ("LayerNormalization",)
FLOAT, HALF, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16


@dataclass(frozen=True)
class HalfFloat:
    """A 16-bit float that graph regions compute in."""

    name: str  # in the names of the tensors and Casts the passes add: `x/fp16`
    onnx_type: int  # the TensorProto enum: Cast's `to`
    variable_dtype: object  # what gs tensors carry: numpy's float16, or for bf16 (numpy has none) the ONNX enum,
    # as onnx-graphsurgeon's import gives it
    values_dtype: type  # constants' values: numpy's float16, ml_dtypes.bfloat16
    max: float  # the largest finite value

    def constant(self, values: np.ndarray) -> np.ndarray:
        """fp32 values in this type, clipped to its range first: an additive mask's finfo(float32).min must become
        -max, not -inf (0 · -inf would be NaN). bf16 needs the clip too: rounding to nearest takes float32's
        largest values (above 3.3895e38) to inf. Always an array: numpy's clip gives a 0-d one back as a scalar,
        which a Constant node's gs.Constant refuses."""
        return np.asarray(np.clip(values, -self.max, self.max).astype(self.values_dtype))

    def round(self, values: np.ndarray) -> np.ndarray:
        """`constant(values)` held in fp32 again: the values a graph in this type computes with."""
        return self.constant(values).astype(np.float32)


FP16_FLOAT = HalfFloat(FP16.name, HALF, np.float16, np.float16, FP16_MAX)
BF16_FLOAT = HalfFloat(BF16.name, BFLOAT16, BFLOAT16, ml_dtypes.bfloat16, BF16_MAX)


def _onnx_type(tensor: gs.Tensor) -> int | None:
    """`tensor`'s ONNX element type; onnx-graphsurgeon gives numpy dtypes, or ONNX enums for types numpy lacks
    (bf16, fp8)."""
    if tensor.dtype is None:
        return None
    if isinstance(tensor.dtype, int):
        return tensor.dtype
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(tensor.dtype)))
    except (TypeError, KeyError, ValueError):
        return None


def _is_fp32(tensor: gs.Tensor) -> bool:
    return _onnx_type(tensor) == FLOAT


@dataclass(frozen=True)
class HalfRegions:
    """Where a graph computes in the half type once converted: what both passes change, found before either
    changes anything."""

    kept: list[gs.Node]  # the ops that keep fp32
    constants: list[gs.Constant]  # fp32 constants stored in half (not those read only by kept ops)
    constant_nodes: list[gs.Node]  # Constant / ConstantOfShape nodes whose fp32 value becomes half
    float_casts: list[gs.Node]  # Cast(to=FLOAT) nodes, which cast to half instead
    variables: list[gs.Variable]  # fp32 tensors held in half (graph inputs and outputs stay fp32 through Casts)


def _computes_a_scale(node: gs.Node) -> bool:
    """NVFP4's first DequantizeLinear (fp8 block scales × an fp32 tensor scale, read as the weight's DequantizeLinear
    scale): kept fp32, as Model Optimizer keeps it. In fp16 the tensor scale (amax / 2688) turns subnormal below
    an amax of about 0.16 and flushes to 0 below about 4e-5."""
    if node.op != "DequantizeLinear" or len(node.outputs) != 1 or not node.outputs[0].outputs:
        return False
    scale = node.outputs[0]
    return all(user.op == "DequantizeLinear" and len(user.inputs) > 1 and user.inputs[1] is scale
               for user in scale.outputs)  # fmt: skip


def _own_fp32_constants(kept: list[gs.Node], kept_ids: set[int]) -> None:
    """Kept ops read their own fp32 copy of a constant that other ops read too: exporters store equal weights
    once (a fresh checkpoint's LayerNorm bias and a projection's bias are the same zeros), and the copy the other
    ops read becomes half."""
    copies: dict[int, gs.Constant] = {}
    for node in kept:
        for position, tensor in enumerate(node.inputs):
            if not isinstance(tensor, gs.Constant) or not _is_fp32(tensor):
                continue
            if all(id(user) in kept_ids for user in tensor.outputs):
                continue
            if id(tensor) not in copies:
                copies[id(tensor)] = gs.Constant(f"{tensor.name}/fp32", np.array(tensor.values))
            node.inputs[position] = copies[id(tensor)]


def _half_regions(graph: gs.Graph, keep_fp32: Sequence[str]) -> HalfRegions:
    kept = [node for node in graph.nodes if node.op in keep_fp32 or _computes_a_scale(node)]
    kept_ids = {id(node) for node in kept}
    _own_fp32_constants(kept, kept_ids)
    constants = []
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and _is_fp32(tensor):
            if tensor.outputs and all(id(user) in kept_ids for user in tensor.outputs):
                continue
            constants.append(tensor)
    constant_nodes, float_casts = [], []
    for node in graph.nodes:
        value = node.attrs.get("value")
        if node.op in ("Constant", "ConstantOfShape") and isinstance(value, gs.Constant) and _is_fp32(value):
            constant_nodes.append(node)
        elif node.op == "Cast" and node.attrs.get("to") == FLOAT:
            float_casts.append(node)
    variables = [t for t in graph.tensors().values() if isinstance(t, gs.Variable) and _is_fp32(t)]
    return HalfRegions(kept, constants, constant_nodes, float_casts, variables)


@dataclass
class ConvertToHalf:
    """Rewrite the graph to compute in `half` with `keep_fp32` ops wrapped in Casts to and from fp32."""

    keep_fp32: Sequence[str] = KEEP_FP32
    name: str = ""  # default: convert_to_<half.name>
    half: HalfFloat = FP16_FLOAT

    def __post_init__(self) -> None:
        self.name = self.name or f"convert_to_{self.half.name}"

    def __call__(self, graph: gs.Graph) -> PassReport:
        half = self.half
        regions = _half_regions(graph, self.keep_fp32)
        for tensor in regions.constants:
            tensor.values = half.constant(tensor.values)
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
            if _onnx_type(tensor) == half.onnx_type:
                tensor.dtype = np.float32
                inside = gs.Variable(f"{tensor.name}/{half.name}", half.variable_dtype, tensor.shape)
                for user in list(tensor.outputs):
                    user.inputs[user.inputs.index(tensor)] = inside
                graph.nodes.append(gs.Node("Cast", f"{tensor.name}/Cast", {"to": half.onnx_type}, [tensor], [inside]))
                casts += 1
        for index, tensor in enumerate(list(graph.outputs)):
            if _onnx_type(tensor) == half.onnx_type:
                outside = gs.Variable(tensor.name, np.float32, tensor.shape)
                tensor.name = f"{tensor.name}/{half.name}"
                graph.nodes.append(gs.Node("Cast", f"{outside.name}/Cast", {"to": FLOAT}, [tensor], [outside]))
                graph.outputs[index] = outside
                casts += 1
        # One fp32 tensor per half tensor that kept ops read: a kept op's own output before its narrowing Cast,
        # else one Cast for all its readers (two LayerNorms of one residual stream must not make two `x/fp32`).
        wide: dict[int, gs.Variable] = {}
        for node in regions.kept:
            for position, tensor in enumerate(list(node.outputs)):
                narrow_from = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                node.outputs[position] = narrow_from
                graph.nodes.append(
                    gs.Node("Cast", f"{tensor.name}/Cast", {"to": half.onnx_type}, [narrow_from], [tensor])
                )
                wide[id(tensor)] = narrow_from
                casts += 1
        for node in regions.kept:
            for position, tensor in enumerate(list(node.inputs)):
                if isinstance(tensor, gs.Variable) and _onnx_type(tensor) == half.onnx_type:
                    if id(tensor) not in wide:
                        wide[id(tensor)] = gs.Variable(f"{tensor.name}/fp32", np.float32, tensor.shape)
                        graph.nodes.append(
                            gs.Node("Cast", f"{tensor.name}/fp32/Cast", {"to": FLOAT}, [tensor], [wide[id(tensor)]])
                        )
                        casts += 1
                    node.inputs[position] = wide[id(tensor)]
        return PassReport(
            self.name,
            changed=True,
            counts={"constants_converted": constants, "casts_inserted": casts, "kept_fp32": len(regions.kept)},
        )


@dataclass
class ConvertToFp16(ConvertToHalf):
    """The graph in fp16 (constants clipped to ±65504), LayerNormalization in fp32."""

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
    of every node, a kept op's outputs included (narrowed there) — passed through Cast(to=BFLOAT16) →
    Cast(to=FLOAT). ONNX Runtime's CPU provider runs it (its Cast rounds to nearest even, as ml_dtypes does); each
    op computes in fp32 and rounds once, so TensorRT's bf16 kernels, which may keep more internally, can differ
    from it by a bf16 ulp here and there. Node outputs without a type are left unrounded (counted, and logged):
    run shape inference first."""

    keep_fp32: Sequence[str] = KEEP_FP32
    name: str = "round_to_bf16"

    def __call__(self, graph: gs.Graph) -> PassReport:
        bf16 = BF16_FLOAT
        regions = _half_regions(graph, self.keep_fp32)
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
        for node in nodes:
            for position, tensor in enumerate(list(node.outputs)):
                # ConvertToHalf narrows every output of a kept op, whatever its type
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
