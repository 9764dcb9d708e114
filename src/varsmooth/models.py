"""Building classifiers for the examples: a timm architecture, any HF checkpoint, or a small model from a config."""

from __future__ import annotations

import logging
from typing import Any

import timm
import torch
from transformers import (
    AutoModelForImageClassification,
    PreTrainedModel,
    ResNetConfig,
    ResNetForImageClassification,
    TimmWrapperConfig,
    TimmWrapperForImageClassification,
)

__all__ = ["create_image_classifier", "is_timm_name"]

logger = logging.getLogger(__name__)


def is_timm_name(name: str) -> bool:
    """True for timm architectures ("resnet18", "timm/resnet18.a1_in1k"); HF ids and paths are not."""
    return name.startswith("timm/") or timm.is_model(name)


def create_image_classifier(
    model_name_or_path: str | None,
    id2label: dict[int, str],
    *,
    num_channels: int = 3,
    pretrained: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """A `PreTrainedModel` for image classification with `len(id2label)` classes.

    * `None`: a small ResNet built from a config (from scratch; works offline and for 8x8 inputs);
    * a timm name: `TimmWrapperForImageClassification` around `timm.create_model(name)`, with timm's own
      initialisation (transformers would re-initialise every layer with N(0, 0.02), hf.md §7) or, with
      `pretrained=True`, timm's pretrained weights (needs the Hub or timm's cache);
    * anything else: `AutoModelForImageClassification.from_pretrained` with a fresh head for these classes.
    """
    label2id = {v: k for k, v in id2label.items()}
    common = {"num_labels": len(id2label), "id2label": id2label, "label2id": label2id}
    if model_name_or_path is None:
        config = ResNetConfig(num_channels=num_channels, embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1],
                              layer_type="basic", downsample_in_first_stage=False, **common)
        return ResNetForImageClassification(config)
    if is_timm_name(model_name_or_path):
        architecture = model_name_or_path.removeprefix("timm/")
        config = TimmWrapperConfig(architecture=architecture, model_args={"in_chans": num_channels}, **common)
        model = TimmWrapperForImageClassification(config)
        native = timm.create_model(architecture, pretrained=pretrained, num_classes=len(id2label), in_chans=num_channels)
        model.timm_model.load_state_dict(native.state_dict())
        return model
    return AutoModelForImageClassification.from_pretrained(model_name_or_path, ignore_mismatched_sizes=True, **common, **kwargs)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
