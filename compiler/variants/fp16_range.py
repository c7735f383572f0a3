"""Activations that leave fp16's range, found on the fp32 graph before its fp16 variant is written.

fp16's largest value is 65504. Some checkpoints' residual streams reach the thousands to tens of thousands (the
"massive activations" of a few tokens), and an RMSNorm's squares of them far more: the fp16 variant would hold inf
there. So the fp32 graph's run on the verification feeds also reduces every float node output to its min and
max inside the graph (core/tensor_ranges.py: verification's own session, where verification runs; else a run of
its own), memory staying that of one fp32 run whatever the number of tensors. (ONNX Runtime's MinMaxCalibrater,
which augments a graph the same way, takes a path, loads the weights into a proto, writes two copies of them to
disk, its shape-inferred and its augmented graph, and runs unoptimized.)

A tensor counts as out of range above an eighth of fp16's largest value (`ACTIVATION_LIMIT`, 8188): three
binades of headroom for inputs other than the verification feeds, whose token ids are all ones. On the two trained
checkpoints here, real text took the largest activations to 3.7x (tinylm) and 2.8x (all-MiniLM-L6-v2) what those
feeds gave, while the length did little (16 to 512 tokens: within 1.2x); a sum over the sequence (mean pooling)
grows with it, but from values far below. The residual stream's massive activations of real LLMs sit at the first
token whatever it is, so these feeds meet them. Its negative side at -1e9 or below is a mask (scores plus
finfo(float32).min or -1e9), which fp16's -65504 masks as well, and not a range to keep; non-finite values (an empty
tensor's reduction, the fp32 graph's own overflow) are left out.

The fp16 pass (passes/fp16.py, its regions decided in passes/half_regions.py) keeps the writers and readers of
the tensors found here in fp32.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from tensorsmith.core.tensor_ranges import TensorRange, tensor_ranges
from tensorsmith.passes.half_float import FP16_MAX, INFINITY_STAND_IN
from tensorsmith.runtime.errors import onnxruntime_reason

logger = logging.getLogger(__name__)

ACTIVATION_LIMIT = FP16_MAX / 8  # measured headroom: see above


def magnitude(tensor: TensorRange) -> float:
    """Its largest |value| that a half type must hold: finite values only, and no mask below -1e9."""
    high = tensor.high if math.isfinite(tensor.high) else 0.0
    low = tensor.low if math.isfinite(tensor.low) and tensor.low > -INFINITY_STAND_IN else 0.0
    return max(high, -low, 0.0)


def out_of_range_activations(
    path: Path,
    feeds: dict[str, np.ndarray],
    limit: float = ACTIVATION_LIMIT,
    measured: list[TensorRange] | None = None,
) -> dict[str, float]:
    """The fp32 node outputs of the graph at `path` whose magnitude on `feeds` exceeds `limit`: name → max |x|, for
    `ConvertToFp16(out_of_range=...)`, from the ranges `measured` already (by verification) or measured now. Where
    ONNX Runtime cannot run the augmented graph, none (logged: only the weights are then checked)."""
    if measured is None:
        try:
            measured = tensor_ranges(path, feeds)
        except Exception as err:  # onnxruntime's own exception types
            logger.warning("fp16: activations not checked against fp16's range: %s", onnxruntime_reason(err))
            return {}
    magnitudes = {tensor.name: magnitude(tensor) for tensor in measured}
    return {name: value for name, value in magnitudes.items() if value > limit}
