"""`tensorsmith calibrate --ray [ADDRESS]`: the shards of one calibration as Ray tasks, merged by the driver.

The driver makes the fused graph once and puts it in Ray's object store; each task opens an ONNX Runtime session
over it and collects one shard's statistics (compiler/calibrate.py), returned as the same .npz bytes a shard file
holds; the driver merges them (exactly: calibration/statistics.py) and writes one file. On a cluster, the
calibration data must be at the same path on every node (a shared filesystem); locally, nothing is needed.
"""

from __future__ import annotations

import io
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from tensorsmith.calibration.data import CalibrationData
from tensorsmith.calibration.statistics import Statistics
from tensorsmith.compiler.calibrate import CalibrateResult, calibration_samples, shard_of
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.fused import fused_graph
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.files import replace_file
from tensorsmith.core.progress import LogReporter, Reporter, TimedReporter
from tensorsmith.core.sessions import quiet_onnxruntime

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray", hint="pip install 'tensorsmith[ray]'") from None
    return ray


def shard_statistics(model_bytes: bytes, data: CalibrationData, shard: tuple[int, int]) -> bytes:
    """One Ray task: the statistics of `shard` of `data` on the graph, as .npz bytes."""
    import onnx

    from tensorsmith.compiler.variants.calibrated import collect_statistics

    quiet_onnxruntime()
    model = onnx.load_from_string(model_bytes)
    statistics = collect_statistics(model, shard_of(data, shard), LogReporter())
    buffer = io.BytesIO()
    statistics.save(buffer, "")
    return buffer.getvalue()


def calibrate_on_ray(
    config: CompileConfig, out: str | Path, shards: int, address: str | None = None, reporter: Reporter | None = None
) -> CalibrateResult:
    """`shards` shard tasks on the Ray cluster at `address` (None: a local one on this machine's CPUs), merged
    into one statistics file at `out`."""
    ray = _import_ray()
    started = time.perf_counter()
    out = Path(out)
    timed = TimedReporter(reporter or LogReporter())
    quiet_onnxruntime()
    source = open_source(config.model_copy(update={"verify": False}))
    with tempfile.TemporaryDirectory(prefix="tensorsmith-calibrate-") as scratch:
        fused = fused_graph(source, Path(scratch), timed)
        data = calibration_samples(source.config, fused.inputs, fused.path)
        started_here = not ray.is_initialized()
        if started_here:
            timed.stage(f"starting Ray ({address or 'local'})")
            ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        try:
            timed.stage(f"calibration statistics: {shards} shards as Ray tasks")
            task = ray.remote(shard_statistics)
            model = ray.put(fused.model.SerializeToString())
            parts = ray.get([task.remote(model, data, (index, shards)) for index in range(shards)])
        finally:
            if started_here:
                ray.shutdown()
        merged: Statistics | None = None
        for part in parts:
            statistics, _ = Statistics.load(io.BytesIO(part))
            merged = statistics if merged is None else merged.merge(statistics)
        assert merged is not None
        written = Path(scratch) / "statistics.npz"
        merged.save(written, fused.record.sha256)
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_file(out, written.read_bytes())
    return CalibrateResult(out, fused.record.sha256, merged.samples, len(merged.tensors), None,
                           round(time.perf_counter() - started, 3))  # fmt: skip
