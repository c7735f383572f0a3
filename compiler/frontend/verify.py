"""Compare a compiled graph's outputs with the source model's, on ONNX Runtime (CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tensorsmith.core.metrics import relative_error


@dataclass(frozen=True)
class VerifiedRun:
    """The verification feeds and the fused graph's outputs for them: what the float variants are measured against
    without a second fp32 session, kept by the export cache with the graph."""

    feeds: dict[str, np.ndarray]
    outputs: list[np.ndarray]


@dataclass(frozen=True)
class SourceRun:
    """Verification's feeds and the source's outputs for them; `tuned`: whether the feeds are at the sizes the
    engines are tuned for (an ONNX source that fails there is verified at small ones)."""

    feeds: dict[str, np.ndarray]
    outputs: list[np.ndarray]
    tuned: bool


def compare_outputs(
    names: Sequence[str], reference: Sequence[np.ndarray], actual: Sequence[np.ndarray]
) -> dict[str, float]:
    """Per-output relative error (see `relative_error`); shapes must agree."""
    if len(reference) != len(actual):
        raise ValueError(f"the source has {len(reference)} outputs, the compiled graph {len(actual)}")
    errors = {}
    for name, expected, got in zip(names, reference, actual, strict=True):
        if np.shape(expected) != np.shape(got):
            raise ValueError(f"output '{name}' has shape {np.shape(got)}, the source gives {np.shape(expected)}")
        errors[name] = relative_error(expected, got)
    return errors
