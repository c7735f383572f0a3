"""Accuracy of a variant against the fp32 reference: per-sample cosine and error relative to output scale."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tensorsmith.compiler.verify import relative_error


def mean_cosine(reference: np.ndarray, actual: np.ndarray) -> float:
    """Mean over samples (axis 0) of the cosine between each sample's flattened outputs."""
    a = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    b = np.asarray(actual, dtype=np.float64).reshape(len(actual), -1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosines = np.where(norms > 0, np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1.0), 1.0)
    return float(np.mean(cosines))


def accuracy(reference: Sequence[np.ndarray], actual: Sequence[np.ndarray]) -> dict[str, float]:
    """The worst output's figures: `cosine` (mean per-sample) and `max_relative_error`."""
    pairs = list(zip(reference, actual, strict=True))
    return {
        "cosine": min(mean_cosine(r, a) for r, a in pairs),
        "max_relative_error": max(relative_error(r, a) for r, a in pairs),
    }
