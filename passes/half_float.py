"""The 16-bit float types a graph can compute in (`HalfFloat`: fp16 and bf16) and their numerics: a constant's
values clipped into the type's range, and the values beyond a range that are real rather than stand-ins for
infinity (`largest_outside`).

fp16's range is ±65504 (bf16's is fp32's). Values of 1e9 and more stand in for infinity (an additive mask's
finfo(float32).min, -1e9, -inf) and are clipped: an fp16 mask of -65504 masks as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core.precisions import BF16, FP16

FP16_MAX = float(np.finfo(np.float16).max)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
# At or beyond this magnitude a value stands in for infinity (an additive mask's finfo(float32).min, -1e9, -1e30,
# ±inf): clipped to the half type's largest value, not kept in fp32. Real weights, a bf16 checkpoint's outliers
# included, are orders of magnitude below; so are real activations on their negative side.
INFINITY_STAND_IN = 1e9
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
    narrower_than_fp32: bool  # whether fp32 values can leave its range (fp16's 5-bit exponent; bf16 has fp32's 8)

    def constant(self, values: np.ndarray) -> np.ndarray:
        """fp32 values in this type, clipped to its range first: an additive mask's finfo(float32).min must become
        -max, not -inf (0 · -inf would be NaN). bf16 needs the clip too: rounding to nearest takes float32's
        largest values (above 3.3895e38) to inf. Always an array: numpy's clip gives a 0-d one back as a scalar,
        which a Constant node's gs.Constant refuses."""
        return np.asarray(np.clip(values, -self.max, self.max).astype(self.values_dtype))

    def round(self, values: np.ndarray) -> np.ndarray:
        """`constant(values)` held in fp32 again: the values a graph in this type computes with."""
        return self.constant(values).astype(np.float32)


FP16_FLOAT = HalfFloat(FP16.name, HALF, np.float16, np.float16, FP16_MAX, narrower_than_fp32=True)
BF16_FLOAT = HalfFloat(BF16.name, BFLOAT16, BFLOAT16, ml_dtypes.bfloat16, BF16_MAX, narrower_than_fp32=False)


def largest_outside(values: np.ndarray, limit: float) -> float:
    """The largest |value| above `limit` that does not stand in for infinity (below INFINITY_STAND_IN, finite), or
    0.0 where there is none. Two reductions when every value is within `limit` (no copy of a large weight)."""
    if values.size == 0 or max(float(values.max()), -float(values.min())) <= limit:
        return 0.0
    magnitudes = np.abs(values.astype(np.float32, copy=False)).ravel()
    real = magnitudes[(magnitudes > limit) & (magnitudes < INFINITY_STAND_IN)]  # NaN is neither
    return float(real.max()) if real.size else 0.0


def element_type(tensor: gs.Tensor) -> int | None:
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


def is_fp32(tensor: gs.Tensor) -> bool:
    return element_type(tensor) == FLOAT
