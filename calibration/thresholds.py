"""Thresholds from a histogram of |x|: pure functions, no I/O, tested against hand-computed cases and against
NVIDIA's open reimplementation (pytorch-quantization / ModelOpt `calib/histogram.py`) on the same histograms.

All take `histogram`, counts of |x| in NUM_BINS equal bins over [0, amax], and return a threshold T in the
units of x; values beyond T saturate. INT8 scale = T / 127, FP8 E4M3 scale = amax / 448 (REFERENCE.md §1–3).
"""

from __future__ import annotations

import numpy as np

from tensorsmith.core.formats import FP8_E4M3_MAX, INT8_MAX

NUM_BINS = 2048
INT8_LEVELS = 128  # |q| ≤ 127 plus zero: TensorRT's 128 quantization levels for signed int8
START_BIN = 128
DEFAULT_PERCENTILE = 99.99
NEAR_TIE = 1e-9  # relative: candidates this close to the minimum are recomputed exactly


def entropy_bins(histogram: np.ndarray, levels: int = INT8_LEVELS, start_bin: int = START_BIN) -> int:
    """TensorRT's entropy search: the number of bins i (start_bin ≤ i ≤ len) whose clipped distribution loses
    least information, measured as KL(P‖Q), when quantized to `levels` levels.

    For each i: P = bins[:i] with the outlier mass bins[i:] added to its last bin; Q = bins[:i] merged into
    `levels` groups, each group's mass spread evenly over its non-empty bins. As in NVIDIA's open
    reimplementation (whose results this matches exactly on the reference fixtures): bin 0 takes bin 1's count
    first (exact zeros, e.g. after ReLU, would otherwise dominate), and ties go to the largest i.

    Every candidate's divergence comes from a closed form over prefix sums (O(levels) per candidate); the few
    within rounding of the minimum are then recomputed term by term, as the reference does, to pick among them.
    """
    bins = np.asarray(histogram, dtype=np.int64).copy()
    if bins.size <= start_bin:
        return int(bins.size)
    bins[0] = bins[1]
    candidates = np.arange(start_bin, bins.size + 1)
    fast = _divergences(bins, candidates, levels)
    finite = fast[np.isfinite(fast)]
    if finite.size == 0:
        return int(bins.size)
    cutoff = finite.min() + NEAR_TIE * max(abs(finite.min()), 1.0)
    near = candidates[fast <= cutoff]
    exact = np.array([_divergence(bins, int(i), levels) for i in near])
    return int(near[np.flatnonzero(exact == exact.min())[-1]])  # the last minimum


def _xlogx(values: np.ndarray) -> np.ndarray:
    safe = np.where(values > 0, values, 1.0)
    return np.where(values > 0, values * np.log(safe), 0.0)


def _divergences(bins: np.ndarray, candidates: np.ndarray, levels: int) -> np.ndarray:
    """KL(P‖Q) for every candidate i at once. With P summing to `total` and Q to the window's mass W:
    KL = (Σ P log P − Σ P log Q) / total − log total + log W, where Σ P log Q = Σ_groups S_g log(S_g / n_g)
    plus the outliers times log of the last bin's Q."""
    counts = bins.astype(np.float64)
    total = counts.sum()
    mass = np.concatenate([[0.0], np.cumsum(counts)])  # mass[k] = Σ bins[:k]
    occupied = np.concatenate([[0], np.cumsum(bins != 0)])  # non-empty bins among bins[:k]
    plogp = np.concatenate([[0.0], np.cumsum(_xlogx(counts))])
    outliers = total - mass[candidates]
    last = candidates - 1
    last_p = counts[last] + outliers
    sum_plogp = plogp[last] + _xlogx(last_p)
    # Group g of window i holds bins j with j·levels // i == g: j in [ceil(g·i / levels), ceil((g+1)·i / levels)).
    bounds = (np.arange(levels + 1)[None, :] * candidates[:, None] + levels - 1) // levels
    group_mass = np.diff(mass[bounds], axis=1)
    group_members = np.diff(occupied[bounds], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        group_q = np.where(group_members > 0, group_mass / np.maximum(group_members, 1), 0.0)
        sum_plogq = np.sum(
            np.where(group_members > 0, group_mass * np.log(np.where(group_q > 0, group_q, 1.0)), 0.0), axis=1
        )
        last_group = last * levels // candidates
        last_q = group_q[np.arange(candidates.size), last_group]
        sum_plogq += np.where(outliers > 0, outliers * np.log(np.where(last_q > 0, last_q, 1.0)), 0.0)
        divergence = (sum_plogp - sum_plogq) / total - np.log(total) + np.log(mass[candidates])
    divergence[(counts[last] == 0) & (outliers > 0)] = np.inf  # P keeps outliers where Q is empty
    return divergence


def _divergence(bins: np.ndarray, i: int, levels: int) -> float:
    """KL(P‖Q) of one candidate, term by term in the reference's order (scipy.stats.entropy's arithmetic)."""
    window = bins[:i]
    reference = window.astype(np.float64)
    reference[-1] += bins[i:].sum()
    groups = np.arange(i) * levels // i  # == np.digitize(range(i), np.linspace(0, i, levels + 1)) - 1
    nonzero = window != 0
    nonzero_groups = groups[nonzero]
    sums = np.bincount(nonzero_groups, weights=window[nonzero].astype(np.float64), minlength=levels)
    members = np.bincount(nonzero_groups, minlength=levels)
    spread = np.zeros(i, dtype=np.float64)
    spread[nonzero] = sums[nonzero_groups] / members[nonzero_groups]
    return kl_divergence(reference, spread)


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(P‖Q) of two unnormalized distributions (as scipy.stats.entropy(p, q)); inf where Q misses P's mass."""
    p = p / p.sum()
    q = q / q.sum()
    support = p > 0
    if np.any(q[support] == 0):
        return float("inf")
    return float(np.sum(p[support] * np.log(p[support] / q[support])))


def bin_width(amax: float, bins: int = NUM_BINS) -> float:
    return amax / bins


def entropy_threshold(histogram: np.ndarray, amax: float) -> float:
    """TensorRT's published rule: T = (i + 0.5) · bin width for the best i, at most amax. The search starts at
    START_BIN of NUM_BINS bins, amax/16, whatever the histogram's resolution (statistics.py gives 2048 to 4096
    bins over the amax), as TensorRT's does over its 2048."""
    i = entropy_bins(histogram, start_bin=max(START_BIN, round(START_BIN * len(histogram) / NUM_BINS)))
    return min((i + 0.5) * bin_width(amax, len(histogram)), amax)


def percentile_threshold(histogram: np.ndarray, amax: float, percentile: float = DEFAULT_PERCENTILE) -> float:
    """The left edge of the bin where the CDF of |x| reaches `percentile` (as pytorch-quantization does)."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile {percentile} is not in (0, 100]")
    counts = np.asarray(histogram, dtype=np.float64)
    cdf = np.cumsum(counts / counts.sum())
    index = int(np.searchsorted(cdf, percentile / 100))
    return min(index * bin_width(amax, len(counts)), amax)


def max_threshold(amax: float) -> float:
    return amax


def int8_scale(threshold: float) -> float:
    return threshold / INT8_MAX


def fp8_scale(amax: float) -> float:
    return amax / FP8_E4M3_MAX
