"""Whether a run trained at all: a final training loss still near ln K, the cross-entropy of a uniform prediction.

A run can finish, save and score without having learned: a learning rate too small for the run's length (the `lora`
preset's former 0.03 in 189 steps ended at a training loss of 1.365 on a 4-class task, ln 4 = 1.386) leaves the
classifier near chance. Over the 251 cached cross-entropy runs of benchmarks/real_noise.py and lora.py, all 47 that
ended within 10 points of chance accuracy had a last logged training loss and a run mean both at or above 0.95·ln K;
the 19 others above it were well below the accuracy their task reaches. The best loss a model can reach on noisy labels
is the labels' own entropy (0.61 = 0.88·ln 2 for 30 % flipped binary labels), so the threshold sits above that.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .methods import TrainingMethod
from .model_parts import model_num_labels

__all__ = ["STALLED_LOSS_SHARE", "StalledLossCallback", "cross_entropy_classes", "stalled_loss_text",
           "stalled_training_loss"]

logger = logging.getLogger(__name__)

#: a last logged training loss at or above this share of ln K counts as "barely fell"
STALLED_LOSS_SHARE = 0.95


def cross_entropy_classes(method: TrainingMethod, model: Any) -> int | None:
    """K when `method` trains `model` by the cross-entropy (its `loss` is `TrainingMethod.loss`: ERM, IVON, SAM), whose
    uniform prediction scores ln K; None for the other losses (label smoothing's, GCE's, ... have other scales) or an
    unknown K."""
    return model_num_labels(model) if type(method).loss is TrainingMethod.loss else None


def stalled_training_loss(log_history: list[dict[str, Any]], num_classes: int | None) -> dict[str, Any] | None:
    """{"loss", "step", "uniform_loss", "what"} when both the last logged training loss and the run's mean
    `train_loss` (those logged) are at least `STALLED_LOSS_SHARE`·ln K; "loss" is the lower of the two. None when
    either is below, nothing was logged, or K is unknown (or 1). A last logging window alone is noisy: on 30 %
    flipped binary labels one ended at 0.666 (0.96·ln 2) in a run whose mean was 0.613 and that reached 81 %."""
    if not num_classes or num_classes < 2:
        return None
    last = next((entry for entry in reversed(log_history) if "loss" in entry), None)
    mean = next((entry for entry in reversed(log_history) if "train_loss" in entry), None)
    candidates = ([(last["loss"], last.get("step"), "its last logged value")] if last else []) + (
        [(mean["train_loss"], mean.get("step"), "its mean over the run")] if mean else [])
    uniform = math.log(num_classes)
    if not candidates or not all(loss >= STALLED_LOSS_SHARE * uniform for loss, _, _ in candidates):
        return None
    loss, step, what = min(candidates, key=lambda c: c[0])
    return {"loss": float(loss), "step": step, "uniform_loss": uniform, "what": what}


def stalled_loss_text(stalled: dict[str, float]) -> str:
    """The sentence the warning and the model card say."""
    return (f"The training loss barely fell: {stalled['what']}, {stalled['loss']:.4g} at step {stalled['step']}, is "
            f"{stalled['loss'] / stalled['uniform_loss']:.0%} of ln K = {stalled['uniform_loss']:.4g}, the loss of a "
            "uniform prediction, so the model may have learned little. Check the learning rate against the run's "
            "length (a preset's rate may be set for longer runs) and that the labels match the inputs.")


class StalledLossCallback(TrainerCallback):
    """Warns when training ends with a cross-entropy near ln K (`stalled_training_loss`, `cross_entropy_classes`)."""

    def __init__(self, method: TrainingMethod) -> None:
        self.method = method

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
                     **kwargs: Any) -> None:
        stalled = stalled_training_loss(state.log_history, cross_entropy_classes(self.method, model))
        if stalled is not None:
            logger.warning(stalled_loss_text(stalled))
