"""IVON (Shen et al. 2024, Variational Learning is Effective for Large Deep Networks) — training by variational
learning, the method of "Variational Learning Induces Adaptive Label Smoothing" (2025) — and its fixed-Hessian ablation.

IVON's settings are `VariationalTrainingArguments` fields (ess, hess_init, beta2, ...), so its config is empty.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch

from ..posterior.optimizer import VariationalIVON
from ..presets import HESSIAN_WINDOW_CLIP_RADIUS, IVON_PRESETS, SCRATCH_PRESET, default_beta2
from .base import MethodConfig, OptimizerContext, TrainingMethod, register_method

__all__ = ["IVONMethod", "IVONFixedHessianMethod"]

logger = logging.getLogger(__name__)


class IVONMethod(TrainingMethod):
    """Cross-entropy minimised in expectation over q = N(m, diag σ²) by IVON (variational learning).

    The objective is Eq. 6 of "Variational Learning Induces Adaptive Label Smoothing" with λ = `ess`; the update is
    Shen et al. 2024, Alg. 1.
    """

    paper: ClassVar[str] = ("Shen et al. 2024, Variational Learning is Effective for Large Deep Networks; Variational "
                            "Learning Induces Adaptive Label Smoothing (2025)")
    uses_ivon: ClassVar[bool] = True
    default_learning_rate: ClassVar[float] = 0.2
    #: optimizer steps of the run, known when IVON is built (`create_optimizer`; for the run-length β2 rule)
    total_steps: int | None = None

    def create_optimizer(self, params: list[torch.nn.Parameter], run: OptimizerContext) -> VariationalIVON:
        """IVON over the trainable `params` with `ivon_settings()` for a run of `run.total_steps` steps."""
        low_precision = sorted({str(p.dtype) for p in params if p.dtype not in (torch.float32, torch.float64)})
        if low_precision:
            raise ValueError(
                f"IVON needs fp32 trainable weights, found {low_precision}: in bf16 β2=0.99999 rounds to 1 and the "
                "Hessian never updates. Load the model in float32 and use bf16=True for mixed precision."
            )
        self.total_steps = run.total_steps
        return VariationalIVON(params, noise_seed=run.seed, rank=run.rank, fused=run.fused, sync=run.sync,
                               **self.ivon_settings())

    def follows_run_length(self) -> bool:
        """Whether β2 is the library's default (`varsmooth.presets.default_beta2`): no `beta2` was given."""
        return self.args.beta2 is None

    def _long_run_beta2(self) -> float:
        return float({**SCRATCH_PRESET, **IVON_PRESETS[self.args.ivon_preset]}["long_run_beta2"])

    def _window_rule_applies(self) -> bool:
        """Whether β2 comes from the run-length rule: the default, and a run too short for the preset's β2."""
        return (self.follows_run_length() and bool(self.total_steps)
                and default_beta2(self._long_run_beta2(), self.total_steps, self.args.hessian_window) != self._long_run_beta2())

    def beta2(self) -> float:
        """`beta2` if given, else `default_beta2`: the preset's β2 in a run long enough for it to move the Hessian, the
        run-length rule 1 − 1/max(c·T, 300) (c = `hessian_window`) in a shorter one; the preset's when T is unknown."""
        if not self.follows_run_length():
            return self.args.beta2
        if self.total_steps:
            return default_beta2(self._long_run_beta2(), self.total_steps, self.args.hessian_window)
        logger.warning(
            "The run's number of optimizer steps is unknown (an IterableDataset without max_steps?), so β2 cannot follow "
            "the run's length: using the %s preset's beta2=%s, under which the Hessian may hardly move in a short run. "
            "Set max_steps, or pass beta2.", self.args.ivon_preset, self._long_run_beta2(),
        )
        return self._long_run_beta2()

    def clip_radius(self) -> float:
        """`clip_radius` if given; 0.05 under the run-length rule (the Hessian may fall far below h0, which would
        blow up the step lr·(h0+δ)/(h+δ), as the run-length β2 did in 100-epoch runs without it); else no clipping."""
        if self.args.clip_radius is not None:
            return self.args.clip_radius
        return HESSIAN_WINDOW_CLIP_RADIUS if self._window_rule_applies() else math.inf

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
        """Keyword arguments for `VariationalIVON`."""
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
        known = not self.follows_run_length() or self.total_steps  # the default β2 is known once T is
        settings = self._settings(self.beta2() if known else None)
        return {"method": self.name, **settings,
                "hessian_window": self.args.hessian_window if self._window_rule_applies() else None,
                "mc_samples": self.args.mc_samples, "eval_mc_samples": self.args.eval_mc_samples}


class IVONFixedHessianMethod(IVONMethod):
    """IVON with β2 = 1: h stays at hess_init and σ never adapts (the ablation of Fig. 6 of the adaptive-label-smoothing paper)."""

    paper: ClassVar[str] = "Variational Learning Induces Adaptive Label Smoothing (2025), Fig. 6 and App. C.2"

    def follows_run_length(self) -> bool:
        return False

    def beta2(self) -> float:
        return 1.0


register_method("ivon", MethodConfig, IVONMethod)
register_method("ivon_fixed_hessian", MethodConfig, IVONFixedHessianMethod)
