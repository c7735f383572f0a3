"""The cpu target's backend, by measurement: ONNX Runtime (with the session settings that run the variant
fastest) or OpenVINO, which reads the same ONNX file, Q/DQ included. The faster one, by MIN_GAIN, is recorded in
the variant's record; the runtime runs it there, or falls back to ONNX Runtime saying why."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tensorsmith.compiler.variants.cpu_choice import MIN_GAIN, tuned
from tensorsmith.core.metrics import accuracy
from tensorsmith.core.progress import Reporter
from tensorsmith.core.sessions import cpu_session, latency_ms
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.backends import ONNX_RUNTIME, OPENVINO
from tensorsmith.runtime.errors import TensorsmithError
from tensorsmith.runtime.manifest import VariantRecord
from tensorsmith.runtime.specs import TensorSpec

logger = logging.getLogger(__name__)

MIN_COSINE = 0.9999  # OpenVINO's outputs against ONNX Runtime's on the timing batch, or it is not a candidate


class _BackendSession:
    """A runtime backend behind ONNX Runtime's `run(None, feeds)`, for `latency_ms`: its feeds checked on the first
    run only, as generation runs it."""

    def __init__(self, backend: Backend) -> None:
        self.outputs = backend.run_checked_once()  # {output name: values} of feeds

    def run(self, names: None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(self.outputs(feeds).values())


def choose_cpu_backend(
    record: VariantRecord,
    directory: Path,
    feeds: dict[str, np.ndarray],
    specs: tuple[list[TensorSpec], list[TensorSpec]],
    reporter: Reporter,
    session_tuned: bool,
    time_openvino: bool = True,
) -> VariantRecord:
    """`record` with its ONNX Runtime session settings chosen (unless `session_tuned` already) and the faster cpu
    backend recorded, with both latencies; `time_openvino=False`: ONNX Runtime's settings only (a graph OpenVINO
    cannot read)."""
    if not session_tuned:
        reporter.stage("cpu: timing ONNX Runtime's session settings")
        record = tuned(record, directory, feeds)
    from tensorsmith.runtime.openvino_backend import OpenVinoBackend, openvino_unavailable

    unavailable = openvino_unavailable() if time_openvino else "the static KV cache's TensorScatter has no OpenVINO op"
    if unavailable is not None:
        logger.info("cpu: OpenVINO not timed: %s", unavailable)
        return record
    reporter.stage("cpu: timing ONNX Runtime against OpenVINO")
    path = directory / record.path  # timed on the verification inputs, as the session settings are
    onnxruntime = cpu_session(path, record.onnxruntime_disabled_optimizers, config=record.onnxruntime_session_config)
    names = [output.name for output in onnxruntime.get_outputs()]
    expected = onnxruntime.run(None, feeds)
    try:
        with OpenVinoBackend(path, *specs) as openvino:
            timed = _BackendSession(openvino)
            actual = timed.outputs(feeds)
            agreement = accuracy(expected, [actual[name] for name in names])["cosine"]
            if agreement < MIN_COSINE:
                logger.info("cpu: OpenVINO's outputs differ from ONNX Runtime's (cosine %.6f): not chosen", agreement)
                return record
            sessions = {ONNX_RUNTIME.name: onnxruntime, OPENVINO.name: timed}
            measured = latency_ms(sessions, feeds)
    except TensorsmithError as err:  # an op or a kernel OpenVINO lacks (ONNX Runtime's contrib ops, say)
        logger.info("cpu: OpenVINO cannot run %s: %s", record.name, err)
        return record
    faster = measured[OPENVINO.name] < measured[ONNX_RUNTIME.name] * (1 - MIN_GAIN)
    chosen = OPENVINO if faster else ONNX_RUNTIME
    logger.info("cpu: %s ms per run by backend: %s", measured, chosen.name)
    return record.model_copy(update={"backend": chosen.name, "backend_latency_ms": measured})
