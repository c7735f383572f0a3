"""Metrics for language models, from next-token logits on real text: perplexity, the perplexity ratio of a
variant over the fp32 graph, and how often the two pick the same next token."""

from __future__ import annotations

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


def language_model_metrics(tokens: np.ndarray, reference_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """perplexity (of `logits`), perplexity-ratio (over `reference_logits`'s) and next-token-agreement (the
    fraction of positions where both pick the same most likely token)."""
    reference = mean_negative_log_likelihood(tokens, reference_logits)
    actual = mean_negative_log_likelihood(tokens, logits)
    agreement = float((reference_logits[:, :-1].argmax(-1) == logits[:, :-1].argmax(-1)).mean())
    return {"perplexity": float(np.exp(actual)), "perplexity-ratio": float(np.exp(actual - reference)),
            "next-token-agreement": agreement}  # fmt: skip
