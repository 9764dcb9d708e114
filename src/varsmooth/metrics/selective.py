"""Selective prediction: risk–coverage curve and its area (AURC) for a confidence score (Geifman & El-Yaniv 2017,
"Selective Classification for Deep Neural Networks"; Geifman et al. 2019, "Bias-Reduced Uncertainty Estimation for
Deep Neural Classifiers", Eq. 2 and the E-AURC of §5).

The classifier answers the k most confident examples and abstains on the rest: coverage k/N, risk = the error rate on
the answered ones. Examples with the same confidence cannot be told apart by the score, so within a run of ties the
curve is the expectation over their order (the errors of the tied group spread evenly over it): the curve does not
depend on how a sort breaks ties, and a constant score has risk = the overall error rate at every coverage.
"""

from __future__ import annotations

import numpy as np

__all__ = ["aurc", "optimal_aurc", "risk_coverage_curve"]


def _inputs(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct)
    if confidence.ndim != 1 or correct.shape != confidence.shape:
        raise ValueError(f"Expected confidence and correct of the same shape (N,), got {confidence.shape} and "
                         f"{correct.shape}.")
    if correct.dtype != bool and not np.isin(correct, (0, 1)).all():
        raise ValueError("correct must be booleans (or 0/1): whether each prediction is right, e.g. probs.argmax(-1) "
                         "== labels.")
    if np.isnan(confidence).any():
        raise ValueError("confidence contains NaN: every example needs a score to be ranked by.")
    return confidence, correct.astype(bool)


def risk_coverage_curve(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coverage, risk), both of length N: coverage k/N for k = 1..N, risk the expected error rate on the k examples
    of highest confidence (higher confidence = answered first)."""
    confidence, correct = _inputs(confidence, correct)
    n = len(confidence)
    if n == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(-confidence, kind="stable")
    conf, errors = confidence[order], (~correct[order]).astype(np.float64)
    # tie groups: [start, end) of equal confidence in the sorted order
    starts = np.flatnonzero(np.r_[True, conf[1:] != conf[:-1]])
    ends = np.r_[starts[1:], n]
    group_errors = np.add.reduceat(errors, starts)
    before = np.r_[0.0, np.cumsum(group_errors)[:-1]]  # errors answered before each group
    k = np.arange(1, n + 1, dtype=np.float64)
    group = np.repeat(np.arange(len(starts)), ends - starts)
    expected_errors = before[group] + (k - starts[group]) * group_errors[group] / (ends - starts)[group]
    return k / n, expected_errors / k


def aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Area under the risk–coverage curve, (1/N) Σ_k risk(k/N); lower is better. A constant score gives the error
    rate, a perfect ranking (every error last) `optimal_aurc`."""
    _, risk = risk_coverage_curve(confidence, correct)
    return float(risk.mean()) if len(risk) else float("nan")


def optimal_aurc(correct: np.ndarray) -> float:
    """The AURC of a score that ranks every error below every correct prediction (Geifman et al. 2019, §5: E-AURC =
    AURC − this): only the last m = #errors of N are wrong, risk(k) = (k − N + m)/k for k > N − m."""
    correct = np.asarray(correct).astype(bool)
    n, m = len(correct), int((~correct).sum())
    if n == 0:
        return float("nan")
    k = np.arange(n - m + 1, n + 1, dtype=np.float64)
    return float(((k - (n - m)) / k).sum() / n)
