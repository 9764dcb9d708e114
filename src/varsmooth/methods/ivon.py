"""IVON (Shen et al. 2024) — training by variational learning, seed 000's method, and its fixed-Hessian ablation."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from .base import TrainingMethod, register_method

__all__ = ["IVONMethod", "IVONFixedHessianMethod"]


@register_method
class IVONMethod(TrainingMethod):
    """Cross-entropy minimised in expectation over q = N(m, diag σ²) by IVON (seed 000, Eq. 6; Alg. 1)."""

    name: ClassVar[str] = "ivon"
    uses_ivon: ClassVar[bool] = True
    default_learning_rate: ClassVar[float] = 0.2

    def beta2(self) -> float:
        return self.args.beta2

    def ess(self) -> float:
        """λ in seed 000 Eq. 6: the user's `ess`, else the training-set size N (the authors' choice)."""
        if self.args.ess is not None:
            return float(self.args.ess)
        if not self.num_train_examples:
            raise ValueError(
                "IVON needs the effective sample size `ess`, which defaults to the training-set size, but the "
                "training dataset has no length (an IterableDataset?). Pass `ess=<number of training examples>`."
            )
        return float(self.num_train_examples)

    def ivon_settings(self) -> dict[str, Any]:
        a = self.args
        return {
            "lr": a.learning_rate,
            "ess": self.ess(),
            "hess_init": a.hess_init,
            "beta1": a.beta1,
            "beta2": self.beta2(),
            "weight_decay": a.prior_precision,
            "clip_radius": math.inf if a.clip_radius is None else a.clip_radius,
            "rescale_lr": a.rescale_lr,
        }

    def hyperparameters(self) -> dict[str, Any]:
        return {"method": self.name, **{k: v for k, v in self.ivon_settings().items()},
                "mc_samples": self.args.mc_samples, "eval_mc_samples": self.args.eval_mc_samples}


@register_method
class IVONFixedHessianMethod(IVONMethod):
    """The seed 000 ablation (Fig. 6): β2 = 1, so h stays at hess_init and σ never adapts."""

    name: ClassVar[str] = "ivon_fixed_hessian"

    def beta2(self) -> float:
        return 1.0
