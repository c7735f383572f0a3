"""MXFP4 (OCP Microscaling): e2m1 codes in blocks of 32 along K, each block's scale a power of two (e8m0), read
through one DequantizeLinear whose float32 scales hold the powers exactly. gpt-oss publishes its experts so;
TensorRT for RTX builds the FLOAT4E2M1 DequantizeLinear for Blackwell only, and ONNX Runtime has no kernel for
it: a variant is measured on the same weights held in float32."""

from __future__ import annotations

import numpy as np

from tensorsmith.passes.nvfp4 import E2M1_MAX, round_to_e2m1
from tensorsmith.passes.weight_formats.base import Quantized, WeightFormat

EXPONENT_OF_E2M1_MAX = 2  # 6 = 1.5 · 2²: a block's amax exponent less this is its scale's


class Mxfp4Format(WeightFormat):
    onnxruntime_runs = False

    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        """The OCP MX rounding: a block's scale 2^(floor(log2 amax) − 2), each value to the nearest e2m1 code
        (ties to even), saturating at ±6; an all-zero block's scale is 1."""
        block = block or self.record.block or len(weight)
        rows, columns = weight.shape
        blocks = weight.astype(np.float32).reshape(rows // block, block, columns)
        amax = np.abs(blocks).max(axis=1)
        exponents = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - EXPONENT_OF_E2M1_MAX, 0)
        scales = np.exp2(exponents).astype(np.float32)
        codes = round_to_e2m1(np.clip(blocks / scales[:, None, :], -E2M1_MAX, E2M1_MAX))
        return Quantized(codes.reshape(rows, columns), scales)
