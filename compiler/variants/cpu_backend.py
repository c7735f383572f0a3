"""The cpu target's backend, by measurement: ONNX Runtime (with the session settings that run the variant
fastest) or OpenVINO, which reads the same ONNX file, Q/DQ included. The faster one, by MIN_GAIN, is recorded in
the variant's record; the runtime runs it there, or falls back to ONNX Runtime saying why."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tensorsmith.compiler.variants.cpu_choice import tuned
from tensorsmith.core.progress import Reporter
from tensorsmith.runtime.manifest import VariantRecord

logger = logging.getLogger(__name__)


def choose_cpu_backend(
    record: VariantRecord, directory: Path, feeds: dict[str, np.ndarray], reporter: Reporter, session_tuned: bool
) -> VariantRecord:
    """`record` with its ONNX Runtime session settings chosen (unless `session_tuned` already) and the faster cpu
    backend recorded."""
    if not session_tuned:
        reporter.stage("cpu: timing ONNX Runtime's session settings")
        record = tuned(record, directory, feeds)
    return record
