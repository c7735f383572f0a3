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


def mean_negative_log_likelihood(tokens: np.ndarray, logits: np.ndarray) -> float:
    """Of each next token (tokens[:, 1:]) under the logits before it (logits[:, :-1]); [rows, length(, vocab)]."""
    return float(-_token_log_likelihoods(tokens, logits).mean())


# The fp32 reference's figures on the evaluation windows, by (logits, tokens) while both live: every variant (and
# each cpu setting tried) is measured against the same reference, whose log-softmax over a large vocabulary took
# seconds each time.
_REFERENCE: dict[tuple[int, int], tuple[weakref.ref[np.ndarray], weakref.ref[np.ndarray], float, np.ndarray]] = {}


def _reference_figures(tokens: np.ndarray, reference_logits: np.ndarray) -> tuple[float, np.ndarray]:
    """(mean negative log-likelihood, most likely next token per position) of the reference, computed once."""
    key = (id(reference_logits), id(tokens))
    known = _REFERENCE.get(key)
    if known is not None and known[0]() is reference_logits and known[1]() is tokens:
        return known[2], known[3]
    figures = (mean_negative_log_likelihood(tokens, reference_logits), reference_logits[:, :-1].argmax(-1))
    _REFERENCE.clear()  # one reference at a time: a compile measures against one
    _REFERENCE[key] = (weakref.ref(reference_logits), weakref.ref(tokens), *figures)
    return figures


def language_model_metrics(tokens: np.ndarray, reference_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """perplexity (of `logits`), perplexity-ratio (over `reference_logits`'s) and next-token-agreement (the
    fraction of positions where both pick the same most likely token)."""
    reference, reference_tokens = _reference_figures(tokens, reference_logits)
    actual = mean_negative_log_likelihood(tokens, logits)
    agreement = float((reference_tokens == logits[:, :-1].argmax(-1)).mean())
    return {"perplexity": float(np.exp(actual)), "perplexity-ratio": float(np.exp(actual - reference)),
            "next-token-agreement": agreement}  # fmt: skip
