"""Generalized cross-entropy (Zhang & Sabuncu 2018), a noise-robust loss between CE and MAE."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from .base import IGNORE_INDEX, TrainingMethod, register_method

if TYPE_CHECKING:
    from ..trainer import VariationalTrainer
    from ..training_args import VariationalTrainingArguments

__all__ = ["GCEMethod", "generalized_cross_entropy"]


def generalized_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, q: float) -> torch.Tensor:
    """Mean L_q = (1 − p_y^q)/q (methods.md §6); q → 0 gives CE, q = 1 gives 1 − p_y.

    Computed as −expm1(q·log p_y)/q, which needs no clamping of p_y and stays accurate for small q.
    """
    keep = labels != IGNORE_INDEX
    log_p = F.log_softmax(logits[keep].float(), dim=-1).gather(1, labels[keep].unsqueeze(1)).squeeze(1)
    return (-torch.expm1(q * log_p) / q).mean()


@register_method
class GCEMethod(TrainingMethod):
    """Generalized cross-entropy L_q with q = `gce_q` (0.7 in the paper)."""

    name: ClassVar[str] = "gce"

    def __init__(self, args: "VariationalTrainingArguments", num_train_examples: int | None = None) -> None:
        super().__init__(args, num_train_examples)
        if not 0.0 < args.gce_q <= 1.0:
            raise ValueError(f"gce_q must be in (0, 1], got {args.gce_q} (q -> 0 is CE: use method='erm').")

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, trainer: "VariationalTrainer", inputs: dict[str, Any]) -> torch.Tensor:
        return generalized_cross_entropy(logits, labels, self.args.gce_q)

    def hyperparameters(self) -> dict[str, Any]:
        return {"method": self.name, "gce_q": self.args.gce_q}
