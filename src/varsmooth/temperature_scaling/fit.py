"""Temperature scaling fitted on validation batches (the trainer fits it when training ends,
`varsmooth.trainer.after_training`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..outputs import LABEL_KEYS, VariationalClassifierOutput
from .scaling import TemperatureScaling

__all__ = ["fit_on_batches"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def fit_on_batches(
    predict: Callable[[Mapping[str, Any]], VariationalClassifierOutput],
    batches: Iterable[Mapping[str, Any]] | None,
    prediction: dict[str, Any],
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    model: torch.nn.Module | None = None,
) -> TemperatureScaling:
    """Fit T by the NLL of `predict(batch)` (the uncalibrated prediction) on labelled validation `batches` (None: there
    is no validation split). `prediction` describes what `predict` computes (`Predictor.describe`: recorded with T,
    compared when the model is loaded); `gather` collects the logits of all processes (every process must call this);
    `model`, when given, is checked for a temperature of its own (an ensemble's)."""
    if batches is None:
        raise ValueError("Temperature scaling is fitted on a validation split, and the trainer has no eval_dataset: "
                         "pass eval_dataset= to the trainer (the example scripts hold out 20 % of the training split) "
                         "or to fit_temperature_scaling().")
    if getattr(model, "temperature_scaling", None) is not None:
        raise ValueError("The trainer's model (an ensemble) already applies a temperature of its own, and this one "
                         "would be fitted on top of it: set model.temperature_scaling = None first (or keep the "
                         "model's).")
    gather = gather if gather is not None else (lambda tensor: tensor)
    chunks, label_chunks = [], []
    for batch in batches:
        labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        if labels is None:
            raise ValueError(f"A validation batch has no labels (keys: {sorted(batch)}): temperature scaling is fitted "
                             "by the NLL of the given labels, so the eval dataset needs a 'label' or 'labels' column.")
        out = predict(batch)
        chunks.append(gather(out.logits.float()).cpu())
        label_chunks.append(gather(torch.as_tensor(labels, device=out.logits.device).long()).cpu())
    if not chunks:
        raise ValueError("Temperature scaling got no validation batches: the eval dataset is empty.")
    scaling = TemperatureScaling.fit(torch.cat(chunks), torch.cat(label_chunks), prediction=prediction)
    logger.info("Temperature scaling: T = %.4g fitted on %d validation examples (NLL %.4f -> %.4f).",
                scaling.temperature, scaling.num_examples, scaling.nll_uncalibrated, scaling.nll_calibrated)
    return scaling
