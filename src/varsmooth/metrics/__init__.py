"""Offline classification and uncertainty metrics as functions, and the calibration metric as an `evaluate` module.

Every function takes NumPy arrays (probabilities (N, K), labels (N,)) and returns floats or arrays, so it can be
called from a `compute_metrics(eval_pred)` given to `VariationalTrainer`, whose `eval_pred.predictions` are the log
of the predicted probabilities: `probs = np.exp(eval_pred.predictions)`, `labels = eval_pred.label_ids`.
"""

from pathlib import Path

from .classification import (adaptive_calibration_error, classification_metrics, classwise_calibration_error,
                             expected_calibration_error, reliability_diagram)
from .ood import OOD_SCORES, auroc, fpr_at_tpr, ood_detection, ood_metrics, uncertainty_scores
from .samples import DEFAULT_SAMPLE_COUNTS, posterior_samples_curve
from .selective import aurc, optimal_aurc, risk_coverage_curve

CALIBRATION_METRIC_PATH = str(Path(__file__).parent / "calibration" / "calibration.py")

__all__ = ["CALIBRATION_METRIC_PATH", "DEFAULT_SAMPLE_COUNTS", "OOD_SCORES", "adaptive_calibration_error", "aurc", "auroc", "classification_metrics",
           "classwise_calibration_error", "expected_calibration_error", "fpr_at_tpr", "ood_detection", "ood_metrics",
           "optimal_aurc", "posterior_samples_curve", "reliability_diagram", "risk_coverage_curve", "uncertainty_scores"]
