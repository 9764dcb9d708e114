"""Accuracy, NLL, expected calibration error and Brier score of predicted probabilities."""

from __future__ import annotations

import numpy as np

__all__ = ["classification_metrics", "expected_calibration_error"]


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    """ECE with `n_bins` equal-width confidence bins (Guo et al. 2017): Σ_b |B_b|/N · |acc(B_b) − conf(B_b)|."""
    confidence = probs.max(-1)
    correct = probs.argmax(-1) == labels
    # bins are (lo, hi]; confidence 0 cannot occur for a probability vector
    bins = np.clip(np.ceil(confidence * n_bins).astype(int) - 1, 0, n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        in_bin = bins == b
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)


def classification_metrics(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> dict[str, float]:
    """accuracy, nll (mean −log p_y), ece (`n_bins` bins) and brier (mean Σ_k (p_k − 1[y=k])², as sklearn's multiclass Brier).

    Args:
        probs: (N, K) probabilities, rows summing to one.
        labels: (N,) integer class ids; entries equal to -100 (the HF ignore index) are skipped.
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    if probs.ndim != 2 or labels.shape != probs.shape[:1]:
        raise ValueError(f"Expected probs of shape (N, K) and labels of shape (N,), got {probs.shape} and {labels.shape}.")
    keep = labels != -100
    probs, labels = probs[keep], labels[keep]
    if len(labels) == 0:
        return {"accuracy": float("nan"), "nll": float("nan"), "ece": float("nan"), "brier": float("nan")}
    if labels.min() < 0 or labels.max() >= probs.shape[1]:
        raise ValueError(f"Labels must lie in [0, {probs.shape[1]}); got range [{labels.min()}, {labels.max()}].")
    rows = np.arange(len(labels))
    onehot = np.zeros_like(probs)
    onehot[rows, labels] = 1.0
    return {
        "accuracy": float((probs.argmax(-1) == labels).mean()),
        "nll": float(-np.log(np.clip(probs[rows, labels], 1e-300, None)).mean()),
        "ece": expected_calibration_error(probs, labels, n_bins),
        "brier": float(((probs - onehot) ** 2).sum(-1).mean()),
    }
