"""The number formats quantized variants store, and how a weight tensor's scale range is measured.

Shared by calibration (thresholds → scales) and the passes that write Q/DQ and quantized weights.
"""

from __future__ import annotations

import numpy as np

INT8_MAX = 127.0  # symmetric int8: [-127, 127], zero point 0
FP8_E4M3_MAX = 448.0  # the largest finite float8 E4M3FN value


def per_channel_amax(weights: np.ndarray, axis: int) -> np.ndarray:
    """max |w| over every axis but `axis` (the output channels): one value per channel."""
    reduce = tuple(a for a in range(weights.ndim) if a != axis % weights.ndim)
    return absolute_max(weights, reduce)


def absolute_max(values: np.ndarray, axis: int | tuple[int, ...] | None = None) -> np.ndarray:
    """max |x| along `axis` (None: over every element), without |x| in memory: a vocabulary table's absolute values
    were its size again. A NaN anywhere it reduces gives NaN."""
    return np.maximum(np.max(values, axis=axis), -np.min(values, axis=axis))
