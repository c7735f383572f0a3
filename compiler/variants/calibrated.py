"""Calibration of the fused graph for quantized variants, from one pass over the data (or statistics collected
by `tensorsmith calibrate`, merged): per-tensor statistics, and per-channel ranges for SmoothQuant scaling and
the cpu recipe; then smoothing and per-tensor thresholds. Writes calibration.json, the TensorRT cache and the
histograms.

A smoothed activation x·(1/s) is a tensor of the smoothed graph that the pass never saw: its amax follows exactly
from x's per-channel ranges, and it is calibrated by that amax, as SmoothQuant calibrates smoothed activations
(static per-tensor absmax). Every other tensor keeps its values under smoothing, so its statistics stand.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.calibration import CalibrationData, CalibrationTable, Observer, build_table, tensors_to_observe
from tensorsmith.calibration.statistics import HISTOGRAMS_NAME, Statistics, save_histograms, smoothed_statistics
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.variants.rewrite import rewritten
from tensorsmith.core.precisions import precision as precision_of
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.passes.quantize import Precision
from tensorsmith.passes.smooth import SmoothActivations, smoothable_activations


@dataclass(frozen=True)
class Calibrated:
    model: onnx.ModelProto  # the graph the variants quantize: the fused graph, smoothed for int8 if asked
    table: CalibrationTable
    channel_amax: dict[str, np.ndarray]  # per-channel max |x| of the fused graph's weight-MatMul inputs
    smoothing: PassReport | None

    def scales(self, precision: Precision) -> dict[str, float]:
        return self.table.scales_in(precision_of(precision).element)


def channel_tensors(model: onnx.ModelProto) -> list[str]:
    """The activations whose per-channel ranges a compile may need: those read by weight MatMuls."""
    return list(smoothable_activations(gs.import_onnx(model)))


def collect_statistics(
    model: onnx.ModelProto, data: CalibrationData, reporter: Reporter, channels: Collection[str] | None = None
) -> Statistics:
    """One pass over `data`: what calibrating `model` needs (channels: every weight-MatMul input by default)."""
    tensors = tensors_to_observe(model)
    wanted = channel_tensors(model) if channels is None else list(channels)
    reporter.stage(f"calibration statistics: one pass over {len(tensors)} tensors")
    return Observer(model, [*tensors, *wanted]).collect(data, reporter, per_tensor=tensors, channels=wanted)


def calibrate_variants(
    fused: onnx.ModelProto,
    config: CompileConfig,
    statistics: Statistics,
    precisions: set[str],
    directory: Path,
    reporter: Reporter,
) -> Calibrated:
    """Thresholds for the quantized `precisions` the plan has, from `statistics` of the fused graph."""
    model, smoothing = fused, None
    if config.smoothing and any(precision_of(name).element.is_integer for name in precisions):
        reporter.stage("smoothing activation outliers into the weights (int8)")
        model, smoothing = _smooth(fused, statistics.channel_amax, config.smoothing_alpha)
    table = write_table(_statistics_of(model, statistics), config, directory)
    return Calibrated(model, table, statistics.channel_amax, smoothing)


def write_table(statistics: Statistics, config: CompileConfig, directory: Path) -> CalibrationTable:
    """Per-tensor thresholds by `config.calibrator`, written as calibration.json, TensorRT's calibration cache and
    the histograms (the report plots them)."""
    table = build_table(statistics.tensors, config.calibrator, samples=statistics.samples, percentile=config.percentile)
    table.write_json(directory / "calibration.json")
    (directory / "calibration").mkdir(exist_ok=True)
    table.write_tensorrt_cache(directory / "calibration" / "int8.cache", config.tensorrt_cache_version)
    save_histograms(statistics.tensors, directory / "calibration" / HISTOGRAMS_NAME)
    return table


def _statistics_of(model: onnx.ModelProto, statistics: Statistics) -> Statistics:
    """The statistics of the tensors `model` quantizes: as collected, or derived for a smoothed activation."""
    smoothed = {}
    for node in gs.import_onnx(model).nodes:
        scale = node.inputs[1] if node.op == "Mul" and len(node.inputs) == 2 else None
        if isinstance(scale, gs.Constant) and scale.name.endswith("/smooth_scale"):
            smoothed[node.outputs[0].name] = (node.inputs[0].name, np.asarray(scale.values))
    tensors = {}
    for name in tensors_to_observe(model):
        if name in statistics.tensors:
            tensors[name] = statistics.tensors[name]
        elif name in smoothed:
            source, inverse = smoothed[name]
            tensors[name] = smoothed_statistics(
                name, statistics.channel_amax[source], inverse, statistics.tensors[source]
            )
    return Statistics(tensors, statistics.channel_amax, statistics.samples)


def _smooth(model: onnx.ModelProto, amax: dict[str, np.ndarray], alpha: float) -> tuple[onnx.ModelProto, PassReport]:
    """The fused graph with SmoothQuant scaling (x/s, s·W): equal in fp32, kinder to per-tensor int8."""
    smoothed, (report,) = rewritten(model, [SmoothActivations(amax, alpha)])
    return smoothed, report
