"""Metrics for language models, from next-token logits on real text: perplexity, the perplexity ratio of a
variant over the fp32 graph, and how often the two pick the same next token."""

from __future__ import annotations

import weakref

import numpy as np

from tensorsmith.runtime.generation import log_softmax


def _token_log_likelihoods(tokens: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """log p(next token) at every position but the last, [rows, length - 1]; a row at a time, so the float64
    log-softmax never holds more than one row's [length, vocab]."""
    return np.stack([
        np.take_along_axis(log_softmax(row_logits[:-1]), row_tokens[1:, None], axis=-1)[:, 0]
        for row_tokens, row_logits in zip(tokens, logits, strict=True)
    ])  # fmt: skip


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
        self._predicted.append(logits[:, :-1].argmax(-1))
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
        return {"perplexity": float(np.exp(actual)),
                "perplexity-ratio": float(np.exp(actual - reference.mean_negative_log_likelihood)),
                "next-token-agreement": agreement}  # fmt: skip


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
