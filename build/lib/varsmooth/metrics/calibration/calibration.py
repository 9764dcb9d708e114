"""`evaluate` module: accuracy, NLL, ECE and Brier score from predicted probabilities (works offline).

Load it with `evaluate.load(varsmooth.metrics.CALIBRATION_METRIC_PATH)`; `evaluate.load("accuracy")` would
need the Hub.
"""

import datasets
import evaluate
import numpy as np

from varsmooth.metrics.classification import classification_metrics

_DESCRIPTION = "Accuracy, negative log-likelihood, expected calibration error (equal-width bins) and Brier score."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of probability vectors (N, K), each summing to one.
    references: list of integer class ids (N,).
    n_bins: number of equal-width confidence bins of the ECE (default 15).
Returns:
    accuracy, nll, ece, brier.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Calibration(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("float64")), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, n_bins=15):
        return classification_metrics(np.asarray(predictions), np.asarray(references), n_bins=n_bins)
