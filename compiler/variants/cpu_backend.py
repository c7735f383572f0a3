"""The cpu target's backend, by measurement: every candidate variant on every cpu backend of the table
(runtime/backends.py) that runs it and agrees with ONNX Runtime on the timing batch. The fastest (variant,
backend) pair is recorded in the variant's record; a backend other than the default must beat the default's
fastest by MIN_GAIN. The runtime runs it there, or falls back to ONNX Runtime saying why."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tensorsmith.core.external_bytes import graph_bytes
from tensorsmith.core.metrics import accuracy
from tensorsmith.core.sessions import Runs
from tensorsmith.core.timing import cpu_session, latency_ms
from tensorsmith.runtime.backend import Backend
from tensorsmith.runtime.backends import ONNX_RUNTIME, OPENVINO
from tensorsmith.runtime.errors import TensorsmithError
from tensorsmith.runtime.manifest import VariantRecord
from tensorsmith.runtime.openvino_backend import OpenVinoBackend, openvino_unavailable
from tensorsmith.runtime.specs import Signature

logger = logging.getLogger(__name__)

MIN_GAIN = 0.05  # a non-default choice (session setting, backend) must be this much faster than the default
MIN_COSINE = 0.9999  # a backend's outputs against ONNX Runtime's on the timing batch, or it is not a candidate
TOGETHER_BYTES = 2 << 30  # candidates whose weights add up to less are timed interleaved; larger ones in turn

Times = dict[str, dict[str, float]]  # variant name → backend name → median ms on the timing batch


class _BackendSession:
    """A runtime backend behind ONNX Runtime's `run(None, feeds)`, for `latency_ms`: its feeds checked on the first
    run only, as generation runs it."""

    def __init__(self, backend: Backend) -> None:
        self.outputs = backend.run_checked_once()  # {output name: values} of feeds

    def run(self, names: Sequence[str] | None, feeds: dict[str, np.ndarray], /) -> list[np.ndarray]:
        return list(self.outputs(feeds).values())


def _openvino(
    path: Path, specs: Signature, feeds: dict[str, np.ndarray], expected: dict[str, np.ndarray]
) -> Runs | None:
    """OpenVINO's session over the variant at `path` where it runs it and agrees with ONNX Runtime, else None."""
    unavailable = openvino_unavailable()
    if unavailable is not None:
        logger.info("cpu: OpenVINO not timed: %s", unavailable)
        return None
    try:
        session = _BackendSession(OpenVinoBackend(path, specs.inputs, specs.outputs))
        actual = session.outputs(feeds)
    except TensorsmithError as err:  # an op or a kernel OpenVINO lacks (ONNX Runtime's contrib ops, say)
        logger.info("cpu: OpenVINO cannot run %s: %s", path.name, err)
        return None
    agreement = accuracy(list(expected.values()), [actual[name] for name in expected])["cosine"]
    if agreement < MIN_COSINE:
        logger.info("cpu: OpenVINO's outputs on %s differ from ONNX Runtime's (cosine %.6f)", path.name, agreement)
        return None
    return session


def _opened(record: VariantRecord, directory: Path, specs: Signature, feeds: dict, openvino: bool) -> dict[str, Runs]:
    """The variant's sessions by backend name: ONNX Runtime's with its recorded settings, and OpenVINO's where
    it is timed and qualifies."""
    path = directory / record.path
    onnxruntime = cpu_session(path, record.onnxruntime_disabled_optimizers, config=record.onnxruntime_session_config)
    sessions: dict[str, Runs] = {ONNX_RUNTIME.name: onnxruntime}
    if openvino:
        names = [output.name for output in onnxruntime.get_outputs()]
        expected = dict(zip(names, onnxruntime.run(None, feeds), strict=True))
        session = _openvino(path, specs, feeds, expected)
        if session is not None:
            sessions[OPENVINO.name] = session
    return sessions


def time_cpu_pairs(
    records: Sequence[VariantRecord],
    directory: Path,
    feeds: dict[str, np.ndarray],
    specs: Signature,
    time_openvino: bool = True,
) -> Times:
    """Every candidate's median latency on `feeds` on each cpu backend that runs it (OpenVINO where
    `time_openvino`: a graph it can read), all interleaved where their weights are small, else a variant at a time."""
    stored = sum(graph_bytes(directory / record.path) for record in records)
    times: Times = {}
    if stored < TOGETHER_BYTES:
        sessions = {
            f"{record.name}\0{backend}": session
            for record in records
            for backend, session in _opened(record, directory, specs, feeds, time_openvino).items()
        }
        for key, ms in latency_ms(sessions, feeds).items():
            variant, backend = key.split("\0")
            times.setdefault(variant, {})[backend] = ms
        return times
    for record in records:  # one variant's sessions open at a time
        sessions = _opened(record, directory, specs, feeds, time_openvino)
        times[record.name] = latency_ms(sessions, feeds)
        del sessions
    return times


def fastest_pair(times: Times) -> tuple[str, str]:
    """The fastest (variant, backend); one on a backend other than ONNX Runtime must beat ONNX Runtime's fastest
    by MIN_GAIN."""
    pairs = [(variant, backend) for variant, by_backend in times.items() for backend in by_backend]
    best = min(pairs, key=lambda pair: times[pair[0]][pair[1]])
    default = min((pair for pair in pairs if pair[1] == ONNX_RUNTIME.name), key=lambda pair: times[pair[0]][pair[1]])
    if best[1] != default[1] and times[best[0]][best[1]] > times[default[0]][default[1]] * (1 - MIN_GAIN):
        return default
    return best


def with_backend(record: VariantRecord, backend: str, times: Times) -> VariantRecord:
    """`record` with the backend chosen for it and its latency on each."""
    logger.info("cpu: %s ms per run by backend: %s runs %s", times.get(record.name, {}), backend, record.name)
    return record.model_copy(update={"backend": backend, "backend_latency_ms": times.get(record.name, {})})
