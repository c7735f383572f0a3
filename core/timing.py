"""ONNX Runtime CPU sessions for timing variants, and the median latency of several on the same feeds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tensorsmith.core.sessions import QUIET_SEVERITY, Runs, quiet_onnxruntime

if TYPE_CHECKING:
    import onnxruntime

LATENCY_RUNS = 7


def cpu_session(
    path: Path,
    disabled_optimizers: tuple[str, ...] | list[str] = (),
    threads: int = 0,
    profile: Path | None = None,
    config: dict[str, str] | None = None,
) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session for timing (and, with `profile`, ONNX Runtime's profiler writing files with
    that prefix). Its threads stop spinning after each run: idle spinning threads of one session otherwise take
    the cores from the next one measured (it doubled every figure on 2 cores)."""
    onnxruntime = quiet_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = QUIET_SEVERITY
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.force_spinning_stop", "1")
    for key, value in (config or {}).items():  # e.g. MatMulNBits' accuracy level
        options.add_session_config_entry(key, value)
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    return onnxruntime.InferenceSession(
        str(path), options, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled_optimizers)
    )


def latency_ms_in_turn(opened: dict[str, Callable[[], Runs]], feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """`latency_ms` of sessions over the same weights, each opened (by its callable), timed and dropped before the
    next opens: one session's memory at a time, and the next one's pages are the ones just freed (fresh pages cost
    up to 8 s a GB on a VM whose host reclaims free memory; two sessions at once took 0.5 and 5 s to open here)."""
    measured: dict[str, float] = {}
    for name, open_one in opened.items():
        measured.update(latency_ms({name: open_one()}, feeds))
    return measured


def latency_ms(sessions: dict[str, Runs], feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Median CPU latency of each session over a few runs, interleaved (after one warm-up each)."""
    for session in sessions.values():
        session.run(None, feeds)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(LATENCY_RUNS):
        for name, session in sessions.items():
            started = time.perf_counter()
            session.run(None, feeds)
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: round(statistics.median(values), 3) for name, values in times.items()}
