"""NVFP4: e2m1 codes in blocks of 16, an fp8 e4m3 scale per block times a float32 scale per tensor, written as
Model Optimizer writes it (passes/nvfp4.py). ONNX Runtime has no FLOAT4E2M1 kernel: a variant is measured on the
same weights held in float32."""

from __future__ import annotations

from typing import cast

import numpy as np

from tensorsmith.passes.base import GraphPass
from tensorsmith.passes.int4 import Int4Weight
from tensorsmith.passes.nvfp4 import SimulatedNvfp4, StoredNvfp4, WeightOnlyNvfp4, dequantize_nvfp4, quantize_nvfp4
from tensorsmith.passes.weight_formats.base import LayerWeights, Quantized, WeightFormat


class Nvfp4Format(WeightFormat):
    onnxruntime_runs = False

    @property
    def reason(self) -> str:
        return "nvfp4: e2m1 in blocks of 16, fp8 block scales (Model Optimizer's form)"

    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        q = quantize_nvfp4(weight, block or self.record.block or len(weight))
        return Quantized(q.codes, q.block_scales, q.tensor_scale)

    def computed(self, weight: np.ndarray, choice: Int4Weight | None = None, block: int | None = None) -> np.ndarray:
        assert self.record.block is not None, "NVFP4's block is its record's"
        return dequantize_nvfp4(quantize_nvfp4(weight, self.record.block))

    def graph_pass(self, layers: LayerWeights) -> GraphPass:
        nodes, stored = frozenset(layers.nodes), cast(StoredNvfp4, layers.stored)
        if layers.measured:
            return SimulatedNvfp4(nodes, stored=stored)
        return WeightOnlyNvfp4(nodes, floats=layers.floats, stored=stored)
