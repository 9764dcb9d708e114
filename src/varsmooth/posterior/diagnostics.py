"""Whether IVON's posterior learns: its Hessian h and posterior std σ in the training logs, and a warning at the end of
training when h has hardly left `hess_init` (the posterior std is then set by the prior settings, not learned)."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..presets import HESSIAN_MOVE_THRESHOLD, MIN_HESSIAN_WINDOW_STEPS
from .gaussian import hessian_movement, std_summary
from .optimizer import VariationalIVON, unwrap_ivon

__all__ = ["HESSIAN_STUCK_TOLERANCE", "HessianDiagnosticsCallback", "hessian_change", "hessian_summary"]

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


class HessianDiagnosticsCallback(TrainerCallback):
    """Adds `hessian_summary` to every training log (the entries with a "loss"), and warns when training ends with a
    Hessian whose median relative change from `hess_init` is below `HESSIAN_STUCK_TOLERANCE`.

    It reads the IVON optimizer the Trainer passes to every callback (`optimizer`); with another optimizer it does
    nothing. `VariationalTrainer` adds it ahead of the reporting callbacks, so that they report the summary too.
    """

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:  # training logs: show whether the posterior learns
            return
        summary = hessian_summary(unwrap_ivon(optimizer))
        logs.update(summary)
        # `Trainer.log` appended a copy of these logs to the history before calling the callbacks
        if state.log_history and "loss" in state.log_history[-1]:
            state.log_history[-1].update(summary)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, optimizer: Any = None,
                     **kwargs: Any) -> None:
        opt = unwrap_ivon(optimizer)
        if opt is None or opt.param_groups[0]["beta2"] >= 1.0:  # a fixed Hessian (β2 = 1) is meant not to move
            return
        moved = hessian_change(opt)
        if moved < HESSIAN_STUCK_TOLERANCE:
            beta2 = opt.param_groups[0]["beta2"]
            # β2 unset already follows the run's length, down to a window of MIN_HESSIAN_WINDOW_STEPS steps
            shorten = ("leave beta2 unset so that it follows the run's length (hessian_window), or pass a smaller beta2"
                       if getattr(getattr(args, "method_config", None), "beta2", None) is not None else
                       f"beta2 follows the run's length but averages over at least {MIN_HESSIAN_WINDOW_STEPS} steps: "
                       "pass a smaller beta2")
            logger.warning(
                "IVON's Hessian hardly moved during training (median relative change %.2g < %g after %d steps with "
                "beta2=%s, which averages it over ~%d steps): the posterior std is still set by the prior settings "
                "(ess, hess_init), not learned. Train for more steps than that window, or shorten it: %s.",
                moved, HESSIAN_STUCK_TOLERANCE, opt.current_step, beta2, round(1 / (1 - beta2)), shorten,
            )
