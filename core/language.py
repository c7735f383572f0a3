"""Metrics for language models, from next-token logits on real text: perplexity, the perplexity ratio of a
variant over the fp32 graph, and how often the two pick the same next token."""

from __future__ import annotations

import numpy as np

from tensorsmith.runtime.generation import log_softmax


def mean_negative_log_likelihood(tokens: np.ndarray, logits: np.ndarray) -> float:
    """Of each next token (tokens[:, 1:]) under the logits before it (logits[:, :-1]); [rows, length(, vocab)]."""
    predicted = log_softmax(logits[:, :-1])
    return float(-np.take_along_axis(predicted, tokens[:, 1:, None], axis=-1).mean())


def language_model_metrics(tokens: np.ndarray, reference_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """perplexity (of `logits`), perplexity-ratio (over `reference_logits`'s) and next-token-agreement (the
    fraction of positions where both pick the same most likely token)."""
    reference = mean_negative_log_likelihood(tokens, reference_logits)
    actual = mean_negative_log_likelihood(tokens, logits)
    agreement = float((reference_logits[:, :-1].argmax(-1) == logits[:, :-1].argmax(-1)).mean())
    return {"perplexity": float(np.exp(actual)), "perplexity-ratio": float(np.exp(actual - reference)),
            "next-token-agreement": agreement}  # fmt: skip
