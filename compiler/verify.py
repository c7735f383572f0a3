"""Compare a compiled graph's outputs with the source model's, on ONNX Runtime (CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def run_onnx(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of the ONNX file at `path` on ONNX Runtime's CPU provider, in graph order."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = {value.name for value in session.get_inputs()}
    return list(session.run(None, {name: array for name, array in feeds.items() if name in names}))


def relative_error(reference: np.ndarray, actual: np.ndarray) -> float:
    """max |actual - reference| / max |reference|: the error relative to the output's scale."""
    reference = np.asarray(reference, dtype=np.float64)
    actual = np.asarray(actual, dtype=np.float64)
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    difference = float(np.max(np.abs(actual - reference))) if reference.size else 0.0
    return difference / scale if scale > 0 else difference


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
