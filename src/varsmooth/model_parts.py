"""The parts of a classifier that varsmooth finds or adds, for every room that touches a model: its output layer (where
MC dropout goes and what a method's auxiliary heads mirror) and the name of the submodule holding a method's extra
heads (left out of saves and of the weights' fingerprint), and the number of classes it predicts."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["AUX_MODULE_NAME", "model_num_labels", "output_layer"]

#: the submodule of a model that holds the extra heads a training method adds (`varsmooth.methods.heads`)
AUX_MODULE_NAME = "varsmooth_aux"


def output_layer(model: nn.Module) -> nn.Linear:
    """The final linear layer that produces the logits (its input is the penultimate feature vector).

    HF classifiers keep it in `model.classifier` (a Linear, or a Sequential ending in one); timm models and
    `TimmWrapperForImageClassification` expose it through `get_classifier()` / `timm_model`.
    """
    candidates = []
    for owner in (model, getattr(model, "timm_model", None)):
        if owner is None:
            continue
        if callable(getattr(owner, "get_classifier", None)):
            candidates.append(owner.get_classifier())
        candidates.append(getattr(owner, "classifier", None))
    for head in candidates:
        if isinstance(head, nn.Module):
            linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
            if linears:
                return linears[-1]
    raise ValueError(
        f"Cannot find the output layer of {type(model).__name__}: expected an nn.Linear in `model.classifier` "
        "(transformers) or `get_classifier()` (timm)."
    )


def model_num_labels(model: Any) -> int | None:
    """The number of classes the model predicts, from its config (HF models, peft models, `DeepEnsemble`); None when
    the model does not say."""
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    return num_labels if isinstance(num_labels, int) else None
