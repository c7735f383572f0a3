"""Quantized variants: calibrate the fused fp32 graph, insert Q/DQ, and measure the result against fp32."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.calibration import CalibrationData, CalibrationTable, calibrate
from tensorsmith.calibration.data import Feeds
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.ir import save_onnx
from tensorsmith.compiler.metrics import accuracy
from tensorsmith.compiler.progress import Reporter
from tensorsmith.compiler.verify import run_onnx
from tensorsmith.passes import PassReport, run_passes
from tensorsmith.passes.quantize import InsertQDQ
from tensorsmith.runtime.manifest import TensorRecord, VariantRecord, sha256_of

logger = logging.getLogger(__name__)

EVALUATION_FALLBACK_SAMPLES = 32


@dataclass
class QuantizedVariant:
    record: VariantRecord
    report: PassReport
    table: CalibrationTable


def evaluation_feeds(config: CompileConfig, inputs: list[TensorRecord]) -> tuple[Feeds, str]:
    """Held-out data when given (`evaluation`), else the first calibration samples (said so in the record)."""
    specs = [record.spec() for record in inputs]
    if config.evaluation is not None:
        source, limit = config.resolve(config.evaluation), None
        label = str(source)
    else:
        assert config.calibration is not None
        source, limit = config.resolve(config.calibration), EVALUATION_FALLBACK_SAMPLES
        label = f"first {EVALUATION_FALLBACK_SAMPLES} calibration samples (no evaluation data given)"
    batches = list(CalibrationData(source, specs, batch_size=EVALUATION_FALLBACK_SAMPLES, limit=limit).batches())
    feeds = {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]}
    return feeds, label


def build_quantized_variant(
    model: onnx.ModelProto,
    config: CompileConfig,
    inputs: list[TensorRecord],
    reference_path: Path,
    directory: Path,
    reporter: Reporter,
) -> QuantizedVariant:
    """Write `variants/<precision>.onnx`, `calibration.json` and `calibration/int8.cache` under `directory`."""
    assert config.precision in ("int8", "fp8") and config.calibration is not None
    precision = config.precision
    data = CalibrationData(
        config.resolve(config.calibration),
        [record.spec() for record in inputs],
        batch_size=config.calibration_batch_size,
        limit=config.calibration_samples,
    )
    reporter.stage(f"calibrating ({config.calibrator}) on {config.calibration}")
    table = calibrate(model, data, config.calibrator, config.percentile, reporter=reporter)
    table.write_json(directory / "calibration.json")
    (directory / "calibration").mkdir(exist_ok=True)
    table.write_tensorrt_cache(directory / "calibration" / "int8.cache", config.tensorrt_cache_version)

    reporter.stage(f"inserting {precision} Q/DQ")
    graph = gs.import_onnx(model)
    scales = table.int8_scales() if precision == "int8" else table.fp8_scales()
    (report,) = run_passes(graph, [InsertQDQ(precision, scales)])
    relative = Path("variants") / f"{precision}.onnx"
    (directory / "variants").mkdir(exist_ok=True)
    save_onnx(gs.export_onnx(graph), directory / relative)

    reporter.stage(f"measuring the {precision} variant against fp32")
    feeds, label = evaluation_feeds(config, inputs)
    measured = accuracy(run_onnx(reference_path, feeds), run_onnx(directory / relative, feeds))
    logger.info("%s variant: %s on %s", precision, measured, label)
    record = VariantRecord(
        name=precision,
        path=str(relative),
        sha256=sha256_of(directory / relative),
        precisions=[precision, "fp32"],
        accuracy=measured,
        evaluated_on=label,
    )
    return QuantizedVariant(record, report, table)
