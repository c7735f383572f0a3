"""Metrics for language models, from next-token logits on real text: perplexity, the perplexity ratio of a
variant over the fp32 graph, and how often the two pick the same next token."""

from __future__ import annotations

import weakref

import numpy as np


def _token_log_likelihoods(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """log p(next token) at every position but the last, [rows, length - 1], a row at a time: the logit of the next
    token less the log-sum-exp of its position, exponentials in float32 (shifted by the position's max, so they
    are in [0, 1]) summed in float64. A float64 log-softmax of every logit took 1 s a variant at SmolLM-135M's
    vocabulary for the same figures (the sums agree to 1e-7)."""
    rows = []
    for row_tokens, row_logits in zip(tokens, logits, strict=True):
        scores = np.asarray(row_logits[:-1], dtype=np.float32)  # contiguous: one window's positions
        peak = scores.max(axis=-1, keepdims=True)
        total = np.exp(scores - peak).sum(axis=-1, dtype=np.float64)
        chosen = np.take_along_axis(scores, row_tokens[1:, None], axis=-1)[:, 0]
        rows.append((chosen - peak[:, 0]).astype(np.float64) - np.log(total))
    return np.stack(rows)


def _most_likely(logits: np.ndarray) -> np.ndarray:
    """The most likely next token at every position but the last, [rows, length - 1]: a row at a time, as numpy's
    argmax over the strided view logits[:, :-1] copied it element by element (3.5 s for 16 windows of 128 tokens
    at SmolLM-135M's vocabulary, against 0.04 s a row at a time)."""
    if not len(logits):
        return np.zeros((0, logits.shape[1] - 1), np.int64)
    return np.stack([row[:-1].argmax(-1) for row in logits])


class TokenFigures:
    """One model's figures on the evaluation windows, from its logits given a few rows at a time, in order: the
    summed log-likelihood of each next token and its most likely next token at every position. A decoder's
    logits at every position are hundreds of MB at a real vocabulary: they need never be held whole."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens  # [rows, length]
        self.log_likelihood = 0.0
        self._predicted: list[np.ndarray] = []
        self.rows = 0

    def add(self, logits: np.ndarray) -> None:
        """The logits of the next rows of the windows."""
        rows = self.tokens[self.rows : self.rows + len(logits)]
        self.log_likelihood += float(_token_log_likelihoods(rows, logits).sum(dtype=np.float64))
        self._predicted.append(_most_likely(logits))
        self.rows += len(logits)

    @property
    def predicted(self) -> np.ndarray:
        return np.concatenate(self._predicted) if self._predicted else np.zeros((0, self.tokens.shape[1] - 1), int)

    @property
    def mean_negative_log_likelihood(self) -> float:
        return -self.log_likelihood / max(1, self.rows * (self.tokens.shape[1] - 1))

    def metrics(self, reference: TokenFigures) -> dict[str, float]:
        """perplexity (this model's), perplexity-ratio (over `reference`'s) and next-token-agreement (the fraction
        of positions where both pick the same most likely token), on the rows both have seen."""
        actual = self.mean_negative_log_likelihood
        agreement = float((reference.predicted[: self.rows] == self.predicted).mean())
        return {
            "perplexity": float(np.exp(actual)),
            "perplexity-ratio": float(np.exp(actual - reference.mean_negative_log_likelihood)),
            "next-token-agreement": agreement,
        }


# The fp32 reference's figures on the evaluation windows, by (logits, tokens) while both live: every variant (and
# each cpu setting tried) is measured against the same reference, whose log-softmax over a large vocabulary took
# seconds each time.
_REFERENCE: dict[tuple[int, int], tuple[weakref.ref[np.ndarray], weakref.ref[np.ndarray], TokenFigures]] = {}


def reference_figures(tokens: np.ndarray, reference_logits: np.ndarray) -> TokenFigures:
    """The reference's TokenFigures on `tokens`, computed once while both arrays live."""
    key = (id(reference_logits), id(tokens))
    known = _REFERENCE.get(key)
    if known is not None and known[0]() is reference_logits and known[1]() is tokens:
        return known[2]
    figures = TokenFigures(tokens)
    figures.add(reference_logits)
    _REFERENCE.clear()  # one reference at a time: a compile measures against one
    _REFERENCE[key] = (weakref.ref(reference_logits), weakref.ref(tokens), figures)
    return figures


def language_model_metrics(tokens: np.ndarray, reference_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """perplexity (of `logits`), perplexity-ratio (over `reference_logits`'s) and next-token-agreement (the
    fraction of positions where both pick the same most likely token)."""
    figures = TokenFigures(tokens)
    figures.add(logits)
    return figures.metrics(reference_figures(tokens, reference_logits))
