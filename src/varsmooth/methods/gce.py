"""Generalized cross-entropy (Zhang & Sabuncu 2018), a noise-robust loss between CE and MAE."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import IGNORE_INDEX, MethodConfig, MethodContext, TrainingMethod, register_method

__all__ = ["GCEConfig", "GCEMethod", "generalized_cross_entropy"]


def generalized_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, q: float) -> torch.Tensor:
    """Mean L_q = (1 − p_y^q)/q (the L_q loss of Zhang & Sabuncu 2018); q → 0 gives CE, q = 1 gives 1 − p_y.

    Computed as −expm1(q·log p_y)/q, which needs no clamping of p_y and stays accurate for small q.
    """
    keep = labels != IGNORE_INDEX
    log_p = F.log_softmax(logits[keep].float(), dim=-1).gather(1, labels[keep].unsqueeze(1)).squeeze(1)
    return (-torch.expm1(q * log_p) / q).mean()


@dataclass
class GCEConfig(MethodConfig):
    """Settings of method='gce'."""

    gce_q: float = field(default=0.7,
                         metadata={"help": "method='gce': q in (0, 1] of the generalized cross-entropy (1 - p_y^q)/q."})

    def __post_init__(self) -> None:
        if not 0.0 < self.gce_q <= 1.0:
            raise ValueError(f"gce_q must be in (0, 1], got {self.gce_q} (q -> 0 is CE: use method='erm').")


class GCEMethod(TrainingMethod):
    """Generalized cross-entropy L_q with q = `gce_q` (0.7 in the paper)."""

    paper: ClassVar[str] = ("Zhang & Sabuncu 2018, Generalized Cross Entropy Loss for Training Deep Neural Networks "
                            "with Noisy Labels")
    config: GCEConfig

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        return generalized_cross_entropy(logits, labels, self.config.gce_q)


register_method("gce", GCEConfig, GCEMethod)
