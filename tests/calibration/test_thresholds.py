"""Thresholds against hand-computed histograms and against NVIDIA's open reimplementation's outputs."""

import json
from pathlib import Path

import numpy as np
import pytest

from tensorsmith.calibration.thresholds import (
    NUM_BINS,
    entropy_bins,
    entropy_threshold,
    fp8_scale,
    int8_scale,
    kl_divergence,
    percentile_threshold,
)
from tensorsmith.core.formats import per_channel_amax

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "entropy_reference.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}


@pytest.mark.parametrize("name", CASES)
def test_entropy_search_matches_the_reference_implementation(name: str) -> None:
    """Same histogram in, same number of bins out as ModelOpt's _compute_amax_entropy (see the fixture's source)."""
    case = CASES[name]
    histogram = np.array(case["histogram"], dtype=np.int64)
    assert entropy_bins(histogram) == case["entropy_bins"]
    # ModelOpt puts the threshold at the bin's right edge; TensorRT's published rule half a bin further.
    width = case["amax"] / NUM_BINS
    assert case["entropy_amax"] == pytest.approx(case["entropy_bins"] * width, rel=1e-12)
    expected = min((case["entropy_bins"] + 0.5) * width, case["amax"])
    assert entropy_threshold(histogram, case["amax"]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("percentile", ["99.99", "99.9"])
def test_percentile_matches_the_reference_implementation(name: str, percentile: str) -> None:
    case = CASES[name]
    expected_amax, _ = case["percentile"][percentile]
    histogram = np.array(case["histogram"], dtype=np.int64)
    assert percentile_threshold(histogram, case["amax"], float(percentile)) == pytest.approx(expected_amax, rel=1e-12)


def test_entropy_clips_an_outlier_that_max_calibration_would_keep() -> None:
    """Laplace(0, 1) plus one value of 40: max calibration spends the int8 range up to 40; entropy near 10."""
    case = CASES["laplace_with_outlier"]
    threshold = entropy_threshold(np.array(case["histogram"]), case["amax"])
    assert case["amax"] == 40.0
    assert 9.0 < threshold < 12.0


def test_entropy_keeps_a_uniform_distribution_whole() -> None:
    histogram = np.full(NUM_BINS, 50, np.int64)
    assert entropy_bins(histogram) == NUM_BINS
    assert entropy_threshold(histogram, amax=1.0) == 1.0  # clamped to amax


def test_kl_divergence_by_hand() -> None:
    p, q = np.array([1.0, 1.0]), np.array([1.0, 3.0])
    assert kl_divergence(p, q) == pytest.approx(0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75))
    assert kl_divergence(np.array([1.0, 0.0]), np.array([1.0, 0.0])) == 0.0
    assert kl_divergence(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == float("inf")


def test_percentile_by_hand() -> None:
    histogram = np.zeros(10, np.int64)
    histogram[[0, 4, 9]] = [90, 9, 1]  # CDF reaches 0.99 in bin 4, 1.0 in bin 9
    assert percentile_threshold(histogram, amax=10.0, percentile=99) == 4.0
    assert percentile_threshold(histogram, amax=10.0, percentile=100) == 9.0


def test_scales() -> None:
    assert int8_scale(127.0) == 1.0
    assert fp8_scale(448.0) == 1.0


def test_per_channel_amax_is_over_the_output_axis() -> None:
    weights = np.array([[1.0, -5.0, 2.0], [-3.0, 4.0, 0.5]])  # MatMul B: [K=2, N=3], output channels on axis 1
    np.testing.assert_array_equal(per_channel_amax(weights, axis=1), [3.0, 5.0, 2.0])
    np.testing.assert_array_equal(per_channel_amax(weights, axis=0), [5.0, 4.0])


@pytest.mark.parametrize("seed", range(6))
def test_fast_search_equals_the_term_by_term_search(seed: int) -> None:
    """The closed-form search picks the same bin count as evaluating every candidate's KL term by term."""
    from tensorsmith.calibration.thresholds import START_BIN, _divergence

    rng = np.random.default_rng(seed)
    values = np.abs(rng.standard_t(df=2 + seed, size=50_000))
    histogram, _ = np.histogram(values, bins=NUM_BINS, range=(0, values.max()))
    bins = histogram.copy()
    bins[0] = bins[1]
    divergences = np.array([_divergence(bins, i, 128) for i in range(START_BIN, NUM_BINS + 1)])
    expected = START_BIN + np.flatnonzero(divergences == divergences.min())[-1]
    assert entropy_bins(histogram) == expected
