"""Temperature scaling inside `VariationalTrainer`: fitted on the eval dataset when training ends (or on demand)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from ..posterior.prediction import LABEL_KEYS
from ..posterior.temperature import validation_batches
from .temperature_scaling import TemperatureScaling

if TYPE_CHECKING:
    from ..trainer import VariationalTrainer

__all__ = ["TemperatureScalingCallback", "fit_trainer_temperature_scaling"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def fit_trainer_temperature_scaling(trainer: "VariationalTrainer", eval_dataset: Any = None) -> TemperatureScaling:
    """Fit T on `eval_dataset` (default: the trainer's eval datasets, pooled) for the prediction `evaluate()` makes
    without temperature scaling, and make it the trainer's (`trainer.temperature_scaling`, saved by `save_model`).

    Every process must call this (the predictions of all processes are gathered, as in `evaluate()`).
    """
    eval_dataset = trainer.eval_dataset if eval_dataset is None else eval_dataset
    if eval_dataset is None:
        raise ValueError("Temperature scaling is fitted on a validation split, and the trainer has no eval_dataset: pass "
                         "eval_dataset= to the trainer (the example scripts hold out 20 % of the training split) or to "
                         "fit_temperature_scaling().")
    model = trainer.model
    if getattr(trainer.accelerator.unwrap_model(model), "temperature_scaling", None) is not None:
        raise ValueError("The trainer's model (an ensemble) already applies a temperature of its own, and this one would be "
                         "fitted on top of it: set model.temperature_scaling = None first (or keep the model's).")
    model.eval()
    posterior = trainer.posterior()
    gather = trainer.accelerator.gather_for_metrics
    chunks, label_chunks = [], []
    for batch in validation_batches(trainer, eval_dataset):
        labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        if labels is None:
            raise ValueError(f"A validation batch has no labels (keys: {sorted(batch)}): temperature scaling is fitted by "
                             "the NLL of the given labels, so the eval dataset needs a 'label' or 'labels' column.")
        out = trainer.predictive(model, batch, posterior, calibrated=False)
        chunks.append(gather(out.logits.float()).cpu())
        label_chunks.append(gather(torch.as_tensor(labels, device=out.logits.device).long()).cpu())
    if not chunks:
        raise ValueError("Temperature scaling got no validation batches: the eval dataset is empty.")
    scaling = TemperatureScaling.fit(torch.cat(chunks), torch.cat(label_chunks), prediction=trainer.prediction_settings(posterior))
    trainer.temperature_scaling = scaling
    logger.info("Temperature scaling: T = %.4g fitted on %d validation examples (NLL %.4f -> %.4f).", scaling.temperature,
                scaling.num_examples, scaling.nll_uncalibrated, scaling.nll_calibrated)
    trainer.log({"temperature_scaling": scaling.temperature, "eval_nll_uncalibrated": scaling.nll_uncalibrated,
                 "eval_nll_calibrated": scaling.nll_calibrated})
    return scaling


class TemperatureScalingCallback(TrainerCallback):
    """With `args.temperature_scaling`, fits T when training ends (after the posterior temperature, which changes the
    prediction T calibrates); a new `train()` drops the T of the previous one."""

    def __init__(self) -> None:
        self.trainer: VariationalTrainer | None = None

    def bind(self, trainer: "VariationalTrainer") -> "TemperatureScalingCallback":
        self.trainer = trainer
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.temperature_scaling = None
        if args.temperature_scaling and self.trainer.eval_dataset is None:  # before training, not after it
            raise ValueError("temperature_scaling=True fits the temperature on the eval dataset, and the trainer has none: "
                             "pass eval_dataset= (a validation split), or set temperature_scaling=False.")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.temperature_scaling:
            fit_trainer_temperature_scaling(self.trainer)
