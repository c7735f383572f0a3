"""Per-tensor statistics, collected in two passes and mergeable across shards.

Pass 1 records each tensor's amax (max |x| over finite values); pass 2 fills a NUM_BINS histogram of |x| over
[0, amax]. The range is fixed before binning, so the counts do not depend on batch size or sample order, and
memory is tensors × bins, whatever the number of samples. Non-finite values (an additive mask's -inf) are
counted and kept out of both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tensorsmith.calibration.thresholds import NUM_BINS

HISTOGRAMS_NAME = "histograms.npz"  # under OUT/calibration/: the report plots them with the chosen thresholds


@dataclass
class TensorStatistics:
    name: str
    amax: float = 0.0
    count: int = 0  # finite values seen (pass 1)
    nonfinite: int = 0
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(NUM_BINS, np.int64))

    @property
    def nonfinite_fraction(self) -> float:
        total = self.count + self.nonfinite
        return self.nonfinite / total if total else 0.0

    def observe_range(self, values: np.ndarray) -> None:
        """Pass 1: amax and counts."""
        values = np.asarray(values, dtype=np.float32).ravel()
        if values.size == 0:
            return
        peak = max(float(values.max()), -float(values.min()))  # no |x| copy: two reductions
        if np.isfinite(peak):  # a max or min over data with inf or nan is not finite
            self.count += values.size
            self.amax = max(self.amax, peak)
            return
        magnitudes = np.abs(values[np.isfinite(values)])
        self.nonfinite += values.size - magnitudes.size
        self.count += magnitudes.size
        if magnitudes.size:
            self.amax = max(self.amax, float(magnitudes.max()))

    def observe_histogram(self, values: np.ndarray) -> None:
        """Pass 2: bin |x| over the fixed range [0, amax] (values at amax land in the last bin), and count
        again, so a shard's pass-2 statistics stand alone and merge by addition."""
        values = np.asarray(values, dtype=np.float32).ravel()
        if values.size == 0:
            return
        all_finite = np.isfinite(values.max()) and np.isfinite(values.min())
        magnitudes = np.abs(values) if all_finite else np.abs(values[np.isfinite(values)])
        self.nonfinite += values.size - magnitudes.size
        self.count += magnitudes.size
        if self.amax <= 0 or not magnitudes.size:
            return
        # In place, to spare allocations; each value's bin depends on that value alone (float32 arithmetic,
        # the same whatever the batch), so the counts do not depend on batch size or order.
        np.multiply(magnitudes, np.float32(NUM_BINS / self.amax), out=magnitudes)
        indices = magnitudes.astype(np.int32)
        np.minimum(indices, NUM_BINS - 1, out=indices)
        self.histogram += np.bincount(indices, minlength=NUM_BINS)

    def merge(self, other: TensorStatistics) -> TensorStatistics:
        """The statistics of both shards' data together. Histograms add only over the same range: collect
        pass 1 on every shard, merge, and run pass 2 everywhere with the merged amax."""
        if self.name != other.name:
            raise ValueError(f"cannot merge statistics of '{self.name}' and '{other.name}'")
        has_histograms = bool(self.histogram.any() or other.histogram.any())
        if has_histograms and self.amax != other.amax:
            raise ValueError(
                f"'{self.name}': histograms over different ranges ({self.amax} and {other.amax}) do not add; "
                "merge pass-1 statistics first and bin every shard over the merged range"
            )
        return TensorStatistics(
            name=self.name,
            amax=max(self.amax, other.amax),
            count=self.count + other.count,
            nonfinite=self.nonfinite + other.nonfinite,
            histogram=self.histogram + other.histogram,
        )

    def ranged(self) -> TensorStatistics:
        """Empty statistics over this range, ready for pass 2."""
        return TensorStatistics(self.name, self.amax)


def save_histograms(statistics: Mapping[str, TensorStatistics], path: Path) -> None:
    """The pass-2 histograms as one compressed .npz: `names`, `amax` and `counts` (tensors × NUM_BINS), arrays
    that numpy loads without pickle."""
    names = list(statistics)
    np.savez_compressed(
        path,
        names=np.array(names, dtype=np.str_),
        amax=np.array([statistics[name].amax for name in names], dtype=np.float64),
        counts=np.stack([statistics[name].histogram for name in names]) if names else np.zeros((0, NUM_BINS)),
    )


def load_histograms(path: Path) -> dict[str, TensorStatistics]:
    with np.load(path, allow_pickle=False) as archive:
        names, amax, counts = archive["names"], archive["amax"], archive["counts"]
    return {
        str(name): TensorStatistics(str(name), float(peak), int(row.sum()), histogram=row.astype(np.int64))
        for name, peak, row in zip(names, amax, counts, strict=True)
    }
