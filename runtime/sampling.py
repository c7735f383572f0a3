"""How the next token is chosen from a row of logits: greedy (argmax), or sampled with temperature, top-k and top-p
in transformers' order, with numpy's generator (the same seed gives the same text here, not torch's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def choose(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One token per row of `logits` [rows, vocab]."""
        if not self.do_sample:
            return logits.argmax(-1)
        scores = logits.astype(np.float64) / max(self.temperature, 1e-6)
        if 0 < self.top_k < scores.shape[-1]:
            kth = np.sort(scores, axis=-1)[:, -self.top_k][:, None]
            scores = np.where(scores < kth, -np.inf, scores)
        if self.top_p < 1.0:
            order = np.argsort(scores, axis=-1)  # ascending, as transformers' TopPLogitsWarper
            probabilities = _softmax(np.take_along_axis(scores, order, -1))
            removed = np.cumsum(probabilities, axis=-1) <= 1 - self.top_p
            removed[:, -1] = False  # keep at least one token
            np.put_along_axis(scores, order, np.where(removed, -np.inf, np.take_along_axis(scores, order, -1)), -1)
        probabilities = _softmax(scores)
        return np.array([rng.choice(len(row), p=row) for row in probabilities])


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    scores = logits.astype(np.float64)
    shifted = scores - scores.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
