"""PEFT adapters (LoRA): the posterior over the adapter weights is saved beside the adapter, under the names peft
saves the adapter weights with, and an adapter folder or Hub repo loads back as base model + adapter + posterior.

An adapter folder written by `VariationalTrainer` holds peft's `adapter_config.json` and `adapter_model.safetensors`,
the classifier's `config.json` (labels, and e.g. how many layers of the base were kept) and `posterior.safetensors`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import BertConfig

from .peft_keys import import_peft, is_peft_model, saved_keys, saved_names

__all__ = ["ADAPTER_CONFIG_FILE", "BASE_WEIGHTS_KEY", "LoraArguments", "add_lora_adapters", "base_fingerprint",
           "has_adapter", "import_peft", "is_peft_model", "load_adapter_model", "save_classifier_config", "saved_names"]

#: peft's adapter config file: a folder (or Hub repository) holding it is loaded as LoRA adapters on their base model
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: entry of the classifier's config.json beside an adapter: SHA-256 and dtype of the base weights it was trained on
BASE_WEIGHTS_KEY = "varsmooth_base_weights"


def base_fingerprint(model: torch.nn.Module) -> dict[str, str | None]:
    """SHA-256 and dtype of the weights a peft model takes from its base model (all but the adapters and the heads
    peft saves; a head's copy from before training, `original_module`, is built anew at each load), as
    `load_adapter_model` recomputes them: an adapter belongs to the base weights it was trained on."""
    from .posterior.gaussian import weights_fingerprint

    params = dict(model.named_parameters())
    names = list(params)
    adapter = set(saved_keys(model, names))
    base = [name for name in names if name not in adapter and ".original_module." not in name]
    dtypes = sorted({str(params[name].dtype) for name in base})
    return {"sha256": weights_fingerprint(model, base), "dtype": ",".join(dtypes) or None}


def save_classifier_config(model: torch.nn.Module, folder: str) -> None:
    """Beside a peft adapter (peft saves none): the classifier's `config.json`, with its labels, architecture and
    e.g. the number of base layers kept, from which `load_adapter_model` builds the base model again, and the
    fingerprint of the base weights the adapter was trained on (`BASE_WEIGHTS_KEY`), which it checks."""
    import copy

    from .files import atomic_path

    base = model.get_base_model()
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(base).__name__]
    from .posterior.sharding import DTensor

    # sharded (FSDP2) weights would need every process to gather them, and only the main one saves: not recorded
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        setattr(config, BASE_WEIGHTS_KEY, base_fingerprint(model))
    with atomic_path(os.path.join(folder, "config.json")) as tmp:
        config.to_json_file(tmp)


def has_adapter(path: str, revision: str | None = None, token: str | None = None) -> bool:
    """Whether the folder or Hub repo `path` holds a peft adapter (its `adapter_config.json`)."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, ADAPTER_CONFIG_FILE))
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        hf_hub_download(path, ADAPTER_CONFIG_FILE, revision=revision, token=token)
    except EntryNotFoundError:
        return False
    return True


def load_adapter_model(path: str, model_class: type | None, auto_class: Any, revision: str | None = None,
                       token: str | None = None, **model_kwargs: Any) -> torch.nn.Module:
    """Base model (`base_model_name_or_path` of the adapter config) + the adapter of `path`, as a `PeftModel`.

    The base is built with the classifier's `config.json` saved beside the adapter when there is one (its labels and
    architecture), else with the base's own; `auto_class(config)` picks the class unless `model_class` is given.
    """
    peft = import_peft()
    from transformers import AutoConfig

    adapter_config = peft.PeftConfig.from_pretrained(path, revision=revision, token=token)
    base_path = adapter_config.base_model_name_or_path
    config_file = os.path.join(path, ADAPTER_CONFIG_FILE)
    if not base_path:
        raise ValueError(
            f"{config_file} names no base model (base_model_name_or_path is empty): the "
            "base was built from a config, not loaded. Load that base yourself and pass it to "
            "peft.PeftModel.from_pretrained."
        )
    if not os.path.isdir(base_path) and not _is_repo_id(base_path):
        raise FileNotFoundError(
            f"The base model of the adapter in {path} was loaded from the folder {base_path!r} "
            f"(base_model_name_or_path of {config_file}), which no longer exists. Put the base model back there, or "
            "set base_model_name_or_path to where it is now (a folder or its Hub id)."
        )
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, token=token)
    except (OSError, ValueError):  # an adapter saved without the classifier's config
        config = AutoConfig.from_pretrained(base_path)
    recorded = config.__dict__.pop(BASE_WEIGHTS_KEY, None)  # not a setting of the model
    model_class = model_class or auto_class(config)
    base = model_class.from_pretrained(base_path, config=config, **model_kwargs)
    model = peft.PeftModel.from_pretrained(base, path, revision=revision, token=token)
    if recorded is not None:
        found = base_fingerprint(model)
        if found["dtype"] != recorded.get("dtype"):
            warnings.warn(f"The base model is loaded as {found['dtype']} but the adapter in {path} was trained on "
                          f"{recorded.get('dtype')} weights: it cannot be checked that they are the same. Load it in "
                          "that dtype to check it.", UserWarning, stacklevel=3)
        elif found["sha256"] != recorded.get("sha256"):
            raise ValueError(
                f"The base model at {base_path!r} holds other weights than the adapter in {path} was trained on (their "
                "fingerprint differs): it was replaced or retrained since. The adapter and its posterior belong to the "
                "original base: load that (set base_model_name_or_path in "
                f"{config_file} to where it is), or train the adapter again on this base."
            )
    return model


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


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
    peft = import_peft()
    if r <= 0 or alpha <= 0 or not 0.0 <= dropout < 1.0:
        raise ValueError(f"Need LoRA r > 0, alpha > 0 and 0 <= dropout < 1, got r={r}, alpha={alpha}, "
                         f"dropout={dropout}.")
    if isinstance(target_modules, str):
        target_modules = [name.strip() for name in target_modules.split(",") if name.strip()]
    targets = list(target_modules) if target_modules else _lora_target_modules(model)
    heads = list(modules_to_save) if modules_to_save is not None else _classifier_names(model)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             modules_to_save=heads or None)
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
                          "Default: peft's for the model type (query,value for BERT-like and HF ViT), 'qkv' for timm "
                          "ViTs."},
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
