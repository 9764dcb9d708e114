"""IVON (Shen et al. 2024, Variational Learning is Effective for Large Deep Networks) — training by variational
learning, the method of "Variational Learning Induces Adaptive Label Smoothing" (2025) — and its fixed-Hessian ablation.

IVON's settings are `VariationalTrainingArguments` fields (ess, hess_init, beta2, ...), so its config is empty.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ..presets import HESSIAN_WINDOW_CLIP_RADIUS, beta2_for_window
from .base import MethodConfig, TrainingMethod, register_method

__all__ = ["IVONMethod", "IVONFixedHessianMethod"]


class IVONMethod(TrainingMethod):
    """Cross-entropy minimised in expectation over q = N(m, diag σ²) by IVON (variational learning).

    The objective is Eq. 6 of "Variational Learning Induces Adaptive Label Smoothing" with λ = `ess`; the update is
    Shen et al. 2024, Alg. 1.
    """

    paper: ClassVar[str] = ("Shen et al. 2024, Variational Learning is Effective for Large Deep Networks; Variational "
                            "Learning Induces Adaptive Label Smoothing (2025)")
    uses_ivon: ClassVar[bool] = True
    default_learning_rate: ClassVar[float] = 0.2
    #: optimizer steps of the run, set by the trainer before it builds IVON (for `hessian_window`)
    total_steps: int | None = None

    def beta2(self) -> float:
        """`beta2`, or with `hessian_window` = c: 1 − 1/max(c·T, 300) for a run of T optimizer steps
        (varsmooth.presets; the run-length rule of benchmarks/training_length.py)."""
        if self.args.hessian_window is None:
            return self.args.beta2
        if not self.total_steps:
            raise ValueError(
                "hessian_window sets β2 from the run's number of optimizer steps, which is not known yet (the trainer "
                "sets it when it builds the optimizer; an IterableDataset needs max_steps). Pass beta2 instead."
            )
        return beta2_for_window(self.total_steps, self.args.hessian_window)

    def clip_radius(self) -> float:
        """`clip_radius` if given; 0.05 under the run-length rule (the Hessian may fall far below h0, which would
        blow up the step lr·(h0+δ)/(h+δ), as the run-length β2 did in 100-epoch runs without it); else no clipping."""
        if self.args.clip_radius is not None:
            return self.args.clip_radius
        return HESSIAN_WINDOW_CLIP_RADIUS if self.args.hessian_window is not None else math.inf

    def ess(self) -> float:
        """λ in Eq. 6 of the adaptive-label-smoothing paper: the user's `ess`, else the training-set size N (the authors'
        choice)."""
        if self.args.ess is not None:
            return float(self.args.ess)
        if not self.num_train_examples:
            raise ValueError(
                "IVON needs the effective sample size `ess`, which defaults to the training-set size, but the "
                "training dataset has no length (an IterableDataset?). Pass `ess=<number of training examples>`."
            )
        return float(self.num_train_examples)

    def ivon_settings(self) -> dict[str, Any]:
        return self._settings(self.beta2())

    def _settings(self, beta2: float | None) -> dict[str, Any]:
        a = self.args
        return {
            "lr": a.learning_rate,
            "ess": self.ess(),
            "hess_init": a.hess_init,
            "beta1": a.beta1,
            "beta2": beta2,
            "weight_decay": a.prior_precision,
            "clip_radius": self.clip_radius(),
            "rescale_lr": a.rescale_lr,
        }

    def hyperparameters(self) -> dict[str, Any]:
        known = self.args.hessian_window is None or self.total_steps  # under the run-length rule, β2 is known once T is
        settings = self._settings(self.beta2() if known else None)
        return {"method": self.name, **settings, "hessian_window": self.args.hessian_window,
                "mc_samples": self.args.mc_samples, "eval_mc_samples": self.args.eval_mc_samples}


class IVONFixedHessianMethod(IVONMethod):
    """IVON with β2 = 1: h stays at hess_init and σ never adapts (the ablation of Fig. 6 of the adaptive-label-smoothing paper)."""

    paper: ClassVar[str] = "Variational Learning Induces Adaptive Label Smoothing (2025), Fig. 6 and App. C.2"

    def beta2(self) -> float:
        return 1.0


register_method("ivon", MethodConfig, IVONMethod)
register_method("ivon_fixed_hessian", MethodConfig, IVONFixedHessianMethod)
