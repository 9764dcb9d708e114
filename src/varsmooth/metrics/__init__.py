"""Offline classification and uncertainty metrics as functions, and the calibration metric as an `evaluate` module.

Every function takes NumPy arrays (probabilities (N, K), labels (N,)) and returns floats or arrays, so it can be
called from a `compute_metrics(eval_pred)` given to `VariationalTrainer`, whose `eval_pred.predictions` are the log
of the predicted probabilities::

    from varsmooth.metrics import aurc, classwise_calibration_error

    def compute_metrics(eval_pred):  # VariationalTrainer(..., compute_metrics=compute_metrics)
        probs, labels = np.exp(eval_pred.predictions), eval_pred.label_ids
        return {"aurc": aurc(probs.max(-1), probs.argmax(-1) == labels),
                "classwise_ece": classwise_calibration_error(probs, labels, n_bins=10)}

(`evaluate()` already reports accuracy, nll, ece, adaptive_ece, classwise_ece, brier and aurc.) OOD detection needs a
second dataset: `varsmooth.evaluation.ood_evaluation(trainer, test_dataset, ood_dataset)`, or `ood_metrics` on arrays.
"""

from pathlib import Path

from .classification import (
                             adaptive_calibration_error,
                             classification_metrics,
                             classwise_calibration_error,
                             expected_calibration_error,
                             reliability_diagram,
)
from .ood import OOD_SCORES, auroc, fpr_at_tpr, ood_detection, ood_metrics, uncertainty_scores
from .selective import aurc, optimal_aurc, risk_coverage_curve

#: the path of the calibration metric as an `evaluate` module: `evaluate.load(CALIBRATION_METRIC_PATH)`
CALIBRATION_METRIC_PATH = str(Path(__file__).parent / "calibration" / "calibration.py")

__all__ = ["CALIBRATION_METRIC_PATH", "OOD_SCORES", "adaptive_calibration_error", "aurc", "auroc",
           "classification_metrics", "classwise_calibration_error", "expected_calibration_error", "fpr_at_tpr",
           "ood_detection", "ood_metrics", "optimal_aurc", "reliability_diagram", "risk_coverage_curve",
           "uncertainty_scores"]
