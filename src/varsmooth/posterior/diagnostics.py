"""Whether IVON's posterior learns: its Hessian h and posterior std σ in the training logs, and a warning at the end of
training when h has hardly left `hess_init` (the posterior std is then set by the prior settings, not learned)."""

from __future__ import annotations

import logging

from ..presets import HESSIAN_MOVE_THRESHOLD, MIN_HESSIAN_WINDOW_STEPS
from .gaussian import hessian_movement, std_summary
from .optimizer import VariationalIVON

__all__ = ["HESSIAN_STUCK_TOLERANCE", "hessian_change", "hessian_summary", "warn_if_hessian_stuck"]

logger = logging.getLogger(__name__)

#: the Hessian "has hardly moved" when the median of |h − h0|/h0 over the weights is below this (README "Usage"): under
#: the EMA h_T = β2^T h0 + (1 − β2^T) ĥ the change is about (1 − β2^T)·|1 − ĥ/h0|, so below 10 % the learned curvature
#: makes up at most a tenth of h. The authors' β2 = 0.99999 stays below it for ~10k steps (MNIST, 2,820 steps: 0.5 →
#: 0.486; scikit-learn digits, the image example's ~1.3k steps: 0.5 → 0.493).
HESSIAN_STUCK_TOLERANCE = HESSIAN_MOVE_THRESHOLD


def hessian_summary(optimizer: VariationalIVON | None) -> dict[str, float]:
    """Mean/median of IVON's Hessian h, how far it moved from h0 and how much of that the data did (`hessian_movement`),
    and the mean/median of the posterior std σ = 1/sqrt(ess·(h + δ)) (Shen et al. 2024, Variational Learning is
    Effective for Large Deep Networks, Alg. 1); empty without an IVON optimizer."""
    if optimizer is None:
        return {}
    hess, group = optimizer.hessian().float(), optimizer.param_groups[0]
    return {"hess_mean": hess.mean().item(), "hess_median": hess.median().item(),
            **hessian_movement(hess, group["hess_init"], group["beta2"], optimizer.current_step),
            **std_summary(optimizer.posterior_std())}


def hessian_change(optimizer: VariationalIVON) -> float:
    """Median over the weights of |h − h0|/h0: how far IVON's Hessian, and with it σ, has moved from its initial value
    (0: σ is still 1/sqrt(ess·(h0 + δ)) everywhere, set by the prior settings rather than learned)."""
    return hessian_movement(optimizer.hessian(), optimizer.param_groups[0]["hess_init"])["hess_change_median"]


def warn_if_hessian_stuck(optimizer: VariationalIVON | None, beta2_given: bool) -> None:
    """Warn when IVON's Hessian has hardly moved from `hess_init` (`HESSIAN_STUCK_TOLERANCE`): the posterior std is then
    set by the prior settings, not learned. Nothing for another optimizer, or a Hessian fixed on purpose (β2 = 1).
    `beta2_given`: the user chose β2, rather than the run-length rule (`varsmooth.presets.default_beta2`)."""
    if optimizer is None or optimizer.param_groups[0]["beta2"] >= 1.0:
        return
    moved = hessian_change(optimizer)
    if moved >= HESSIAN_STUCK_TOLERANCE:
        return
    beta2 = optimizer.param_groups[0]["beta2"]
    shorten = ("leave beta2 unset so that it follows the run's length (hessian_window), or pass a smaller beta2"
               if beta2_given
               else f"beta2 follows the run's length but averages over at least {MIN_HESSIAN_WINDOW_STEPS} steps: pass "
                    "a smaller beta2")
    logger.warning(
        "IVON's Hessian hardly moved during training (median relative change %.2g < %g after %d steps with beta2=%s, "
        "which averages it over ~%d steps): the posterior std is still set by the prior settings (ess, hess_init), not "
        "learned. Train for more steps than that window, or shorten it: %s.",
        moved, HESSIAN_STUCK_TOLERANCE, optimizer.current_step, beta2, round(1 / (1 - beta2)), shorten,
    )
