"""FP8 weight-only: float8 e4m3 codes, a float32 scale per block of K rows and column (amax / 448), read through
one blockwise DequantizeLinear (passes/fp8_weights.py, which also writes a checkpoint's 2-D blocks); Ada and newer.
Its builder (compiler/variants/fp8_weight_builder.py) plans a checkpoint's codes itself and writes that pass
directly; this module serves the numbers (quantize, and the search's `computed`) and any other caller."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import numpy as np

from tensorsmith.core.scaled_fp8 import ScaledFp8, quantize_fp8
from tensorsmith.passes.base import GraphPass
from tensorsmith.passes.fp8_weights import WeightOnlyFp8
from tensorsmith.passes.weight_formats.base import LayerWeights, Quantized, WeightFormat


class Fp8WeightFormat(WeightFormat):
    def quantize(self, weight: np.ndarray, block: int | None) -> Quantized:
        fp8 = quantize_fp8(weight, block or len(weight))
        return Quantized(fp8.codes.astype(np.float32), fp8.scales)

    def graph_pass(self, layers: LayerWeights) -> GraphPass:
        made: dict[str, Callable[[np.ndarray], ScaledFp8]] = {}
        for name, choice in layers.nodes.items():
            stored = layers.stored.get(name)
            own = choice.block or layers.block
            made[name] = cast(Callable[[np.ndarray], ScaledFp8], stored) if stored else partial(quantize_fp8, block=own)
        return WeightOnlyFp8(made, layers.floats)
