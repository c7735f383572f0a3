"""INT4: symmetric codes in [-8, 7], a float scale per block of K rows and column (passes/int4.py writes them,
with AWQ's input scales, a checkpoint's codes and zero points, and GPTQ's act-order); ONNX Runtime fuses its
DequantizeLinear → MatMul into MatMulNBits."""

from __future__ import annotations

import numpy as np

from tensorsmith.passes.base import GraphPass
from tensorsmith.passes.int4 import Int4Weight, WeightOnlyInt4, dequantize_int4, layer_block, quantize_int4
from tensorsmith.passes.weight_formats.base import LayerWeights, Quantized, WeightFormat


class Int4Format(WeightFormat):
    @property
    def reason(self) -> str:
        return "rtn: round to nearest"

    def block_for(self, rows: int, block: int | None = None) -> int | None:
        return layer_block(rows, block or self.record.block or rows)  # a smaller block where K asks for one

    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        assert block is not None, "INT4 has a block"
        codes, scales = quantize_int4(weight, block)
        return Quantized(codes, scales)

    def computed(self, weight: np.ndarray, choice: Int4Weight | None = None, block: int | None = None) -> np.ndarray:
        """With the plan's AWQ scales folded back in (W' = diag(t)·W quantized with its clipping, then / t)."""
        own = self.block_for(len(weight), choice.block if choice is not None and choice.block else block)
        assert own is not None, "planned with a block that divides K"
        if choice is None or choice.input_scale is None:
            codes, steps = quantize_int4(weight, own, None if choice is None else choice.clip)
            return dequantize_int4(codes, steps, own)
        scale = choice.input_scale[:, None]
        codes, steps = quantize_int4(weight * scale, own, choice.clip)
        return dequantize_int4(codes, steps, own) / scale

    def graph_pass(self, layers: LayerWeights) -> GraphPass:
        return WeightOnlyInt4(dict(layers.nodes), layers.block, layers.floats)
