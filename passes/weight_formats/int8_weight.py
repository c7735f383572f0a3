"""INT8 weight-only: codes in [-127, 127], a float32 scale per output column, read through one DequantizeLinear
(axis 1): the level a decoder's search gives a layer between INT4 and float."""

from __future__ import annotations

import numpy as np

from tensorsmith.passes.quantize import quantize_weights
from tensorsmith.passes.weight_formats.base import Quantized, WeightFormat


class Int8WeightFormat(WeightFormat):
    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        codes, scales = quantize_weights(weight.astype(np.float32), 1, self.record.name)
        return Quantized(codes, scales)
