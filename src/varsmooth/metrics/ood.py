"""Out-of-distribution detection by a predictive's uncertainty: AUROC and FPR at 95 % TPR for the maximum
probability (Hendrycks & Gimpel 2017), the predictive entropy, the mutual information (epistemic part; Depeweg et al.
2018) and the energy (Liu et al. 2020, "Energy-based Out-of-distribution Detection", Eq. 6 at T = 1).

Every score is oriented as a confidence, higher = more in-distribution, and the in-distribution examples are the
positives (as Liu et al. 2020): AUROC = P(score_in > score_out) + ½ P(tie), 0.5 for a score that cannot tell the
two sets apart; FPR95 = the fraction of out-of-distribution examples still accepted at the highest threshold that
accepts at least 95 % of the in-distribution ones (lower is better).

Both come from scikit-learn: AUROC is `roc_auc_score`, FPR at a TPR is read off `roc_curve` (scikit-learn reports
the curve, not its FPR at a fixed TPR). Hand-written because no library computes them from a predictive: the scores
of `uncertainty_scores`, one formula each (the energy via SciPy's `logsumexp`). `label_noise.detection` ranks
suspicious labels with the same `auroc`.
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp
from sklearn.metrics import roc_auc_score, roc_curve

__all__ = ["OOD_SCORES", "auroc", "fpr_at_tpr", "ood_detection", "ood_metrics", "uncertainty_scores"]

#: the scores `ood_metrics` reports (each present only when its input is given)
OOD_SCORES = ("max_prob", "entropy", "mutual_information", "energy")


def _scores(name: str, values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of scores, got shape {values.shape}.")
    if np.isnan(values).any():
        raise ValueError(f"{name} contains NaN scores.")
    if np.isinf(values).any():  # scikit-learn's curves refuse them with a message that names neither set
        raise ValueError(f"{name} contains infinite scores: clip them to finite values that keep their order.")
    return values


def _labelled(scores_in: np.ndarray, scores_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels, scores) of both sets as scikit-learn takes them: in-distribution = the positive class."""
    scores_in, scores_out = _scores("scores_in", scores_in), _scores("scores_out", scores_out)
    return np.r_[np.ones(len(scores_in), bool), np.zeros(len(scores_out), bool)], np.r_[scores_in, scores_out]


def auroc(scores_in: np.ndarray, scores_out: np.ndarray) -> float:
    """P(score_in > score_out) + ½ P(tie) (the Mann–Whitney statistic), in-distribution = positive."""
    return float(roc_auc_score(*_labelled(scores_in, scores_out)))


def fpr_at_tpr(scores_in: np.ndarray, scores_out: np.ndarray, tpr: float = 0.95) -> float:
    """Fraction of `scores_out` ≥ t, for the largest threshold t with at least a fraction `tpr` of `scores_in` ≥ t."""
    if not 0 < tpr <= 1:
        raise ValueError(f"tpr must lie in (0, 1], got {tpr}.")
    # every distinct score stays a threshold: by default roc_curve drops the points inside straight segments of the
    # curve, and the first point reaching `tpr` can be one of them
    fprs, tprs, _ = roc_curve(*_labelled(scores_in, scores_out), drop_intermediate=False)
    # the curve's TPRs are k/N rounded once, so 19/20 equals 0.95; the margin absorbs a `tpr` that was itself computed
    return float(fprs[np.argmax(tprs >= tpr - 1e-12)])


def ood_detection(scores_in: np.ndarray, scores_out: np.ndarray) -> dict[str, float]:
    """{"auroc", "fpr95"} of a confidence score on in- and out-of-distribution examples."""
    return {"auroc": auroc(scores_in, scores_out), "fpr95": fpr_at_tpr(scores_in, scores_out, 0.95)}


def uncertainty_scores(probs: np.ndarray, logits: np.ndarray | None = None,
                       mutual_information: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Confidence scores (higher = more in-distribution) of a predictive: max_prob = max_k p_k, entropy = −H[p],
    mutual_information = −MI (given, e.g. `VariationalClassifierOutput.mutual_information`), energy = logsumexp_k z_k
    of the `logits` z (the negative energy). Pass the network's logits for the energy, not log-probabilities, whose
    logsumexp is 0 for every input: for a posterior or an ensemble, the logits at the posterior mean or the members'
    mean logsumexp."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape (N, K), got {probs.shape}.")
    scores = {"max_prob": probs.max(-1),
              "entropy": (probs * np.log(np.clip(probs, 1e-300, None))).sum(-1)}
    if mutual_information is not None:
        mi = np.asarray(mutual_information, dtype=np.float64)
        if mi.shape != probs.shape[:1]:
            raise ValueError(f"mutual_information must have shape ({len(probs)},), got {mi.shape}.")
        scores["mutual_information"] = -mi
    if logits is not None:
        logits = np.asarray(logits, dtype=np.float64)
        if logits.shape != probs.shape:
            raise ValueError(f"logits must have the shape of probs {probs.shape}, got {logits.shape}.")
        scores["energy"] = logsumexp(logits, axis=-1)
    return scores


def ood_metrics(probs_in: np.ndarray, probs_out: np.ndarray, *, logits_in: np.ndarray | None = None,
                logits_out: np.ndarray | None = None, mutual_information_in: np.ndarray | None = None,
                mutual_information_out: np.ndarray | None = None) -> dict[str, float]:
    """`ood_<score>_auroc` and `ood_<score>_fpr95` for every score of `uncertainty_scores` whose inputs are given for
    both sets (max_prob and entropy always; mutual_information and energy when given)."""
    if ((logits_in is None) != (logits_out is None)
            or (mutual_information_in is None) != (mutual_information_out is None)):
        raise ValueError("Give logits (and mutual_information) for both the in- and the out-of-distribution set, or "
                         "for neither.")
    inside = uncertainty_scores(probs_in, logits_in, mutual_information_in)
    outside = uncertainty_scores(probs_out, logits_out, mutual_information_out)
    metrics = {}
    for name in OOD_SCORES:
        if name in inside:
            for key, value in ood_detection(inside[name], outside[name]).items():
                metrics[f"ood_{name}_{key}"] = value
    return metrics
