"""AWQ's searches (calibration/awq.py) against their definitions written out the slow way: the scale search's error
is the quantized product's distance from x·W, the clip search's per-block error is the sum over sample rows of the
block's output error (the Gram-matrix form must choose the same ratios), and column chunks change nothing; the
statistics of a graph run a segment at a time over every batch are those of a whole session, bit for bit."""

from pathlib import Path

import numpy as np
import pytest

from tensorsmith.calibration import Observer, awq
from tensorsmith.calibration.awq import ActivationStatistics, collect_statistics
from tensorsmith.core.layerwise import LayerwiseSession, layerwise
from tensorsmith.passes.int4 import dequantize_int4, quantize_int4
from tests.core.test_layerwise import _layers

BLOCK = 32


def statistics(rows: int, channels: int, seed: int = 0) -> awq.ActivationStatistics:
    """Activations with a few outlier channels, the case AWQ's scales are for."""
    rng = np.random.default_rng(seed)
    outliers = 1.0 + 8.0 * (rng.random(channels) < 0.05)
    observed = awq.ActivationStatistics()
    for _ in range(4):
        observed.observe((rng.standard_normal((1, rows, channels)) * outliers).astype(np.float32))
    return observed


def weight(rows: int, columns: int, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, columns)) * 0.05).astype(np.float32)


def slow_clip(observed: awq.ActivationStatistics, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Every ratio's error per block and column, summed over the sample rows one product at a time."""
    x = observed.sample / scale
    scaled = w * scale[:, None]
    blocks = w.shape[0] // BLOCK
    errors = []
    for ratio in awq.CLIP_RATIOS:
        q, step = quantize_int4(scaled, BLOCK, np.full((blocks, w.shape[1]), ratio, np.float32))
        difference = (scaled - dequantize_int4(q, step, BLOCK)).reshape(blocks, BLOCK, -1)
        per_row = np.stack([x[:, k * BLOCK : (k + 1) * BLOCK] @ difference[k] for k in range(blocks)], axis=1)
        errors.append((per_row.astype(np.float64) ** 2).sum(axis=0))
    return np.asarray(awq.CLIP_RATIOS, np.float32)[np.argmin(np.stack(errors), axis=0)]


def test_clip_search_matches_the_per_row_error() -> None:
    observed, w = statistics(64, 128), weight(128, 48)
    scale = np.linspace(0.5, 2.0, 128, dtype=np.float32)
    fast, slow = awq.search_clip(observed, w, scale, BLOCK), slow_clip(observed, w, scale)
    assert fast.shape == (128 // BLOCK, 48)
    assert np.mean(fast == slow) > 0.98  # float32 Gram against float64 rows: a near tie may fall either way
    assert set(np.unique(fast)) <= set(np.float32(awq.CLIP_RATIOS))


def test_scale_search_error_is_the_quantized_products_distance() -> None:
    observed, w = statistics(64, 128), weight(128, 40)
    scale, alpha, relative = awq.search_scale(observed, [w], BLOCK)
    x = observed.sample
    q, step = quantize_int4(w * scale[:, None], BLOCK)
    awq_error = np.mean(((x / scale) @ dequantize_int4(q, step, BLOCK) - x @ w) ** 2)
    q, step = quantize_int4(w, BLOCK)
    rtn_error = np.mean((x @ dequantize_int4(q, step, BLOCK) - x @ w) ** 2)
    assert alpha in awq.ALPHAS
    assert relative == pytest.approx(awq_error / rtn_error, rel=1e-3)
    assert relative <= 1.0  # α = 0 is round-to-nearest: the search never does worse on its sample
    assert alpha > 0.0  # outlier channels: some scaling wins


@pytest.mark.parametrize("workers", [1, 3])
def test_column_chunks_change_nothing(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """The search's chunks of columns, on one thread or several, find what one chunk of every column finds."""
    observed, w = statistics(64, 64), weight(64, 100)
    monkeypatch.setattr(awq, "WORKERS", 1)
    monkeypatch.setattr(awq, "COLUMNS_PER_CHUNK", 100)
    whole_scale, whole_alpha, _ = awq.search_scale(observed, [w], BLOCK)
    whole_clip = awq.search_clip(observed, w, whole_scale, BLOCK)
    monkeypatch.setattr(awq, "COLUMNS_PER_CHUNK", 16)  # 100 columns: six whole chunks and a partial one
    one_thread = awq.search_scale(observed, [w], BLOCK)
    one_thread_clip = awq.search_clip(observed, w, whole_scale, BLOCK)
    monkeypatch.setattr(awq, "WORKERS", workers)
    chunked_scale, chunked_alpha, relative = awq.search_scale(observed, [w], BLOCK)
    chunked_clip = awq.search_clip(observed, w, whole_scale, BLOCK)
    assert chunked_alpha == whole_alpha
    np.testing.assert_array_equal(chunked_scale, whole_scale)
    np.testing.assert_array_equal(chunked_clip, whole_clip)
    # at one chunk size, every figure bit for bit whatever the threads: the errors are summed in chunk order
    assert relative == one_thread[2] and chunked_alpha == one_thread[1]
    np.testing.assert_array_equal(chunked_clip, one_thread_clip)


def test_readers_searched_side_by_side_find_what_their_joined_weights_find(monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k and v's weights are searched as they are, never joined into one copy (2.1 GB at an 8B's vocabulary):
    where their chunks fall on the same columns, every figure is the joined matrix's, bit for bit."""
    observed, w = statistics(64, 64), weight(64, 100)
    monkeypatch.setattr(awq, "COLUMNS_PER_CHUNK", 16)
    assert awq.search_scale(observed, [w[:, :32], w[:, 32:]], BLOCK)[1:] == awq.search_scale(observed, [w], BLOCK)[1:]


def test_awq_statistics_a_segment_at_a_time_equal_a_batch_at_a_time(tmp_path: Path) -> None:
    """AWQ's observed pass over a graph run layerwise (every batch through one segment before the next, so that
    the weights are read once) gives the statistics of the whole graph's session, batch by batch, bit for bit."""
    path = _layers(tmp_path / "model.onnx", layers=4, hidden=64, inner=256)
    batches = [{"x": np.random.default_rng(seed).standard_normal((40, 64)).astype(np.float32)} for seed in range(6)]
    activations = ["0/out", "1/r", "2/r", "3/out"]
    found: dict[str, dict[str, ActivationStatistics]] = {}
    for mode in ("always", "never"):
        with layerwise(mode):
            observer = Observer(path, activations)
            assert isinstance(observer.session, LayerwiseSession) == (mode == "always")
            found[mode] = statistics = {}

            def observe(_: int, name: str, values: np.ndarray, into: dict = statistics) -> None:
                into.setdefault(name, ActivationStatistics()).observe(values)

            observer.observe_each(batches, observe)
    whole = collect_statistics(Observer(path, activations).run(batch) for batch in batches)
    for name in activations:
        for statistics in (found["always"][name], found["never"][name]):
            np.testing.assert_array_equal(statistics.mean_abs, whole[name].mean_abs)
            np.testing.assert_array_equal(statistics.sample, whole[name].sample)
