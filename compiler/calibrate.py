"""`tensorsmith calibrate`: the calibration statistics of one shard of the data, as a step of its own.

    source ─▶ fused graph (as `compile` makes it) ─▶ shard I of N of the calibration samples ─▶ one pass ─▶ stats.npz

The statistics merge exactly (calibration/statistics.py), so shards collected on several machines (or as Ray
tasks) and merged give the scales one process gives, bit for bit; `compile --calibration-stats 'DIR/*.npz'`
merges them and calibrates without reading the data again. Each file names the sha256 of the fused graph it was
collected on: statistics of another graph (another source, opset or target list) are refused.
"""

from __future__ import annotations

import glob
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.calibration.data import CalibrationData
from tensorsmith.calibration.statistics import Statistics
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.fused import fused_graph
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.compiler.variants.calibrated import collect_statistics
from tensorsmith.compiler.variants.text_data import decoder_calibration, is_decoder_graph
from tensorsmith.core.errors import CalibrationError, ConfigError
from tensorsmith.core.files import replace_file
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
    if config.calibration is None:
        raise ConfigError("calibrate needs calibration data: --calibration PATH", hint="an .npz, a folder, or .txt")
    if is_decoder_graph(inputs):
        return decoder_calibration(config, inputs, reference)
    specs = [record.spec() for record in inputs]
    return CalibrationData(config.resolve(config.calibration), specs, config.calibration_batch_size,
                           config.calibration_samples)  # fmt: skip


def shard_of(data: CalibrationData, shard: tuple[int, int] | None) -> CalibrationData:
    """Shard I of N: the I-th of N contiguous, nearly equal runs of the samples."""
    if shard is None:
        return data
    index, count = shard
    total = data.count()
    start, stop = total * index // count, total * (index + 1) // count
    if start == stop:
        raise CalibrationError(f"shard {index}/{count} of {total} samples is empty", hint="use fewer shards")
    return CalibrationData(data.source, data.inputs, data.batch_size, stop - start, data.skip + start)


def calibrate(
    config: CompileConfig, out: str | Path, shard: tuple[int, int] | None = None, reporter: Reporter | None = None
) -> CalibrateResult:
    """Write the statistics of `shard` of the calibration data, collected on the fused graph, to `out`."""
    started = time.perf_counter()
    out = Path(out)
    timed = TimedReporter(reporter or LogReporter())
    quiet_onnxruntime()
    source = open_source(config.model_copy(update={"verify": False}))  # the fused graph is the same either way
    with tempfile.TemporaryDirectory(prefix="tensorsmith-calibrate-") as scratch:
        fused = fused_graph(source, Path(scratch), timed)
        data = shard_of(calibration_samples(source.config, fused.inputs, fused.path), shard)
        statistics = collect_statistics(fused.model, data, timed)
        written = Path(scratch) / "statistics.npz"
        statistics.save(written, fused.record.sha256)
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_file(out, written.read_bytes())
    return CalibrateResult(out, fused.record.sha256, statistics.samples, len(statistics.tensors), shard,
                           round(time.perf_counter() - started, 3))  # fmt: skip


def merged_statistics(pattern: str, graph_sha256: str, base: Path) -> Statistics:
    """The statistics files `pattern` (a glob, relative to `base`) matches, merged, after checking each was
    collected on this graph."""
    paths = sorted(Path(path) for path in glob.glob(pattern if Path(pattern).is_absolute() else str(base / pattern)))
    if not paths:
        raise ConfigError(f"--calibration-stats '{pattern}' matches no file",
                          hint="write them with tensorsmith calibrate")  # fmt: skip
    merged: Statistics | None = None
    for path in paths:
        statistics, collected_on = Statistics.load(path)
        if collected_on != graph_sha256:
            raise CalibrationError(
                f"{path} was collected on another graph (sha256 {collected_on[:12]}…, this compile's fused graph is "
                f"{graph_sha256[:12]}…)",
                hint="run tensorsmith calibrate with the same source, opset and targets as the compile",
            )
        merged = statistics if merged is None else merged.merge(statistics)
    assert merged is not None
    return merged
