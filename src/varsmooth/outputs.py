"""What a classifier outputs, as varsmooth reads it: the labels of a batch, the logits of a model's output, and the
output of a prediction that averaged posterior draws (`VariationalClassifierOutput`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

__all__ = ["IGNORE_INDEX", "LABEL_KEYS", "VariationalClassifierOutput", "entropy", "logits_of", "model_logits",
           "model_outputs"]

#: the batch keys that hold labels: removed from a batch before the forward pass, read by what scores predictions
LABEL_KEYS = ("labels", "label", "label_ids")
#: the label of a row without one (torch's and transformers' convention): ignored by every loss and score
IGNORE_INDEX = -100


@dataclass
class VariationalClassifierOutput(ModelOutput):
    """Output of a posterior-averaged classifier.

    logits: log P̂, the log of the posterior-averaged probabilities; softmax(logits) == P̂, so code written for
        ordinary logits (argmax, softmax, pipelines) gives the BMA prediction.
    probs: P̂ (batch, K). mean_probs: p̄ = softmax at the posterior mean. entropy: H[P̂].
    mutual_information: H[P̂] − mean_s H[softmax(f(x; θ_s))] (epistemic part of the uncertainty); None for a
        prediction that averaged no draws (at the posterior mean, or a point estimate), where it was not measured.
    noise_rms: sqrt(mean_s ‖p̄ − softmax(f(x; θ_s))‖²), the size of the label noise one IVON step injects; None
    likewise.
    """

    logits: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    mean_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    mutual_information: torch.Tensor | None = None
    noise_rms: torch.Tensor | None = None


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's output: the `logits` entry of a `ModelOutput`/dict, else the first element."""
    if isinstance(outputs, Mapping):
        if "logits" not in outputs:
            raise ValueError(
                f"The model returned {type(outputs).__name__} with keys {sorted(outputs)} but no 'logits': varsmooth "
                "needs a classifier that returns its class scores as `logits` (e.g. an AutoModelFor*Classification, "
                "or wrap the model so that forward returns SequenceClassifierOutput(logits=...))."
            )
        return outputs["logits"]
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise ValueError(f"Cannot find logits in a model output of type {type(outputs).__name__}: return a ModelOutput "
                     "with `logits`, a tensor, or a tuple whose first element is the logits.")


def model_outputs(model: torch.nn.Module, inputs: Mapping[str, Any], exclude: Collection[str] = ()) -> Any:
    """The output of `model` on `inputs` without their labels (and the keys `exclude`): varsmooth computes every loss
    from the logits itself, so the model must not compute its own."""
    return model(**{k: v for k, v in inputs.items() if k not in LABEL_KEYS and k not in exclude})


def model_logits(model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """Logits of `model` on `inputs`, in float32 (labels are not passed, so no loss is computed)."""
    return logits_of(model_outputs(model, inputs)).float()


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """H[p] = −Σ_k p_k log p_k over the last dimension, in nats (0 log 0 = 0)."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)
