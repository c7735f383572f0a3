"""The record of a pre-quantized checkpoint's published layout (`Layout`): which tensors around a Linear `M` hold
its codes and scales, of which types, how the scales split its weight, and how to read it. The layouts themselves
are in int4_layouts.py and float_layouts.py; checkpoint_layouts.py chooses one from config.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.core.grouped_int4 import GroupedInt4
from tensorsmith.core.precisions import Element
from tensorsmith.core.scaled_fp8 import ScaledFp8
from tensorsmith.passes.nvfp4 import Nvfp4Weight

TAKEN = (
    "awq (gemm), gptq, compressed-tensors pack-quantized int4, float-quantized fp8 and nvfp4, fp8 blocks, "
    "modelopt fp8 and nvfp4, and gpt-oss's mxfp4 experts (read dequantized)"
)
HINT = f"tensorsmith takes {TAKEN}; or give the unquantized bf16/fp16 checkpoint and --precision"
STORED_CODES = {Element.INT4: "I32", Element.FP8_E4M3: "F8_E4M3", Element.FP4_E2M1: "U8"}
SCALE_DTYPES = ("F32", "F16", "BF16")  # a scale of another type (e8m0's U8) would be read as a number: refused
# a quantized Linear's weight [K, N] as stored: .dequantized() its floats, .scaled(factor) its scales times one
StoredWeight: TypeAlias = GroupedInt4 | ScaledFp8 | Nvfp4Weight


@dataclass(frozen=True)
class Layout:
    """One format's tensors around a Linear `M`: the one marking it quantized (`M.<marker>`) and how to read it."""

    element: Element  # what one stored code is
    marker: str  # e.g. "qweight": only a quantized Linear has it
    codes: str  # the tensor holding the codes (the marker, or `weight` where the scales mark the Linear)
    scales: str  # the scales' tensor, stored beside it
    optional: tuple[str, ...]  # tensors that may be stored beside it (zero points, shapes, g_idx, input scales)
    features: tuple[int, int]  # (axis, codes per element) of the codes along the input features K
    columns: tuple[int, int]  # the same along the output features N
    fits: Callable[[tuple[int, int], tuple[int, ...]], bool]  # (weight [N, K], scales' shape) → whole blocks
    read: Callable[[CheckpointWeights, str], StoredWeight]  # (weights, module) → its weight
    scale_dtypes: tuple[str, ...] = SCALE_DTYPES  # the scales' safetensors dtypes
    rounding: str | None = None  # the dtype code its own dequantization rounds through; None: its scales'

    @property
    def codes_dtype(self) -> str:
        """safetensors' dtype code of the codes' tensor: INT4 packed in int32 words, FP8 as float8 e4m3."""
        return STORED_CODES[self.element]

    def weight_shape(self, weights: CheckpointWeights, module: str) -> tuple[int, int]:
        """`module.weight`'s [N, K], from the codes' header."""
        packed = weights.shape(f"{module}.{self.codes}")
        (rows, per_row), (columns, per_column) = self.features, self.columns
        return packed[columns] * per_column, packed[rows] * per_row
