"""Calibration: observers, histograms, thresholds and scales (INT8/FP8). Filled in by the calibration work."""
