"""How one stored value of a tensor is encoded: its bits, the largest magnitude it holds, whether it rounds to
integers, and the numpy dtype that holds it. The precision records (core/precisions.py) are built on these."""

from __future__ import annotations

from enum import Enum

import numpy as np


class Element(str, Enum):
    """How one stored value is encoded."""

    FP32 = "float32"
    FP16 = "float16"
    BF16 = "bfloat16"
    INT8 = "int8"  # dtypes, not precisions
    FP8_E4M3 = "float8e4m3fn"
    INT4 = "int4"  # dtypes, not precisions
    FP4_E2M1 = "float4e2m1"

    @property
    def bits(self) -> int:
        """Bits of one stored value (a block's scales not counted)."""
        return _ELEMENT_BITS[self]

    @property
    def maximum(self) -> float:
        """The largest magnitude a value stores: a symmetric scale maps the range's amax to it."""
        return _ELEMENT_MAXIMUM[self]

    @property
    def is_integer(self) -> bool:
        """Whether values are rounded to integers (else to the nearest float of the format)."""
        return self in (Element.INT8, Element.INT4)

    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that holds one value (INT4 and FP4 codes unpacked: a byte each)."""
        import ml_dtypes  # numpy has no float8 or bfloat16

        types = {
            Element.FP8_E4M3: ml_dtypes.float8_e4m3fn,
            Element.BF16: ml_dtypes.bfloat16,
            Element.INT4: np.int8,
            Element.FP4_E2M1: ml_dtypes.float4_e2m1fn,
        }
        return np.dtype(types.get(self, self.value))


_ELEMENT_BITS = {
    Element.FP32: 32,
    Element.FP16: 16,
    Element.BF16: 16,
    Element.INT8: 8,
    Element.FP8_E4M3: 8,
    Element.INT4: 4,
    Element.FP4_E2M1: 4,
}
_ELEMENT_MAXIMUM = {
    Element.FP32: float(np.finfo(np.float32).max),
    Element.FP16: float(np.finfo(np.float16).max),
    Element.BF16: 3.3895313892515355e38,
    Element.INT8: 127.0,  # symmetric: [-127, 127], zero point 0
    Element.FP8_E4M3: 448.0,  # the largest finite float8 E4M3FN value
    Element.INT4: 7.0,  # symmetric scales; codes reach -8 only by rounding a clipped block's minimum
    Element.FP4_E2M1: 6.0,
}
