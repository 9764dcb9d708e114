"""Logistic-Normal likelihood for heteroscedastic label noise (Englesson et al. 2023; ErikEnglesson/Logistic-Normal).

The model's own classifier is the mean head μ ∈ R^K; the method adds a covariance-factor head c ∈ R^K on the
same penultimate features (the input of the model's output layer, captured by a forward pre-hook; the head
runs in a forward hook of the model, see heads.py). With the dummy class (index K, never a label) D = K and

    Σ^{1/2} = c cᵀ + λI   ⇒   Σ = (c cᵀ + λI)²
    target  y_t = τ·(log q_{1:K} − log q_{K+1}),   q = (1 − t)·e_y + t/(K+1)·1,   t = 0.01
    loss    = −log N(y_t; μ, Σ) = ½ r̃ᵀr̃ + ½ log|Σ| + ½ D log 2π,   r̃ = Σ^{-1/2}(y_t − μ)           (Eq. 5)

with Σ^{-1/2} applied by Sherman–Morrison, r̃ = (r − c·cᵀr/(λ + ‖c‖²))/λ, and
log|Σ| = 2[(D−1)·log λ + log(λ + ‖c‖²)]: O(K) per example, never a dense inverse. The reference's TF loss adds
the change-of-variables term D·log τ − Σ_k log q_k, a constant in (t, τ, K) that changes no gradient; it is
left out.

Prediction uses the mean head only: the covariance head is not saved, so the exported model is the plain
classifier whose logits are μ. Its softmax is the reference's S_C(μ/τ) restricted to the K real classes for
τ = 1 (same argmax for every τ); for τ ≠ 1 divide the logits by τ for calibrated probabilities. The variant
without the dummy class (D = K − 1) is not offered: the paper's ablation shows it breaks training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .base import IGNORE_INDEX, MethodConfig, MethodContext, TrainingMethod, register_method
from .heads import AuxiliaryHeads, attach_heads, output_layer, tie_to_logits

__all__ = ["LogisticNormalConfig", "LogisticNormalMethod", "logistic_normal_nll", "logistic_normal_targets"]


def logistic_normal_targets(labels: torch.Tensor, num_classes: int, temperature: float,
                            target_smoothing: float) -> torch.Tensor:
    """y_t = τ·log(q_{1:K}/q_{K+1}) with q = (1 − t)·e_y + t/(K+1) over K + 1 classes (the last is the dummy)."""
    q = (1.0 - target_smoothing) * F.one_hot(labels, num_classes + 1).float() + target_smoothing / (num_classes + 1)
    return temperature * (q[:, :-1].log() - q[:, -1:].log())


def logistic_normal_nll(mean: torch.Tensor, factor: torch.Tensor, target: torch.Tensor,
                        min_scale: float) -> torch.Tensor:
    """Per-example −log N(target; mean, (c cᵀ + λI)²) in O(D) (matrix determinant lemma + Sherman–Morrison)."""
    r = target - mean
    dim = r.shape[-1]
    sq_norm = (factor * factor).sum(-1)
    whitened = (r - factor * ((factor * r).sum(-1) / (min_scale + sq_norm)).unsqueeze(-1)) / min_scale
    log_det = 2.0 * ((dim - 1) * math.log(min_scale) + torch.log(min_scale + sq_norm))
    return 0.5 * ((whitened * whitened).sum(-1) + log_det + dim * math.log(2.0 * math.pi))


@dataclass
class LogisticNormalConfig(MethodConfig):
    """Settings of method='logistic_normal'."""

    ln_temperature: float = field(
        default=1.0,
        metadata={"help": "method='logistic_normal': temperature τ of the softmax-centred link (Englesson et al. "
                          "2023)."}
    )
    ln_min_scale: float = field(
        default=1.0,
        metadata={"help": "method='logistic_normal': λ > 0 in Σ^{1/2} = c cᵀ + λI (reference flag `min_scale`)."}
    )
    ln_target_smoothing: float = field(
        default=0.01, metadata={"help": "method='logistic_normal': t in the observed target (1-t)·onehot + t/(K+1)."}
    )

    def __post_init__(self) -> None:
        if not self.ln_temperature > 0 or not self.ln_min_scale > 0:
            raise ValueError(f"ln_temperature and ln_min_scale must be > 0, got {self.ln_temperature}, "
                             f"{self.ln_min_scale}.")
        if not 0.0 < self.ln_target_smoothing < 1.0:
            raise ValueError(
                "ln_target_smoothing t must be in (0, 1) (t = 0 puts the target at infinity), got "
                f"{self.ln_target_smoothing}."
            )


class LogisticNormalMethod(TrainingMethod):
    """Logistic-normal likelihood: an extra head predicts a per-example covariance factor of the labels'
    logistic-normal distribution (heteroscedastic label noise), with a dummy class, temperature τ = `ln_temperature`,
    λ = `ln_min_scale`, t = `ln_target_smoothing`."""

    paper: ClassVar[str] = "Englesson et al. 2023, Logistic-Normal Likelihoods for Heteroscedastic Label Noise"
    config: LogisticNormalConfig

    def __init__(self, config: Any = None, num_train_examples: int | None = None) -> None:
        super().__init__(config, num_train_examples)
        self.heads: AuxiliaryHeads | None = None
        self._features: torch.Tensor | None = None
        self._factor: torch.Tensor | None = None

    def attach(self, model: nn.Module) -> None:
        layer = output_layer(model)
        self.heads = attach_heads(model, {"covariance_factor": nn.Linear(layer.in_features, layer.out_features)})
        layer.register_forward_pre_hook(self._capture_features)
        model.register_forward_hook(self._covariance_factor)

    def _capture_features(self, module: nn.Module, args: tuple) -> None:
        if module.training:
            self._features = args[0]

    def _covariance_factor(self, module: nn.Module, args: tuple, output: Any) -> Any:
        # inside the model's forward, so that DDP sees the head's parameters in use (heads.py)
        if not module.training or self._features is None:
            return output
        features, self._features = self._features, None
        self._factor = self.heads["covariance_factor"](features)
        return tie_to_logits(output, [self._factor])

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        if self._factor is None:
            raise RuntimeError(
                "logistic_normal: the covariance head is not attached; build the trainer with `model=` (not "
                "`model_init`)."
            )
        factor, self._factor = self._factor, None
        keep = labels != IGNORE_INDEX
        c = self.config
        target = logistic_normal_targets(labels[keep], logits.shape[-1], c.ln_temperature, c.ln_target_smoothing)
        return logistic_normal_nll(logits[keep].float(), factor[keep].float(), target, c.ln_min_scale).mean()

    def state_dict(self) -> dict[str, Any]:
        return {"heads": self.heads.heads_state_dict()} if self.heads is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "heads" in state:
            if self.heads is None:
                raise RuntimeError("logistic_normal: cannot restore the covariance head before it is attached to a "
                                   "model.")
            self.heads.load_heads_state_dict(state["heads"])

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "dummy_class": True}


register_method("logistic_normal", LogisticNormalConfig, LogisticNormalMethod)
