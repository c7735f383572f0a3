"""Calibration: observers, histograms, thresholds and scales for INT8 and FP8 (REFERENCE.md §1–5)."""

from tensorsmith.calibration.calibrate import calibrate, tensors_to_observe
from tensorsmith.calibration.data import CalibrationData
from tensorsmith.calibration.observer import Observer
from tensorsmith.calibration.statistics import TensorStatistics
from tensorsmith.calibration.table import CalibrationTable, Method, build_table

__all__ = [
    "CalibrationData",
    "CalibrationTable",
    "Method",
    "Observer",
    "TensorStatistics",
    "build_table",
    "calibrate",
    "tensors_to_observe",
]
