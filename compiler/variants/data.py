"""Calibration and evaluation data for quantized variants: never the same samples in both."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensorsmith.calibration import CalibrationData
from tensorsmith.calibration.data import Feeds
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.runtime.manifest import TensorRecord
from tensorsmith.runtime.specs import TensorSpec

HELD_OUT_FRACTION = 4  # without --eval-data, the last quarter of the calibration samples is held out
READ_BATCH = 256  # samples per read when data is loaded whole


@dataclass(frozen=True)
class SplitData:
    calibration: CalibrationData | None  # None: calibration statistics stand in for the data (--calibration-stats)
    evaluation: Feeds
    evaluated_on: str  # what the evaluation is, for the manifest and precision.json
    tokens: np.ndarray | None = None  # a decoder's evaluation windows (the feeds are their prefill)


def concatenated(data: CalibrationData) -> Feeds:
    batches = list(data.batches())
    return {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]}


def split_data(config: CompileConfig, inputs: list[TensorRecord]) -> SplitData:
    """The calibration samples and the evaluation feeds for the fused graph's `inputs`."""
    specs = [record.spec() for record in inputs]
    if config.evaluation is not None:
        evaluation = config.resolve(config.evaluation)
        feeds = concatenated(CalibrationData(evaluation, specs, batch_size=READ_BATCH))
        data = None
        if config.calibration is not None:
            data = CalibrationData(
                config.resolve(config.calibration), specs, config.calibration_batch_size, config.calibration_samples
            )
        return SplitData(data, feeds, str(evaluation))
    assert config.calibration is not None, "checked with the config: --calibration-stats needs --eval-data"
    source = config.resolve(config.calibration)
    total = CalibrationData(source, specs, batch_size=READ_BATCH).count()
    if config.calibration_samples is not None:
        total = min(total, config.calibration_samples)
    held = max(1, total // HELD_OUT_FRACTION)
    if total - held < 1:
        data = CalibrationData(source, specs, config.calibration_batch_size, total)
        feeds = concatenated(CalibrationData(source, specs, batch_size=READ_BATCH, limit=total))
        return SplitData(data, feeds, f"the {total} calibration samples (too few to hold any out)")
    data = CalibrationData(source, specs, config.calibration_batch_size, limit=total - held)
    feeds = concatenated(CalibrationData(source, specs, batch_size=READ_BATCH, limit=held, skip=total - held))
    return SplitData(data, feeds, f"{held} calibration samples held out of calibration (the last of {total})")


def check_data(config: CompileConfig) -> None:
    """Check the calibration and evaluation data against the declared inputs before any slow work (export),
    so a wrong array name or dtype fails in a second, not after minutes."""
    specs = [TensorSpec(decl.name, decl.dtype, tuple(decl.dims)) for decl in config.inputs]
    for path in (config.calibration, config.evaluation):
        if path is not None:
            CalibrationData(config.resolve(path), specs, batch_size=READ_BATCH).count()
