"""FP8 weight-only: each chosen MatMul reads its weight through one blockwise DequantizeLinear of float8 e4m3 codes.

    W_fp8 FLOAT8E4M3FN [K, N], s float32 [K/B, N] ──► DequantizeLinear(axis 0, block_size B) ──► MatMul(x, ·)

ONNX's blocked quantization blocks one axis, so a checkpoint's 2-D blocks (DeepSeek's 128 x 128) are written with
each scale repeated over its block's columns: the same values, exactly; one block spanning K (per-tensor and
per-channel checkpoints) is written per axis instead (axis 1, a scale per column). TensorRT for RTX 1.7 builds
both forms for SM89 and SM120 and keeps the weights in one byte in the engine (a 4096 x 4096 weight's engine is
16.8 MB, checked); it refuses them for SM86. In fp16 regions the DequantizeLinear stays fp32 and its output is
cast (passes/half_regions.py): a scale of amax / 448 times the attention scale folded into the query
projection can fall below fp16's normal range; the engine still keeps one byte a weight (17.4 MB, checked).
ONNX Runtime's CPU provider runs it, so the variant is measured as it is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.scaled_fp8 import E4M3, ScaledFp8
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.matching import constant_value

Fp8Weights = Mapping[str, Callable[[np.ndarray], ScaledFp8]]  # MatMul node → its fp8 weight, from the graph's
CODES_SUFFIX = "/weight_fp8"  # the codes' initializer: passes/half_regions.py keeps their DequantizeLinear fp32


def fp8_codes(name: str, codes: np.ndarray) -> gs.Constant:
    """A FLOAT8E4M3FN initializer: numpy has no fp8, so onnx-graphsurgeon exports it through an onnx TensorProto
    (as passes/nvfp4.py's constants)."""
    from onnx import numpy_helper
    from onnx_graphsurgeon.ir.tensor import LazyValues

    return gs.Constant(name, LazyValues(numpy_helper.from_array(codes.astype(E4M3), name)))


def dequantize_linear_form(weight: ScaledFp8) -> tuple[np.ndarray, dict[str, int]]:
    """(scales, attributes) of the weight's DequantizeLinear: a scale per output column ([N], axis 1) where one
    block spans K (a per-tensor or per-channel checkpoint), else blocked along K ([K/B, N], axis 0, block_size B),
    each scale repeated over its block's columns."""
    rows = weight.block[0]
    scales = np.ascontiguousarray(weight.column_scales(), dtype=np.float32)
    if rows == weight.codes.shape[0]:
        return scales[0], {"axis": 1}
    return scales, {"axis": 0, "block_size": rows}


class Fp8WeightDetails(PassDetails):
    block_sizes: list[int]  # of the scales' blocks along K
    skipped: dict[str, str]  # weight MatMul → why it stays float
    fp8_weight_bytes: int


@dataclass
class WeightOnlyFp8:
    """The MatMuls of `weights` read their float8 weight through one blocked DequantizeLinear (the module's sketch);
    `floats`: the weight MatMuls the plan keeps in float, reported as skipped with their reason."""

    weights: Fp8Weights
    floats: Mapping[str, str] = field(default_factory=dict)
    name: str = "weight_only_fp8"

    def __call__(self, graph: gs.Graph) -> PassReport:
        quantized, weight_bytes = 0, 0
        blocks: set[int] = set()
        for node in [node for node in graph.nodes if node.op == "MatMul" and node.name in self.weights]:
            values = constant_value(node.inputs[1])
            assert values is not None and values.ndim == 2, f"{node.name}: planned without a constant weight"
            fp8 = self.weights[node.name](values.astype(np.float32))
            scales, attributes = dequantize_linear_form(fp8)
            dequantized = gs.Variable(f"{node.name}/fp8_weight", dtype=np.float32, shape=list(fp8.codes.shape))
            graph.nodes.append(
                gs.Node(
                    "DequantizeLinear",
                    name=f"{node.name}/DequantizeLinear",
                    attrs=attributes,
                    inputs=[
                        fp8_codes(f"{node.name}{CODES_SUFFIX}", fp8.codes),
                        gs.Constant(f"{node.name}/weight_scale", scales),
                    ],
                    outputs=[dequantized],
                )
            )
            node.inputs[1] = dequantized
            quantized, weight_bytes = quantized + 1, weight_bytes + fp8.codes.size + scales.nbytes
            blocks.add(attributes["block_size"] if "block_size" in attributes else len(fp8.codes))
        return PassReport(
            self.name,
            changed=quantized > 0,
            counts={"matmuls_quantized": quantized, "skipped": len(self.floats)},
            details=Fp8WeightDetails(
                block_sizes=sorted(blocks), skipped=dict(self.floats), fp8_weight_bytes=weight_bytes
            ),
        )
