"""Closed-form label noise of Bayesian logistic regression
(Variational Learning Induces Adaptive Label Smoothing (2025), Eq. 12 and Fig. 2).

For a logit with Gaussian posterior q(f) = N(m, v) the *expected* label noise that variational learning adds is

    ε(m, v) = σ(m) − E_{f~N(m, v)}[σ(f)]                                   (Eq. 12)

and one weight sample adds the *per-step* noise ε_s = σ(m) − σ(m + √v e), e ~ N(0, 1) (Eq. 13; Eq. 19 is its
network analogue). Both expectations are one-dimensional Gaussian integrals, computed here by Gauss–Hermite
quadrature: ∫ N(f; m, v) g(f) df = (1/√π) Σ_k w_k g(m + √(2v) x_k). With 64 nodes this is exact to ~1e-12
for the sigmoid, which is what the Monte Carlo estimates of `compute_label_noise` are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.polynomial.hermite import hermgauss
from scipy.optimize import minimize_scalar
from scipy.special import expit

__all__ = ["expected_sigmoid", "logistic_label_noise", "logistic_label_noise_rms", "logistic_label_noise_peak"]


def _gauss_hermite(m: np.ndarray | float, v: float, fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
                   num_nodes: int) -> np.ndarray:
    """E_{f~N(m, v)}[fn(m, f)] for every entry of `m`."""
    if v < 0:
        raise ValueError(f"The variance must be >= 0, got {v}.")
    nodes, weights = hermgauss(num_nodes)
    m = np.asarray(m, dtype=np.float64)
    f = m[..., None] + np.sqrt(2.0 * v) * nodes
    return (weights * fn(m[..., None], f)).sum(-1) / np.sqrt(np.pi)


def expected_sigmoid(m: np.ndarray | float, v: float = 1.0, num_nodes: int = 64) -> np.ndarray:
    """E_{f~N(m, v)}[σ(f)], the posterior-averaged probability of the positive class (the paper's Eq. 12)."""
    return _gauss_hermite(m, v, lambda _, f: expit(f), num_nodes)


def logistic_label_noise(m: np.ndarray | float, v: float = 1.0, num_nodes: int = 64) -> np.ndarray:
    """ε(m, v) = σ(m) − E_{N(m, v)}[σ(f)] (the paper's Eq. 12): odd in m, 0 at m = 0, peaks at |m| ≈ 1.53 for v = 1.

    This is the label noise of the positive class; for a 2-class softmax the noise vector is (−ε, ε).
    """
    return expit(np.asarray(m, dtype=np.float64)) - expected_sigmoid(m, v, num_nodes)


def logistic_label_noise_rms(m: np.ndarray | float, v: float = 1.0, num_nodes: int = 64) -> np.ndarray:
    """sqrt(E_e[(σ(m) − σ(m + √v e))²]): RMS of the per-step noise one weight sample adds (the paper's Eq. 13).

    Unlike the expected noise of Eq. 12 it is largest *at* m = 0 (0.2083 for v = 1). For a 2-class softmax the
    per-draw noise vector has Euclidean norm √2·|ε_s|, so `noise_rms` of `compute_label_noise` is √2 times this.
    """
    return np.sqrt(_gauss_hermite(m, v, lambda mean, f: np.square(expit(mean) - expit(f)), num_nodes))


def logistic_label_noise_peak(v: float = 1.0, num_nodes: int = 64) -> tuple[float, float]:
    """(m*, |ε|max): where the expected noise of Eq. 12 peaks for m > 0, and its height (v = 1: 1.529, 0.03906)."""
    if v <= 0:
        return 0.0, 0.0
    result = minimize_scalar(
        lambda m: -float(logistic_label_noise(m, v, num_nodes)), bounds=(1e-3, 4.0 + 4.0 * np.sqrt(v)),
        method="bounded", options={"xatol": 1e-6},
    )
    return float(result.x), float(-result.fun)
