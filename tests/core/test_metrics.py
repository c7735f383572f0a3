"""Variant accuracy figures computed a few samples at a time (core/metrics.py): the same figures as over the whole
arrays at once, for outputs of every rank, empty ones included."""

import numpy as np
import pytest

from tensorsmith.core import metrics

RNG = np.random.default_rng(0)
REFERENCE = [RNG.standard_normal((9, 16, 50)).astype(np.float32), RNG.standard_normal(5).astype(np.float32),
             np.full((), 2.0, np.float32), np.zeros((2, 0, 4), np.float32)]  # fmt: skip
ACTUAL = [r + 0.01 * RNG.standard_normal(r.shape).astype(np.float32) for r in REFERENCE]


def whole_cosines(reference: np.ndarray, actual: np.ndarray) -> np.ndarray:
    a, b = (np.asarray(x, np.float64).reshape(len(x), -1) for x in (reference, actual))
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("chunk", [1, 700, 1 << 22])  # a sample at a time (each is 800), several, all at once
def test_figures_do_not_depend_on_the_chunk(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", chunk)
    figures = metrics.accuracy(REFERENCE, ACTUAL)
    cosines = whole_cosines(REFERENCE[0], ACTUAL[0])
    np.testing.assert_allclose(metrics.sample_cosines(REFERENCE[0], ACTUAL[0]), cosines, rtol=1e-12)
    # the other outputs' samples are single values or empty: cosine 1, so the first output is the worst
    assert figures["cosine"] == pytest.approx(cosines.mean(), rel=1e-12)
    assert figures["min-cosine"] == pytest.approx(cosines.min(), rel=1e-12)
    big = np.asarray(REFERENCE[0], np.float64)
    noise = np.asarray(ACTUAL[0], np.float64) - big
    assert metrics.relative_error(REFERENCE[0], ACTUAL[0]) == pytest.approx(np.abs(noise).max() / np.abs(big).max())
    assert metrics.METRICS["max-abs"][0](REFERENCE, ACTUAL) == pytest.approx(
        max(float(np.abs(np.asarray(a, np.float64) - r).max()) for r, a in zip(REFERENCE[:3], ACTUAL[:3], strict=True))
    )
    assert figures["sqnr-db"] == pytest.approx(min(
        10 * np.log10(np.sum(np.asarray(r, np.float64) ** 2) / np.sum((np.asarray(a, np.float64) - r) ** 2))
        for r, a in zip(REFERENCE[:3], ACTUAL[:3], strict=True)))  # fmt: skip


def test_running_figures_over_rows_are_the_whole_arrays_figures() -> None:
    """A variant measured a few rows at a time (compiler/variants/measure.py) records what one run of all would."""
    reference, actual = REFERENCE[:1], ACTUAL[:1]  # rows on axis 0
    running = metrics.RunningAccuracy(1)
    for start, stop in ((0, 2), (2, 3), (3, 9)):
        running.add([reference[0][start:stop]], [actual[0][start:stop]])
    whole = metrics.accuracy(reference, actual)
    assert running.figures() == pytest.approx(whole, rel=1e-12)
    assert running.figure("max-abs") == pytest.approx(metrics.METRICS["max-abs"][0](reference, actual), rel=1e-12)


def test_token_figures_over_rows_are_the_whole_logits_figures() -> None:
    from tensorsmith.core.language import TokenFigures, language_model_metrics

    tokens = RNG.integers(0, 50, (5, 16))
    reference_logits = RNG.standard_normal((5, 16, 50)).astype(np.float32)
    logits = reference_logits + 0.5 * RNG.standard_normal(reference_logits.shape).astype(np.float32)
    reference, actual = TokenFigures(tokens), TokenFigures(tokens)
    for start, stop in ((0, 1), (1, 4), (4, 5)):
        reference.add(reference_logits[start:stop])
        actual.add(logits[start:stop])
    whole = language_model_metrics(tokens, reference_logits, logits)
    assert actual.metrics(reference) == pytest.approx(whole, rel=1e-12)
    assert 0 < whole["next-token-agreement"] < 1 and whole["perplexity-ratio"] != 1.0


def test_a_nan_anywhere_is_the_worst_figure() -> None:
    """An fp16 overflow makes NaN: every figure says so (Python's max and min pass over a NaN that is not first)."""
    actual = [ACTUAL[0].copy()]
    actual[0][5, 3, 7] = np.nan  # in the second of several chunks
    running = metrics.RunningAccuracy(1)
    for start in range(0, 9, 2):
        running.add([REFERENCE[0][start : start + 2]], [actual[0][start : start + 2]])
    figures = running.figures()
    assert np.isnan(running.figure("max-abs")) and np.isnan(figures["max_relative_error"])
    assert np.isnan(figures["cosine"]) and np.isnan(figures["min-cosine"]) and np.isnan(figures["sqnr-db"])
    assert not metrics.Budget.parse("max-abs<=0.1").met(running.figure("max-abs"))
