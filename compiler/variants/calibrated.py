"""Calibration of the fused graph for quantized variants: per-channel ranges (smoothing and the cpu recipe),
SmoothQuant scaling, then per-tensor thresholds; writes calibration.json, the TensorRT cache and histograms."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.calibration import CalibrationData, CalibrationTable, Observer, build_table, tensors_to_observe
from tensorsmith.calibration.statistics import HISTOGRAMS_NAME, save_histograms
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.variants.rewrite import rewritten
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.passes.quantize import Precision


@dataclass(frozen=True)
class Calibrated:
    model: onnx.ModelProto  # the graph the variants quantize: the fused graph, smoothed for int8 if asked
    table: CalibrationTable
    observer: Observer  # a session over `model` that returns the observed activations
    channel_amax: dict[str, np.ndarray]  # per-channel max |x| of the fused graph's weight-MatMul inputs
    smoothing: PassReport | None

    def scales(self, precision: Precision) -> dict[str, float]:
        return self.table.int8_scales() if precision == "int8" else self.table.fp8_scales()


def calibrate_variants(
    fused: onnx.ModelProto,
    config: CompileConfig,
    data: CalibrationData,
    precisions: set[str],
    directory: Path,
    reporter: Reporter,
) -> Calibrated:
    """Calibrate for the quantized `precisions` the plan has. Per-channel ranges come from one pass of their own:
    smoothing needs them, and so does the cpu recipe's dynamic-int8 graph (cpu.dynamic_source)."""
    channel_amax: dict[str, np.ndarray] = {}
    if "int8" in precisions and (config.smoothing or config.precision == "auto"):
        reporter.stage("measuring per-channel activation ranges (int8)")
        channel_amax = _channel_amax(fused, data, reporter)
    model, smoothing = fused, None
    if config.smoothing and "int8" in precisions:
        reporter.stage("smoothing activation outliers into the weights (int8)")
        model, smoothing = _smooth(fused, channel_amax, config.smoothing_alpha)
    observer = Observer(model, tensors_to_observe(model))
    table = calibrate_tensors(observer, config, data, directory, reporter)
    return Calibrated(model, table, observer, channel_amax, smoothing)


def calibrate_tensors(
    observer: Observer, config: CompileConfig, data: CalibrationData, directory: Path, reporter: Reporter
) -> CalibrationTable:
    """Per-tensor thresholds of the tensors `observer` returns, by `config.calibrator`; written as calibration.json,
    TensorRT's calibration cache and the histograms (the report plots them)."""
    reporter.stage(f"calibrating ({config.calibrator}) on {config.calibration}")
    statistics = observer.collect_histograms(data, observer.collect_ranges(data, reporter), reporter)
    table = build_table(statistics, config.calibrator, samples=observer.samples, percentile=config.percentile)
    table.write_json(directory / "calibration.json")
    (directory / "calibration").mkdir(exist_ok=True)
    table.write_tensorrt_cache(directory / "calibration" / "int8.cache", config.tensorrt_cache_version)
    save_histograms(statistics, directory / "calibration" / HISTOGRAMS_NAME)
    return table


def _channel_amax(model: onnx.ModelProto, data: CalibrationData, reporter: Reporter) -> dict[str, np.ndarray]:
    """max |x| per channel of every activation read by a weight MatMul (passes/smooth.py)."""
    from tensorsmith.passes.smooth import smoothable_activations

    activations = list(smoothable_activations(gs.import_onnx(model)))
    return Observer(model, activations).collect_channel_amax(data, reporter) if activations else {}


def _smooth(model: onnx.ModelProto, amax: dict[str, np.ndarray], alpha: float) -> tuple[onnx.ModelProto, PassReport]:
    """The fused graph with SmoothQuant scaling (x/s, s·W): equal in fp32, kinder to per-tensor int8."""
    from tensorsmith.passes.smooth import SmoothActivations

    smoothed, (report,) = rewritten(model, [SmoothActivations(amax, alpha)])
    return smoothed, report
