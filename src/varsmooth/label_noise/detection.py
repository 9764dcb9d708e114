"""How well per-example scores from a trained posterior find the wrong labels, when they are known.

Every score is oriented so that *higher = more suspicious* and reported as it is, never flipped after looking at
the answer; an AUROC below 0.5 therefore means the score ranks wrong labels as *less* suspicious than right ones.

What to expect (benchmarks/mislabel_detection.py: scikit-learn digits with 20 % symmetric noise): the
posterior-predictive self-confidence is the detector — `one_minus_confidence` = 1 − P̂_y reaches AUROC ≈ 0.999 once
IVON has not memorised the noise. IVON's label noise is *not* a mislabel detector: its size follows how confidently
the posterior mean predicts (Variational Learning Induces Adaptive Label Smoothing (2025), Eq. 12), not the label,
and a confidently rejected wrong label has p̄_y ≈ 0 on the flat part of the softmax, so its `noise_at_label` |ε̄_y| is
tiny (AUROC ≈ 0.01–0.02 in that raw orientation) and ‖ε̄‖₁ is uninformative (≈ 0.5).
These scores are computed on the training data the model was fitted to (in-sample): say so when comparing them
with detectors fed out-of-sample (cross-validated) probabilities such as cleanlab's.

The AUROC is `varsmooth.metrics.auroc` (scikit-learn's, wrong labels as the positives) and the average precision is
scikit-learn's; precision at k is hand-written, since scikit-learn has no precision of the top k of a ranking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import datasets
import numpy as np
from sklearn.metrics import average_precision_score

from ..metrics.ood import auroc

__all__ = ["SUSPICION_SCORES", "detection_metrics", "mislabel_detection_report", "suspicion_scores"]

#: name -> how to compute it from the label-noise columns; higher = more likely a wrong label
SUSPICION_SCORES: dict[str, Callable[[Mapping[str, np.ndarray]], np.ndarray]] = {
    "one_minus_confidence": lambda c: 1.0 - c["confidence"],  # 1 − P̂_y, posterior-predictive
    "one_minus_mean_confidence": lambda c: 1.0 - c["mean_confidence"],  # 1 − p̄_y, at the posterior mean
    "noise_at_label": lambda c: c["noise_at_label"],  # |ε̄_y|, Eq. 15 of the paper above
    "noise_l1": lambda c: c["noise_l1"],  # ‖ε̄‖₁
    "noise_rms": lambda c: c["noise_rms"],  # RMS of the per-sample noise, Eq. 19
}
_NEEDED = ("confidence", "mean_confidence", "noise_at_label", "noise_l1", "noise_rms")


def suspicion_scores(noise: datasets.Dataset | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The scores of `SUSPICION_SCORES` for every row of a `compute_label_noise` result."""
    if isinstance(noise, datasets.Dataset):
        noise = noise.with_format("numpy", columns=list(_NEEDED))[:]
    columns = {name: np.asarray(noise[name], dtype=np.float64) for name in _NEEDED}
    return {name: score(columns) for name, score in SUSPICION_SCORES.items()}


def detection_metrics(scores: np.ndarray, is_corrupted: np.ndarray) -> dict[str, float]:
    """AUROC, average precision and precision at k = number of wrong labels (= recall at k) of one score.

    Ties at the k-th place are broken by dataset order (stable sort), so precision at k does not depend on chance.
    """
    scores = np.asarray(scores, dtype=np.float64)
    truth = np.asarray(is_corrupted, dtype=bool)
    if scores.ndim != 1 or scores.shape != truth.shape:
        raise ValueError(f"scores {scores.shape} and is_corrupted {truth.shape} must be 1-D arrays of the same length.")
    k = int(truth.sum())
    if not 0 < k < truth.size:
        raise ValueError(f"{k} of {truth.size} labels are marked wrong: detection metrics need both right and wrong "
                         "labels (`mislabel_detection_report` reports a note instead).")
    top = np.argsort(-scores, kind="stable")[:k]
    return {
        "auroc": auroc(scores[truth], scores[~truth]),
        "average_precision": float(average_precision_score(truth, scores)),
        "precision_at_k": float(truth[top].mean()),
    }


def mislabel_detection_report(
    noise: datasets.Dataset | Mapping[str, Any], is_corrupted: np.ndarray | None = None
) -> dict[str, Any]:
    """Detection metrics of every suspicion score against the known wrong labels.

    Args:
        noise: a `compute_label_noise` result (or its columns).
        is_corrupted: which given labels are wrong; default the `is_corrupted` column of `noise`.

    Returns `{"num_examples", "num_corrupted", "prevalence", "scores": {name: {auroc, average_precision,
    precision_at_k}}}`; `scores` is empty (with a `note`) when all labels are right or all are wrong.
    """
    if is_corrupted is None:
        if isinstance(noise, datasets.Dataset):
            if "is_corrupted" not in noise.column_names:
                raise ValueError("No `is_corrupted` column: pass `is_corrupted=` to say which labels are wrong.")
            is_corrupted = noise.with_format("numpy", columns=["is_corrupted"])[:]["is_corrupted"]
        else:
            is_corrupted = noise["is_corrupted"]
    truth = np.asarray(is_corrupted, dtype=bool)
    report: dict[str, Any] = {
        "num_examples": int(truth.size),
        "num_corrupted": int(truth.sum()),
        "prevalence": float(truth.mean()) if truth.size else 0.0,
        "scores": {},
    }
    if not 0 < truth.sum() < truth.size:
        report["note"] = "Detection metrics need both right and wrong labels."
        return report
    for name, score in suspicion_scores(noise).items():
        report["scores"][name] = detection_metrics(score, truth)
    return report
