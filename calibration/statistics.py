"""Per-tensor statistics in one pass over the data, exactly mergeable across batches, shards and machines.

Each tensor keeps its amax (max |x| over finite values), counts, and a histogram of |x| in BINS equal bins over
[0, 2^e): e is the smallest exponent with amax < 2^e, so the amax spans BINS/2 to BINS bins (2048 at least,
the resolution TensorRT's entropy calibration uses over the amax). A value's bin is floor(|x| · BINS / 2^e), an
exact float32 product (a power of two); when a batch raises e, adjacent bins merge in groups of 2^Δe, which gives
exactly the bins the larger range would have given (floor(floor(v / a) / b) = floor(v / ab)). So the
statistics do not depend on batch size, sample order or sharding, bit for bit, and memory is tensors × bins
whatever the number of samples. Non-finite values (an additive mask's -inf) are counted and kept out.

`Statistics` adds the per-channel ranges smoothing needs, in the same pass, and saves and loads as an .npz
(no pickle) that names the graph it was collected on.
"""

from __future__ import annotations

import glob
import math
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from tensorsmith.calibration.thresholds import NUM_BINS
from tensorsmith.core.errors import CalibrationError

BINS = 2 * NUM_BINS
BIN_BITS = BINS.bit_length() - 1  # BINS = 2^BIN_BITS
HISTOGRAMS_NAME = "histograms.npz"  # under OUT/calibration/: the report plots them with the chosen thresholds
STATISTICS_FORMAT = 1


def fold(histogram: np.ndarray, steps: int) -> np.ndarray:
    """The histogram over a range 2^steps times larger: each group of 2^steps adjacent bins becomes one."""
    if steps <= 0:
        return histogram
    folded = np.zeros_like(histogram)
    if steps >= BIN_BITS:
        folded[0] = histogram.sum()
        return folded
    folded[: BINS >> steps] = histogram.reshape(BINS >> steps, 1 << steps).sum(axis=1)
    return folded


@dataclass
class TensorStatistics:
    name: str
    amax: float = 0.0
    count: int = 0  # finite values seen
    nonfinite: int = 0
    exponent: int | None = None  # the histogram covers [0, 2**exponent); None until a nonzero value is seen
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.int64))
    derived: str = ""  # how the amax was derived without a histogram of its own (a smoothed tensor), if it was

    @property
    def nonfinite_fraction(self) -> float:
        total = self.count + self.nonfinite
        return self.nonfinite / total if total else 0.0

    @property
    def histogram_range(self) -> float:
        return math.ldexp(1.0, self.exponent) if self.exponent is not None else 0.0

    def observe(self, values: np.ndarray) -> None:
        """Counts, amax and histogram of one batch's values."""
        values = np.asarray(values, dtype=np.float32).ravel()
        if values.size == 0:
            return
        peak = max(float(values.max()), -float(values.min()))  # two reductions, no copy
        if np.isfinite(peak):
            magnitudes = np.abs(values)
        else:  # a max or min over data with inf or nan is not finite
            magnitudes = np.abs(values[np.isfinite(values)])
            peak = float(magnitudes.max()) if magnitudes.size else 0.0
        self.nonfinite += values.size - magnitudes.size
        self.count += magnitudes.size
        self.amax = max(self.amax, peak)
        if peak > 0:
            self._cover(math.frexp(peak)[1])  # peak = m·2^e with m in [0.5, 1): peak < 2^e
        if self.exponent is None:  # only zeros so far: bin 0 under any range
            self.histogram[0] += magnitudes.size
            return
        step = math.ldexp(1.0, BIN_BITS - self.exponent)  # BINS / 2^e, a power of two
        if np.finfo(np.float32).tiny <= step <= np.finfo(np.float32).max:  # in place: float32 products are exact
            np.multiply(magnitudes, np.float32(step), out=magnitudes)
            scaled = magnitudes
        else:
            scaled = magnitudes.astype(np.float64) * step
        indices = scaled.astype(np.int32)
        np.minimum(indices, BINS - 1, out=indices)
        self.histogram += np.bincount(indices, minlength=BINS)

    def _cover(self, exponent: int) -> None:
        if self.exponent is None:
            self.exponent = exponent
        elif exponent > self.exponent:
            self.histogram = fold(self.histogram, exponent - self.exponent)
            self.exponent = exponent

    def merge(self, other: TensorStatistics) -> TensorStatistics:
        """The statistics of both shards' data together: exactly what one pass over all of it gives."""
        if self.name != other.name:
            raise ValueError(f"cannot merge statistics of '{self.name}' and '{other.name}'")
        exponents = [e for e in (self.exponent, other.exponent) if e is not None]
        exponent = max(exponents) if exponents else None

        def aligned(side: TensorStatistics) -> np.ndarray:  # over the wider range (only zeros: bin 0 under any)
            return side.histogram if side.exponent is None else fold(side.histogram, max(exponents) - side.exponent)

        histogram = aligned(self) + aligned(other)
        return TensorStatistics(
            self.name,
            max(self.amax, other.amax),
            self.count + other.count,
            self.nonfinite + other.nonfinite,
            exponent,
            histogram,
            self.derived,
        )

    def threshold_histogram(self) -> tuple[np.ndarray, float]:
        """(the bins up to the one holding the amax, the range they cover): what the threshold functions take."""
        if self.exponent is None or self.amax <= 0:
            return self.histogram[:NUM_BINS], self.amax
        used = min(int(self.amax * math.ldexp(1.0, BIN_BITS - self.exponent)) + 1, BINS)
        return self.histogram[:used], used * math.ldexp(1.0, self.exponent - BIN_BITS)


def smoothed_statistics(
    name: str, channel_amax: np.ndarray, inverse_scale: np.ndarray, of: TensorStatistics
) -> TensorStatistics:
    """x·(1/s) per channel, as SmoothQuant calibrates it: its amax, exactly (a float32 product by a positive
    constant keeps the order, so max|x_c·k_c| = max|x_c|·k_c), and no histogram: it is never observed."""
    amax = (
        float(np.max(channel_amax.astype(np.float32) * inverse_scale.astype(np.float32))) if channel_amax.size else 0.0
    )
    return TensorStatistics(
        name, amax, of.count, of.nonfinite, derived="the per-channel ranges over the smoothing scales"
    )


@dataclass
class Statistics:
    """Everything a compile's calibration needs from the data, from one pass: per-tensor statistics of the
    tensors the Q/DQ pass quantizes, and per-channel max |x| of the activations smoothing may scale."""

    tensors: dict[str, TensorStatistics]
    channel_amax: dict[str, np.ndarray] = field(default_factory=dict)
    samples: int = 0

    def merge(self, other: Statistics) -> Statistics:
        if set(self.tensors) != set(other.tensors) or set(self.channel_amax) != set(other.channel_amax):
            raise CalibrationError(
                "the statistics to merge observed different tensors", hint="collect every shard with the same graph"
            )
        return Statistics(
            {name: stats.merge(other.tensors[name]) for name, stats in self.tensors.items()},
            {name: np.maximum(amax, other.channel_amax[name]) for name, amax in self.channel_amax.items()},
            self.samples + other.samples,
        )

    def save(self, path: Path | BinaryIO, graph_sha256: str) -> None:
        names, channels = list(self.tensors), list(self.channel_amax)
        arrays = {
            "format": np.array(STATISTICS_FORMAT),
            "graph_sha256": np.array(graph_sha256),
            "samples": np.array(self.samples, np.int64),
            "names": np.array(names, dtype=np.str_),
            "amax": np.array([self.tensors[n].amax for n in names], np.float64),
            "count": np.array([self.tensors[n].count for n in names], np.int64),
            "nonfinite": np.array([self.tensors[n].nonfinite for n in names], np.int64),
            "exponent": np.array([_exponent_or_sentinel(self.tensors[n].exponent) for n in names], np.int64),
            "histograms": np.stack([self.tensors[n].histogram for n in names]) if names else np.zeros((0, BINS)),
            "channel_names": np.array(channels, dtype=np.str_),
        }
        arrays |= {f"channel_amax_{index}": self.channel_amax[name] for index, name in enumerate(channels)}
        if isinstance(path, Path):
            with path.open("wb") as file:
                np.savez_compressed(file, **arrays)  # type: ignore[arg-type]
        else:
            np.savez_compressed(path, **arrays)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path | BinaryIO) -> tuple[Statistics, str]:
        """(the statistics, the sha256 of the graph they were collected on)."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                if int(archive["format"]) != STATISTICS_FORMAT:
                    raise CalibrationError(
                        f"{path}: statistics format {int(archive['format'])}, this tensorsmith "
                        f"reads {STATISTICS_FORMAT}",
                        hint="collect them again",
                    )
                names = [str(name) for name in archive["names"]]
                tensors = {
                    name: TensorStatistics(
                        name,
                        float(peak),
                        int(count),
                        int(nonfinite),
                        _sentinel_or_exponent(int(exponent)),
                        row.astype(np.int64),
                    )
                    for name, peak, count, nonfinite, exponent, row in zip(
                        names,
                        archive["amax"],
                        archive["count"],
                        archive["nonfinite"],
                        archive["exponent"],
                        archive["histograms"],
                        strict=True,
                    )
                }
                channels = {
                    str(name): archive[f"channel_amax_{index}"].astype(np.float32)
                    for index, name in enumerate(archive["channel_names"])
                }
                return cls(tensors, channels, int(archive["samples"])), str(archive["graph_sha256"])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            raise CalibrationError(
                f"cannot read calibration statistics {path}: {err}",
                hint="pass files written by `tensorsmith calibrate`",
            ) from err


NO_EXPONENT = -(2**31)


def _exponent_or_sentinel(exponent: int | None) -> int:
    return NO_EXPONENT if exponent is None else exponent


def _sentinel_or_exponent(value: int) -> int | None:
    return None if value == NO_EXPONENT else value


def save_histograms(statistics: Mapping[str, TensorStatistics], path: Path) -> None:
    """The histograms as one compressed .npz: `names`, `amax`, `range` (what the BINS bins cover) and `counts`
    (tensors × BINS), arrays that numpy loads without pickle. A derived tensor has none and is left out."""
    names = [name for name, stats in statistics.items() if not stats.derived]
    np.savez_compressed(
        path,
        names=np.array(names, dtype=np.str_),
        amax=np.array([statistics[name].amax for name in names], dtype=np.float64),
        exponent=np.array([_exponent_or_sentinel(statistics[name].exponent) for name in names], np.int64),
        counts=np.stack([statistics[name].histogram for name in names]) if names else np.zeros((0, BINS)),
    )


def load_histograms(path: Path) -> dict[str, TensorStatistics]:
    with np.load(path, allow_pickle=False) as archive:
        names, amax, exponents, counts = archive["names"], archive["amax"], archive["exponent"], archive["counts"]
    return {
        str(name): TensorStatistics(
            str(name),
            float(peak),
            int(row.sum()),
            exponent=_sentinel_or_exponent(int(e)),
            histogram=row.astype(np.int64),
        )
        for name, peak, e, row in zip(names, amax, exponents, counts, strict=True)
    }


def merged_statistics(pattern: str, graph_sha256: str, base: Path) -> Statistics:
    """The statistics files `pattern` (a glob, relative to `base`) matches, merged, after checking each was
    collected on this graph."""
    paths = sorted(Path(path) for path in glob.glob(pattern if Path(pattern).is_absolute() else str(base / pattern)))
    if not paths:
        raise CalibrationError(
            f"--calibration-stats '{pattern}' matches no file", hint="write them with tensorsmith calibrate"
        )
    merged: Statistics | None = None
    for path in paths:
        statistics, collected_on = Statistics.load(path)
        if collected_on != graph_sha256:
            raise CalibrationError(
                f"{path} was collected on another graph (sha256 {collected_on[:12]}…, this compile's fused graph is "
                f"{graph_sha256[:12]}…)",
                hint="run tensorsmith calibrate with the same source, opset and targets as the compile",
            )
        merged = statistics if merged is None else merged.merge(statistics)
    assert merged is not None
    return merged
