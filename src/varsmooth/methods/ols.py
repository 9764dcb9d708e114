"""Online Label Smoothing (OLS; Zhang et al. 2021, "Delving Deep into Label Smoothing").

Follows ankandrew/online-label-smoothing-pt, the implementation that "Variational Learning Induces Adaptive Label
Smoothing" (2025) used (its App. C.1): the soft labels of
epoch 0 are the label-smoothing matrix with `smoothing = 0.1` spread over the *other* classes (1 − s on the
diagonal, s/(K−1) elsewhere), and a class with no correctly classified example in an epoch gets an all-zero soft
label for the next epoch (no soft term for it). The official code differs on both points (zeros or 1/K at
epoch 0; 1/K for empty classes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import TrainerCallback

from .base import IGNORE_INDEX, CallbackContext, MethodConfig, MethodContext, TrainingMethod, register_method

__all__ = ["OnlineLabelSmoothingConfig", "OnlineLabelSmoothingMethod"]

#: smoothing of the epoch-0 soft labels (ankandrew's default)
INITIAL_SMOOTHING = 0.1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _EpochSwap(TrainerCallback):
    """Makes the soft labels collected in the epoch that just ended the targets of the new one.

    The swap happens when an epoch *begins* rather than in `on_epoch_end`: a checkpoint written by `save_steps`
    on the last step of an epoch precedes that epoch's `on_epoch_end`, and a run resumed from it starts in the
    next epoch without ever calling it. Comparing the epoch counters covers both paths with one rule.
    """

    def __init__(self, method: "OnlineLabelSmoothingMethod") -> None:
        self.method = method

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if int(state.epoch or 0) > self.method.epoch:
            self.method.next_epoch()


@dataclass
class OnlineLabelSmoothingConfig(MethodConfig):
    """Settings of method='ols'."""

    ols_alpha: float = field(
        default=0.5,
        metadata={"help": "method='ols': weight α of the hard-label CE in α·CE + (1-α)·soft-label CE (Zhang et al. "
                          "2021)."},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.ols_alpha <= 1.0:
            raise ValueError(f"ols_alpha must be in [0, 1], got {self.ols_alpha}.")


class OnlineLabelSmoothingMethod(TrainingMethod):
    """Online label smoothing: L = α·CE(f, y) + (1 − α)·CE(f, S[y]), S[c] = mean softmax of the correctly classified
    class-c examples of the previous epoch ("correct" = agreeing with the given, possibly noisy, label).

    State: S (K×K, row c = soft label of class c), the accumulator U (K×K) and counts n (K) of the current epoch,
    and the epoch counter; U and n are summed over processes (DDP) before they replace S.
    """

    paper: ClassVar[str] = "Zhang et al. 2021, Delving Deep into Label Smoothing"
    config: OnlineLabelSmoothingConfig

    def __init__(self, config: Any = None, num_train_examples: int | None = None) -> None:
        super().__init__(config, num_train_examples)
        self.soft_labels: torch.Tensor | None = None
        self.accumulator: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.epoch = 0

    def _init_state(self, num_classes: int, device: torch.device) -> None:
        off = INITIAL_SMOOTHING / (num_classes - 1)
        self.soft_labels = torch.full((num_classes, num_classes), off, device=device)
        self.soft_labels.fill_diagonal_(1.0 - INITIAL_SMOOTHING)
        self.accumulator = torch.zeros(num_classes, num_classes, device=device)
        self.counts = torch.zeros(num_classes, device=device)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        keep = labels != IGNORE_INDEX
        logits, labels = logits[keep].float(), labels[keep]
        if self.soft_labels is None:
            self._init_state(logits.shape[-1], logits.device)
        elif self.soft_labels.device != logits.device:  # restored from a checkpoint on the CPU
            device = logits.device
            self.soft_labels, self.accumulator, self.counts = (t.to(device)
                                                               for t in (self.soft_labels, self.accumulator,
                                                                         self.counts))
        log_probs = F.log_softmax(logits, dim=-1)
        if context.is_training:
            self.update(log_probs.detach().exp(), labels)
        hard = F.nll_loss(log_probs, labels)
        soft = -(self.soft_labels[labels] * log_probs).sum(-1).mean()
        alpha = self.config.ols_alpha
        return alpha * hard + (1.0 - alpha) * soft

    @torch.no_grad()
    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> None:
        """U[y_i] += p_i and n[y_i] += 1 for every example whose prediction matches its label."""
        correct = probs.argmax(-1) == labels
        self.accumulator.index_add_(0, labels[correct], probs[correct])
        self.counts.index_add_(0, labels[correct], torch.ones_like(labels[correct], dtype=self.counts.dtype))

    @torch.no_grad()
    def next_epoch(self) -> None:
        """S[c] ← U[c]/n[c] (all zeros when n[c] = 0), then U, n ← 0 (ankandrew `next_epoch`)."""
        if self.soft_labels is not None:
            if _distributed():
                dist.all_reduce(self.accumulator)
                dist.all_reduce(self.counts)
            self.soft_labels = self.accumulator / self.counts.clamp(min=1).unsqueeze(1)
            self.accumulator.zero_()
            self.counts.zero_()
        self.epoch += 1

    def callbacks(self, run: CallbackContext) -> list[Any]:
        return [_EpochSwap(self)]

    def state_dict(self) -> dict[str, Any]:
        # Collective under DDP (every process saves through here): the checkpoint holds the sums over processes.
        if self.soft_labels is None:
            return {"epoch": self.epoch}
        accumulator, counts = self.accumulator.clone(), self.counts.clone()
        if _distributed():
            dist.all_reduce(accumulator)
            dist.all_reduce(counts)
        return {"epoch": self.epoch, "soft_labels": self.soft_labels.cpu(), "accumulator": accumulator.cpu(),
                "counts": counts.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        if "soft_labels" not in state:
            return
        self.soft_labels = state["soft_labels"].clone()
        self.accumulator = state["accumulator"].clone()
        self.counts = state["counts"].clone()
        if _distributed() and dist.get_rank() != 0:
            # the saved sums live on one process only, or the next all-reduce would count them once per process
            self.accumulator.zero_()
            self.counts.zero_()

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "ols_initial_smoothing": INITIAL_SMOOTHING}


register_method("ols", OnlineLabelSmoothingConfig, OnlineLabelSmoothingMethod)
