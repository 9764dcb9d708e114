"""Accuracy, NLL, calibration errors (equal-width, adaptive, classwise), reliability-diagram data and Brier score."""

from __future__ import annotations

import numpy as np

from .selective import aurc

__all__ = ["adaptive_calibration_error", "classification_metrics", "classwise_calibration_error",
           "expected_calibration_error", "reliability_diagram"]


def _check(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    if probs.ndim != 2 or labels.shape != probs.shape[:1]:
        raise ValueError(f"Expected probs of shape (N, K) and labels of shape (N,), got {probs.shape} and "
                         f"{labels.shape}.")
    keep = labels != -100
    probs, labels = probs[keep], labels[keep]
    if len(labels) and (labels.min() < 0 or labels.max() >= probs.shape[1]):
        raise ValueError(f"Labels must lie in [0, {probs.shape[1]}); got range [{labels.min()}, {labels.max()}].")
    return probs, labels


def _check_bins(n_bins: int) -> None:
    if int(n_bins) != n_bins or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}.")


def _equal_width_bins(values: np.ndarray, n_bins: int) -> np.ndarray:
    # bins are (lo, hi]; the first also holds 0 (a class probability can be 0, a top-label confidence cannot)
    return np.clip(np.ceil(values * n_bins).astype(int) - 1, 0, n_bins - 1)


def reliability_diagram(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15,
                        adaptive: bool = False) -> dict[str, np.ndarray]:
    """Per-bin data of a reliability diagram (DeGroot & Fienberg 1983; Guo et al. 2017, Fig. 1) of the top-label
    confidence max_k p_k.

    Bins are `n_bins` equal-width intervals (lo, hi] of [0, 1], or with `adaptive=True` equal-mass bins: the examples
    sorted by confidence and cut into `n_bins` groups of equal size (± 1; tied confidences may fall into two
    neighbouring groups). Returns `edges` (n_bins + 1; for adaptive bins the smallest and largest confidence of each
    group, so edges[b] ≤ conf ≤ edges[b+1] within bin b), and per bin `confidence` (mean confidence), `accuracy`
    (fraction of correct top-label predictions), both NaN for an empty bin, and `count`. Labels equal to -100 are
    skipped.
    """
    _check_bins(n_bins)
    probs, labels = _check(probs, labels)
    confidence = probs.max(-1)
    correct = (probs.argmax(-1) == labels).astype(np.float64)
    if adaptive:
        order = np.argsort(confidence, kind="stable")
        groups = np.array_split(order, n_bins)
        bins = np.empty(len(confidence), dtype=int)
        for b, members in enumerate(groups):
            bins[members] = b
        edges = np.array([confidence[g].min() if len(g) else np.nan for g in groups]
                         + [confidence[groups[-1]].max() if len(groups[-1]) else np.nan])
    else:
        bins = _equal_width_bins(confidence, n_bins)
        edges = np.linspace(0.0, 1.0, n_bins + 1)
    count = np.bincount(bins, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(bins, weights=confidence, minlength=n_bins) / count
        accuracy = np.bincount(bins, weights=correct, minlength=n_bins) / count
    return {"edges": edges, "confidence": mean_conf, "accuracy": accuracy, "count": count}


def _calibration_gap(diagram: dict[str, np.ndarray]) -> float:
    count = diagram["count"]
    if count.sum() == 0:
        return float("nan")
    filled = count > 0
    return float((count[filled] * np.abs(diagram["accuracy"][filled] - diagram["confidence"][filled])).sum()
                 / count.sum())


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    """ECE with `n_bins` equal-width confidence bins (Guo et al. 2017): Σ_b |B_b|/N · |acc(B_b) − conf(B_b)|."""
    return _calibration_gap(reliability_diagram(probs, labels, n_bins))


def adaptive_calibration_error(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    """ECE over `n_bins` equal-mass confidence bins (Nguyen & O'Connor 2015; Nixon et al. 2019, "Measuring
    Calibration in Deep Learning"): every bin holds N/n_bins examples, so no bin is estimated from a handful of
    examples — with a confident model, equal-width bins leave nearly all examples in the top bin."""
    return _calibration_gap(reliability_diagram(probs, labels, n_bins, adaptive=True))


def classwise_calibration_error(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    """Classwise ECE (Kull et al. 2019, "Beyond temperature scaling", §3): the calibration error of every class
    probability p_k, not only of the top one, averaged over the K classes:
    (1/K) Σ_k Σ_b |B_kb|/N · |freq(y = k | B_kb) − mean p_k over B_kb|, with `n_bins` equal-width bins of p_k."""
    _check_bins(n_bins)
    probs, labels = _check(probs, labels)
    n, num_classes = probs.shape
    if n == 0:
        return float("nan")
    total = 0.0
    for k in range(num_classes):
        bins = _equal_width_bins(probs[:, k], n_bins)
        prob_sum = np.bincount(bins, weights=probs[:, k], minlength=n_bins)
        hit_sum = np.bincount(bins, weights=(labels == k).astype(np.float64), minlength=n_bins)
        total += np.abs(hit_sum - prob_sum).sum() / n  # |B|·|freq − conf| = |Σ hits − Σ p| per bin
    return float(total / num_classes)


def classification_metrics(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> dict[str, float]:
    """accuracy, nll (mean −log p_y), ece (`n_bins` equal-width bins), adaptive_ece (`n_bins` equal-mass bins),
    classwise_ece, brier (mean Σ_k (p_k − 1[y=k])², as sklearn's multiclass Brier) and aurc (area under the
    risk–coverage curve when abstaining by the maximum probability, `varsmooth.metrics.selective`).

    Args:
        probs: (N, K) probabilities, rows summing to one.
        labels: (N,) integer class ids; entries equal to -100 (the HF ignore index) are skipped.
    """
    probs, labels = _check(probs, labels)
    names = ("accuracy", "nll", "ece", "adaptive_ece", "classwise_ece", "brier", "aurc")
    if len(labels) == 0:
        return dict.fromkeys(names, float("nan"))
    rows = np.arange(len(labels))
    onehot = np.zeros_like(probs)
    onehot[rows, labels] = 1.0
    return {
        "accuracy": float((probs.argmax(-1) == labels).mean()),
        "nll": float(-np.log(np.clip(probs[rows, labels], 1e-300, None)).mean()),
        "ece": expected_calibration_error(probs, labels, n_bins),
        "adaptive_ece": adaptive_calibration_error(probs, labels, n_bins),
        "classwise_ece": classwise_calibration_error(probs, labels, n_bins),
        "brier": float(((probs - onehot) ** 2).sum(-1).mean()),
        "aurc": aurc(probs.max(-1), probs.argmax(-1) == labels),
    }
