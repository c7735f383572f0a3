"""The calibration table: per-tensor thresholds and scales, written as calibration.json and as a TensorRT 10
calibration cache (REFERENCE.md §5) for users of implicit-quantization flows."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from tensorsmith.calibration.statistics import TensorStatistics
from tensorsmith.calibration.thresholds import (
    DEFAULT_PERCENTILE,
    NUM_BINS,
    entropy_threshold,
    fp8_scale,
    int8_scale,
    max_threshold,
    percentile_threshold,
)
from tensorsmith.core.elements import Element

Method = Literal["entropy", "percentile", "minmax"]
# A tensor mostly made of -inf/inf/nan (an additive attention mask) is left unquantized.
MAX_NONFINITE_FRACTION = 0.5
# TensorRT 10.16.1 (NV_TENSORRT_VERSION = major·10000 + minor·100 + patch); TensorRT skips a cache whose
# header names another version, so users pass theirs.
DEFAULT_CACHE_VERSION = 101601


class HistogramSummary(BaseModel):
    bins: int
    bin_width: float
    nonzero_bins: int
    percentiles: dict[str, float] = Field(description="|x| at the 50th/99th/99.9th/99.99th percentile")


class TensorCalibration(BaseModel):
    name: str
    method: Method
    amax: float = Field(description="max |x| seen over finite values")
    threshold: float = Field(description="|x| above this saturates (int8)")
    int8_scale: float
    fp8_scale: float = Field(description="amax / 448")
    count: int
    nonfinite: int
    quantize: bool
    reason: str = ""
    note: str = Field("", description="how the threshold was found where the method did not apply")
    histogram: HistogramSummary


class CalibrationTable(BaseModel):
    method: Method
    percentile: float | None = None
    samples: int
    tensors: dict[str, TensorCalibration]

    def int8_scales(self) -> dict[str, float]:
        return {name: t.int8_scale for name, t in self.tensors.items() if t.quantize}

    def fp8_scales(self) -> dict[str, float]:
        return {name: t.fp8_scale for name, t in self.tensors.items() if t.quantize}

    def scales_in(self, element: Element) -> dict[str, float]:
        """Each quantized tensor's scale in `element`: int8's from the calibrated threshold, fp8 e4m3's amax / 448
        (the only float element a calibrated precision quantizes activations to)."""
        return self.int8_scales() if element.is_integer else self.fp8_scales()

    def write_json(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    def write_tensorrt_cache(self, path: Path, version: int = DEFAULT_CACHE_VERSION) -> None:
        """`TRT-<version>-EntropyCalibration2`, then `name: <scale as big-endian float32 hex>` per tensor; the
        header trtexec's calibrator (IInt8EntropyCalibrator2) expects whatever method chose the thresholds."""
        lines = [f"TRT-{version}-EntropyCalibration2"]
        lines += [f"{name}: {float32_hex(scale)}" for name, scale in sorted(self.int8_scales().items())]
        path.write_text("\n".join(lines) + "\n")


def float32_hex(value: float) -> str:
    return struct.pack(">f", value).hex()


def _summary(statistics: TensorStatistics) -> HistogramSummary:
    histogram, covered = statistics.threshold_histogram()
    width = covered / len(histogram) if covered and len(histogram) else 0.0
    percentiles = {}
    if histogram.sum() and not statistics.derived:
        for level in (50.0, 99.0, 99.9, 99.99):
            percentiles[f"{level:g}"] = percentile_threshold(histogram, covered, level)
    return HistogramSummary(
        bins=len(histogram), bin_width=width, nonzero_bins=int(np.count_nonzero(histogram)), percentiles=percentiles
    )


def calibrate_tensor(statistics: TensorStatistics, method: Method, percentile: float) -> TensorCalibration:
    """The threshold of one tensor by `method` over its histogram (the bins up to its amax); a derived tensor
    (smoothed: no histogram of its own) takes its amax, as SmoothQuant calibrates smoothed activations."""
    reason = ""
    if statistics.nonfinite_fraction > MAX_NONFINITE_FRACTION:
        reason = f"{statistics.nonfinite_fraction:.0%} of its values are not finite (an additive mask?)"
    elif statistics.amax == 0:
        reason = "every value is zero"
    histogram, covered = statistics.threshold_histogram()
    chosen: Method = "minmax" if reason or statistics.derived else method
    if chosen == "minmax":
        threshold = max_threshold(statistics.amax)
    elif chosen == "entropy":
        threshold = entropy_threshold(histogram, covered)
    else:
        threshold = percentile_threshold(histogram, covered, percentile)
    if statistics.amax > 0:
        threshold = min(max(threshold, statistics.amax / NUM_BINS), statistics.amax)  # positive; never above amax
    return TensorCalibration(
        name=statistics.name,
        method=chosen,
        amax=statistics.amax,
        threshold=threshold,
        int8_scale=int8_scale(threshold),
        fp8_scale=fp8_scale(statistics.amax),
        count=statistics.count,
        nonfinite=statistics.nonfinite,
        quantize=not reason,
        reason=reason,
        note=f"amax from {statistics.derived}" if statistics.derived else "",
        histogram=_summary(statistics),
    )


def build_table(
    statistics: Mapping[str, TensorStatistics],
    method: Method,
    samples: int,
    percentile: float = DEFAULT_PERCENTILE,
) -> CalibrationTable:
    return CalibrationTable(
        method=method,
        percentile=percentile if method == "percentile" else None,
        samples=samples,
        tensors={name: calibrate_tensor(stats, method, percentile) for name, stats in statistics.items()},
    )
