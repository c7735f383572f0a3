"""`tensorsmith calibrate`: the calibration statistics of one shard of the data, as a step of its own.

    source ─▶ fused graph (as `compile` makes it) ─▶ shard I of N of the calibration samples ─▶ one pass ─▶ stats.npz

The statistics merge exactly (calibration/statistics.py), so shards collected on several machines and merged give
the scales one process gives, bit for bit; `compile --calibration-stats 'DIR/*.npz'` merges them and calibrates
without reading the data again. Each file names the sha256 of the fused graph it was collected on: statistics of
another graph (another source, opset or target list) are refused.

With `--ray [ADDRESS]` the shards run as Ray tasks: the driver makes the fused graph once and puts it in Ray's
object store; each task opens an ONNX Runtime session over it and collects one shard, returned as the same .npz
bytes a shard file holds; the driver merges them and writes one file. On a cluster the calibration data must be
at the same path on every node (a shared filesystem); locally, nothing is needed.
"""

from __future__ import annotations

import io
import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorsmith.calibration.data import CalibrationData
from tensorsmith.calibration.statistics import Statistics
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.fused import FusedGraph, fused_graph
from tensorsmith.compiler.frontend.source import Source, open_source
from tensorsmith.compiler.variants.calibrated import collect_statistics
from tensorsmith.compiler.variants.data import check_data
from tensorsmith.compiler.variants.text_data import check_text_data, decoder_calibration, is_decoder_graph
from tensorsmith.core.errors import CalibrationError, ConfigError
from tensorsmith.core.files import replace_file
from tensorsmith.core.importing import first_line
from tensorsmith.core.progress import LogReporter, Reporter, TimedReporter
from tensorsmith.core.sessions import quiet_onnxruntime
from tensorsmith.runtime.manifest import TensorRecord


@dataclass(frozen=True)
class CalibrateResult:
    out: Path
    graph_sha256: str
    samples: int
    tensors: int
    shard: tuple[int, int] | None
    seconds: float


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' → (I, N), 0 ≤ I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard '{text}' is not I/N", hint="e.g. --shard 0/4 for the first of four") from None
    if not 0 <= index < count:
        raise ConfigError(f"--shard {text}: I must be in 0..{count - 1}", hint="shards are numbered from 0")
    return index, count


def calibration_samples(config: CompileConfig, inputs: list[TensorRecord], reference: Path) -> CalibrationData:
    """The samples a compile with --calibration-stats stands for: all of --calibration (up to
    --calibration-samples); a decoder's as its prefill and decode steps."""
    assert config.calibration is not None, "checked by opened()"
    if is_decoder_graph(inputs):
        return decoder_calibration(config, inputs, reference)
    specs = [record.spec() for record in inputs]
    return CalibrationData(
        config.resolve(config.calibration), specs, config.calibration_batch_size, config.calibration_samples
    )


def shard_of(data: CalibrationData, shard: tuple[int, int] | None, total: int | None = None) -> CalibrationData:
    """Shard I of N: the I-th of N contiguous, nearly equal runs of the `total` samples (counted when not given)."""
    if shard is None:
        return data
    index, count = shard
    total = data.count() if total is None else total
    start, stop = total * index // count, total * (index + 1) // count
    if start == stop:
        raise CalibrationError(f"shard {index}/{count} of {total} samples is empty", hint="use fewer shards")
    return CalibrationData(data.source, data.inputs, data.batch_size, stop - start, data.skip + start)


def opened(config: CompileConfig) -> Source:
    """The source, its calibration data checked before the export (a wrong array or a missing tokenizer fails in
    a second, as for `compile`)."""
    if config.calibration is None:
        raise ConfigError("calibrate needs calibration data: --calibration PATH", hint="an .npz, a folder, or .txt")
    source = open_source(config.model_copy(update={"verify": False}))  # the fused graph is the same either way
    if source.is_decoder:
        check_text_data(source.config)
    elif source.config.inputs:
        check_data(source.config)
    return source


@contextmanager
def _fused_samples(config: CompileConfig, reporter: Reporter) -> Iterator[tuple[FusedGraph, CalibrationData]]:
    """The fused graph as `compile` makes it (in a scratch directory for as long as it is needed) and the
    calibration samples it stands for."""
    quiet_onnxruntime()
    source = opened(config)
    with tempfile.TemporaryDirectory(prefix="tensorsmith-calibrate-") as scratch:
        fused = fused_graph(source, Path(scratch), reporter)
        yield fused, calibration_samples(source.config, fused.inputs, fused.path)


def calibrate(
    config: CompileConfig, out: str | Path, shard: tuple[int, int] | None = None, reporter: Reporter | None = None
) -> CalibrateResult:
    """Write the statistics of `shard` of the calibration data, collected on the fused graph, to `out`."""
    started, out = time.perf_counter(), Path(out)
    timed = TimedReporter(reporter or LogReporter())
    with _fused_samples(config, timed) as (fused, data):
        statistics = collect_statistics(fused.model, shard_of(data, shard), timed)
    _write(statistics, fused.record.sha256, out)
    return CalibrateResult(
        out,
        fused.record.sha256,
        statistics.samples,
        len(statistics.tensors),
        shard,
        round(time.perf_counter() - started, 3),
    )


def _npz(statistics: Statistics, graph_sha256: str) -> bytes:
    """The statistics as the .npz bytes a statistics file holds."""
    buffer = io.BytesIO()
    statistics.save(buffer, graph_sha256)
    return buffer.getvalue()


def _write(statistics: Statistics, graph_sha256: str, out: Path) -> None:
    """The statistics file, written whole or not at all (a temporary file swapped into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_file(out, _npz(statistics, graph_sha256))


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray", hint="pip install 'tensorsmith[ray]'") from None
    return ray


def shard_statistics(model_bytes: bytes, shard: CalibrationData) -> bytes:
    """One Ray task: the statistics of one shard's samples on the graph, as .npz bytes."""
    import onnx

    quiet_onnxruntime()
    return _npz(collect_statistics(onnx.load_from_string(model_bytes), shard, LogReporter()), "")


def calibrate_on_ray(
    config: CompileConfig, out: str | Path, shards: int, address: str | None = None, reporter: Reporter | None = None
) -> CalibrateResult:
    """`shards` shard tasks on the Ray cluster at `address` (None: a local one on this machine's CPUs), merged
    into one statistics file at `out`."""
    ray = _import_ray()
    started, out = time.perf_counter(), Path(out)
    timed = TimedReporter(reporter or LogReporter())
    with _fused_samples(config, timed) as (fused, data):
        total = data.count()  # once, here: each task is handed its own run of the samples
        if shards > total:
            raise ConfigError(f"--shards {shards} for {total} calibration samples", hint=f"use at most {total}")
        if address is not None and is_decoder_graph(fused.inputs):
            raise ConfigError(
                "--ray ADDRESS for a decoder: its calibration feeds read the fused graph from this machine's disk",
                hint="use a local Ray (--ray), or --shard I/N jobs",
            )
        started_here = not ray.is_initialized()
        if started_here:
            timed.stage(f"starting Ray ({address or 'local'})")
            try:
                ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as err:  # no cluster there, or a bad address
                hint = "check the address (ray://HOST:PORT, or auto on a cluster node)"
                raise ConfigError(f"cannot reach the Ray cluster at {address}: {first_line(err)}", hint=hint) from err
        try:
            timed.stage(f"calibration statistics: {shards} shards as Ray tasks")
            task = ray.remote(shard_statistics)
            model = ray.put(fused.model.SerializeToString())
            parts = ray.get([task.remote(model, shard_of(data, (index, shards), total)) for index in range(shards)])
        finally:
            if started_here:
                ray.shutdown()
        merged: Statistics | None = None
        for part in parts:
            statistics, _ = Statistics.load(io.BytesIO(part))
            merged = statistics if merged is None else merged.merge(statistics)
        assert merged is not None
    _write(merged, fused.record.sha256, out)
    return CalibrateResult(
        out, fused.record.sha256, merged.samples, len(merged.tensors), None, round(time.perf_counter() - started, 3)
    )
