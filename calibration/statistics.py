"""Per-tensor statistics, collected in two passes and mergeable across shards.

Pass 1 records each tensor's amax (max |x| over finite values); pass 2 fills a NUM_BINS histogram of |x| over
[0, amax]. The range is fixed before binning, so the counts do not depend on batch size or sample order, and
memory is tensors × bins, whatever the number of samples. Non-finite values (an additive mask's -inf) are
counted and kept out of both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tensorsmith.calibration.thresholds import NUM_BINS


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
        magnitudes = np.abs(values.astype(np.float32, copy=False)).ravel()
        finite = np.isfinite(magnitudes)
        finite_count = int(np.count_nonzero(finite))
        self.nonfinite += magnitudes.size - finite_count
        self.count += finite_count
        if finite_count:
            peak = float(np.max(magnitudes, where=finite, initial=0.0))
            self.amax = max(self.amax, peak)

    def observe_histogram(self, values: np.ndarray) -> None:
        """Pass 2: bin |x| over the fixed range [0, amax] (values at amax land in the last bin), and count
        again, so a shard's pass-2 statistics stand alone and merge by addition."""
        magnitudes = np.abs(values.astype(np.float32, copy=False)).ravel()
        magnitudes = magnitudes[np.isfinite(magnitudes)]
        self.nonfinite += values.size - magnitudes.size
        self.count += magnitudes.size
        if self.amax <= 0:
            return
        # float64 so the bin of a value does not depend on how float32 rounds amax / NUM_BINS.
        indices = np.minimum((magnitudes.astype(np.float64) * (NUM_BINS / self.amax)).astype(np.int64), NUM_BINS - 1)
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
