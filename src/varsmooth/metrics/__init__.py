"""Offline classification metrics (accuracy, NLL, ECE, Brier) as a function and as an `evaluate` module."""

from pathlib import Path

from .classification import classification_metrics, expected_calibration_error

CALIBRATION_METRIC_PATH = str(Path(__file__).parent / "calibration" / "calibration.py")

__all__ = ["CALIBRATION_METRIC_PATH", "classification_metrics", "expected_calibration_error"]
