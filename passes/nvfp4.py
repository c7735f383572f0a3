"""NVFP4 weight-only quantization in the form Model Optimizer's ONNX export writes (REFERENCE.md §11; the graph form
follows `modelopt/onnx/export/nvfp4_exporter.py`, `_replace_fp4qdq_with_2dq`):

    s_fp8 FLOAT8E4M3FN [K/16, N], s_tensor fp32 scalar ──► DequantizeLinear ──► s [K/16, N] fp32
    W_fp4 FLOAT4E2M1 [K, N] (packed), s ──────────────────► DequantizeLinear(axis 0, block_size 16) ──► MatMul(x, ·)

Two scale levels, so that fp8 block scales (max 448) cover any weight range: s_tensor = amax(W)/(6·448) and
s_fp8 = fp8(amax(block)/6 / s_tensor); codes are W/(s_fp8·s_tensor) rounded to the nearest e2m1 value (ties to
even, saturating at ±6). Blocks run along the input dimension K of our [K, N] weights (axis 0), as INT4's do;
Model Optimizer's weights are torch's [N, K] with axis -1 and a Transpose before the MatMul: the same blocks.
Where we differ from its exporter: the tensor scale is a scalar (it writes shape [1], which ONNX reads as per-axis),
and the codes divide by the fp8-rounded block scale (see `quantize_nvfp4`).
TensorRT for RTX 1.7 builds this for SM120 only; ONNX Runtime's CPU provider has no kernel for it, so accuracy is
measured on `SimulatedNvfp4`'s graph: the same weight values as a plain fp32 constant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.errors import PassError
from tensorsmith.core.precisions import NVFP4
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.int4 import block_amax
from tensorsmith.passes.matching import constant_value

NVFP4_BLOCK = 16
NVFP4_MIN_OPSET = NVFP4.min_opset  # 23: DequantizeLinear of FLOAT4E2M1
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # and their negatives


@dataclass(frozen=True)
class Nvfp4Weight:
    """One [K, N] weight in NVFP4, as float32 arrays holding only values the stored types represent exactly."""

    codes: np.ndarray  # [K, N], e2m1 values
    block_scales: np.ndarray  # [K/B, N], fp8 e4m3 values
    tensor_scale: float

    @property
    def block(self) -> int:
        return int(self.codes.shape[0] // self.block_scales.shape[0])

    def scaled(self, factor: float) -> Nvfp4Weight:
        """The same codes and block scales, the tensor scale times `factor` (a factor a graph pass folded in)."""
        return replace(self, tensor_scale=float(np.float32(self.tensor_scale) * np.float32(factor)))

    def dequantized(self, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """codes · (block scale · tensor scale) [K, N], rounded through `dtype` (a checkpoint's own arithmetic)."""
        return dequantize_nvfp4(self).astype(dtype).astype(np.float32)


def stored_nvfp4(packed: np.ndarray, block_scales: np.ndarray, tensor_scale: float) -> Nvfp4Weight:
    """A checkpoint's NVFP4 Linear as Model Optimizer and compressed-tensors store it: uint8 [N, K/2], two e2m1
    codes a byte, the first in the low nibble (sign bit 3, magnitude index bits 0-2); fp8 e4m3 block scales
    [N, K/16] (already widened to float32: exact); the tensor scale the block scales multiply. As [K, N]."""
    nibbles = np.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(packed.shape[0], -1).astype(np.int64)
    magnitudes = np.asarray(E2M1_VALUES, np.float32)[nibbles & 0x07]
    codes = np.where(nibbles & 0x08, -magnitudes, magnitudes)
    return Nvfp4Weight(
        codes=np.ascontiguousarray(codes.T),
        block_scales=np.ascontiguousarray(np.asarray(block_scales, np.float32).T),
        tensor_scale=float(tensor_scale),
    )


def round_to_e2m1(values: np.ndarray) -> np.ndarray:
    """Nearest e2m1 value, ties to even, saturating at ±6: what Model Optimizer's `_cast_fp4` computes (its
    bounds search plus the odd-bound adjustment) and ml_dtypes' cast does once values are clipped."""
    import ml_dtypes

    clipped = np.clip(values.astype(np.float32), -E2M1_MAX, E2M1_MAX)
    return clipped.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


def round_to_e4m3(values: np.ndarray) -> np.ndarray:
    """Nearest fp8 e4m3fn value, clipped to ±448 first (e4m3fn has no infinity: ml_dtypes would give NaN)."""
    import ml_dtypes

    clipped = np.clip(values.astype(np.float32), -E4M3_MAX, E4M3_MAX)
    return clipped.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def quantize_nvfp4(weight: np.ndarray, block: int = NVFP4_BLOCK) -> Nvfp4Weight:
    """NVFP4 of `weight` [K, N], blocks of `block` rows along K. The scales follow Model Optimizer's
    `get_weights_scaling_factor_2` / `get_weights_scaling_factor` (modelopt/onnx/quantization/quant_utils.py): an
    all-zero tensor or block gets scale 1, never 0/0. The codes divide by the fp8-rounded block scale, as
    `NVFP4QTensor.quantize` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py) does: the ONNX exporter's
    `compress_weights` divides by the unrounded one, which rounds onto a grid the stored scale does not use."""
    if weight.ndim != 2 or weight.shape[0] % block:
        raise ValueError(f"NVFP4 needs a 2-D [K, N] weight with K a multiple of {block}, not {list(weight.shape)}")
    weight = weight.astype(np.float32)
    amax = np.float32(np.abs(weight).max()) if weight.size else np.float32(0)
    tensor_scale = amax / np.float32(E2M1_MAX) / np.float32(E4M3_MAX)
    if tensor_scale == 0:
        tensor_scale = np.float32(1.0)
    per_block = block_amax(weight, block).astype(np.float32) / np.float32(E2M1_MAX) / tensor_scale
    block_scales = round_to_e4m3(np.where(per_block == 0, np.float32(1.0), per_block))
    scale = (block_scales * tensor_scale)[:, None, :]
    rows, columns = weight.shape
    blocks = weight.reshape(rows // block, block, columns)
    # a block far below the tensor's amax can round to a zero fp8 scale: it dequantizes to 0 whatever its codes
    scaled = np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale > 0)
    codes = round_to_e2m1(scaled).reshape(rows, columns)
    return Nvfp4Weight(codes=codes, block_scales=block_scales, tensor_scale=float(tensor_scale))


def dequantize_nvfp4(q: Nvfp4Weight) -> np.ndarray:
    """codes · (block scale · tensor scale), in float32 and in that order: what the two DequantizeLinear compute."""
    rows, columns = q.codes.shape
    scale = (q.block_scales * np.float32(q.tensor_scale)).astype(np.float32)
    blocks = q.codes.reshape(rows // q.block, q.block, columns) * scale[:, None, :]
    return blocks.reshape(rows, columns).astype(np.float32)


def nvfp4_constants(prefix: str, q: Nvfp4Weight) -> tuple[gs.Constant, gs.Constant, gs.Constant]:
    """(packed FLOAT4E2M1 codes, FLOAT8E4M3FN block scales, fp32 scalar tensor scale) initializers: numpy has no
    fp4 or fp8, so onnx-graphsurgeon exports them only through onnx TensorProtos (as `int4_constant` does)."""
    import ml_dtypes
    from onnx import numpy_helper
    from onnx_graphsurgeon.ir.tensor import LazyValues

    def lazy(name: str, values: np.ndarray) -> gs.Constant:
        return gs.Constant(name, LazyValues(numpy_helper.from_array(values, name)))

    return (
        lazy(f"{prefix}_fp4", q.codes.astype(ml_dtypes.float4_e2m1fn)),
        lazy(f"{prefix}_fp8_scale", q.block_scales.astype(ml_dtypes.float8_e4m3fn)),
        gs.Constant(f"{prefix}_tensor_scale", np.array(q.tensor_scale, dtype=np.float32)),
    )


StoredNvfp4 = Mapping[str, Callable[[np.ndarray], Nvfp4Weight]]  # MatMul node → its stored weight, from the graph's


def _nvfp4_of(node: str, weight: np.ndarray, block: int, stored: StoredNvfp4) -> Nvfp4Weight:
    """The checkpoint's own NVFP4 weight of `node` where it has one, else `weight` quantized here."""
    make = stored.get(node)
    return make(weight) if make is not None else quantize_nvfp4(weight, block)


class Nvfp4Details(PassDetails):
    block_size: int
    skipped: dict[str, str]  # weight MatMul → why it stays float
    nvfp4_weight_bytes: int | None = None  # None where the weights were left as they are (simulated)


@dataclass
class _Targets:
    """The named MatMuls whose weights can be quantized, and why the others were skipped."""

    weights: list[tuple[gs.Node, np.ndarray]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _targets(graph: gs.Graph, nodes: frozenset[str], block: int) -> _Targets:
    targets = _Targets()
    for node in [node for node in graph.nodes if node.name in nodes]:
        if node.op != "MatMul":
            targets.skipped[node.name] = f"a {node.op}, not a MatMul"
            continue
        weight = constant_value(node.inputs[1])
        if weight is None or weight.ndim != 2 or weight.shape[0] % block:
            shape = None if weight is None else list(weight.shape)
            targets.skipped[node.name] = f"weight {shape}: not a constant [K, N] with K % {block} == 0"
        elif not np.issubdtype(weight.dtype, np.floating):
            targets.skipped[node.name] = f"weight of {weight.dtype}: not float"
        else:
            targets.weights.append((node, weight.astype(np.float32)))
    return targets


def _report(name: str, block: int, targets: _Targets, weight_bytes: int | None = None) -> PassReport:
    quantized = len(targets.weights)
    return PassReport(
        name,
        changed=quantized > 0,
        counts={"matmuls_quantized": quantized, "skipped": len(targets.skipped)},
        details=Nvfp4Details(block_size=block, skipped=targets.skipped, nvfp4_weight_bytes=weight_bytes),
    )


@dataclass
class WeightOnlyNvfp4:
    """The MatMuls named in `nodes` read an NVFP4 weight through two DequantizeLinear (the module's sketch). The
    graph must already be at opset `NVFP4_MIN_OPSET` (the caller raises it, as INT4's opset 21 is)."""

    nodes: frozenset[str]
    block: int = NVFP4_BLOCK
    floats: Mapping[str, str] = field(default_factory=dict)  # kept in float by the plan: reported as skipped
    stored: StoredNvfp4 = field(default_factory=dict)  # a checkpoint's own NVFP4 weights, not quantized here
    name: str = "weight_only_nvfp4"

    def __call__(self, graph: gs.Graph) -> PassReport:
        targets = _targets(graph, self.nodes, self.block)
        targets.skipped = {**self.floats, **targets.skipped}
        if targets.weights and int(graph.opset) < NVFP4_MIN_OPSET:
            raise PassError(
                f"NVFP4 weights need opset {NVFP4_MIN_OPSET} (DequantizeLinear of FLOAT4E2M1), the graph is at "
                f"{graph.opset}",
                hint=f"convert the model to opset {NVFP4_MIN_OPSET} first (Canonicalize(opset=...))",
            )
        weight_bytes = 0
        for node, weight in targets.weights:
            q = _nvfp4_of(node.name, weight, self.block, self.stored)
            codes, block_scales, tensor_scale = nvfp4_constants(f"{node.name}/weight", q)
            scales = gs.Variable(f"{node.name}/weight_block_scale", dtype=np.float32, shape=list(q.block_scales.shape))
            dequantized = gs.Variable(f"{node.name}/nvfp4_weight", dtype=np.float32, shape=list(q.codes.shape))
            graph.nodes.append(
                gs.Node(
                    "DequantizeLinear",
                    name=f"{node.name}/DequantizeLinear_scale",
                    inputs=[block_scales, tensor_scale],
                    outputs=[scales],
                )
            )
            graph.nodes.append(
                gs.Node(
                    "DequantizeLinear",
                    name=f"{node.name}/DequantizeLinear",
                    attrs={"axis": 0, "block_size": self.block},
                    inputs=[codes, scales],
                    outputs=[dequantized],
                )
            )
            node.inputs[1] = dequantized
            weight_bytes += q.codes.size // 2 + q.block_scales.size + 4
        return _report(self.name, self.block, targets, weight_bytes)


@dataclass
class SimulatedNvfp4:
    """The MatMuls named in `nodes` read dequantize_nvfp4(quantize_nvfp4(W)) as a plain fp32 constant: the values
    `WeightOnlyNvfp4`'s graph computes, in a graph ONNX Runtime's CPU provider runs (it has no FLOAT4E2M1
    DequantizeLinear kernel), so accuracy is measured on it."""

    nodes: frozenset[str]
    block: int = NVFP4_BLOCK
    stored: StoredNvfp4 = field(default_factory=dict)
    name: str = "simulated_nvfp4"

    def __call__(self, graph: gs.Graph) -> PassReport:
        targets = _targets(graph, self.nodes, self.block)
        for node, weight in targets.weights:
            simulated = dequantize_nvfp4(_nvfp4_of(node.name, weight, self.block, self.stored))
            node.inputs[1] = gs.Constant(f"{node.name}/weight_nvfp4_simulated", simulated)
        return _report(self.name, self.block, targets)
