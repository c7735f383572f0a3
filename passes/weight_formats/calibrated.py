"""The weights of the levels that quantize activations too (W8A8: int8, and fp8 on Ada and newer): a scale per
output column in the record's element, and the layer's input quantized per tensor with a calibrated scale
(passes/quantize.py's Q/DQ pairs)."""

from __future__ import annotations

import numpy as np

from tensorsmith.passes.base import GraphPass
from tensorsmith.passes.quantize import InsertQDQ, quantize_weights
from tensorsmith.passes.weight_formats.base import LayerWeights, Quantized, WeightFormat


class CalibratedFormat(WeightFormat):
    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        codes, scales = quantize_weights(weight, 1, self.record.name)
        return Quantized(codes, scales)

    def graph_pass(self, layers: LayerWeights) -> GraphPass:
        name = self.record.name
        return InsertQDQ(name, dict(layers.activation_scales), nodes=list(layers.nodes), suffix=f"/{name}")
