"""PEFT adapters (LoRA): the posterior over the adapter weights is saved beside the adapter, under the names peft
saves the adapter weights with, and an adapter folder or Hub repo loads back as base model + adapter + posterior.

An adapter folder written by `VariationalTrainer` holds peft's `adapter_config.json` and `adapter_model.safetensors`,
the classifier's `config.json` (labels, and e.g. how many layers of the base were kept) and `posterior.safetensors`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ADAPTER_CONFIG_FILE", "has_adapter", "import_peft", "is_peft_model", "load_adapter_model", "save_classifier_config",
           "saved_names"]

ADAPTER_CONFIG_FILE = "adapter_config.json"


def import_peft() -> Any:
    """The peft package, or an ImportError naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            "LoRA adapters need the peft package, which is not installed: pip install 'varsmooth[lora]' (or pip "
            "install peft)."
        ) from None
    return peft


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def saved_names(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Parameter name -> the key peft saves it under in `adapter_model.safetensors` (without the adapter name:
    `...query.lora_A.default.weight` -> `...query.lora_A.weight`, `classifier.modules_to_save.default.weight` ->
    `classifier.weight`); names of other models, and names peft does not save, map to themselves."""
    names = list(names)
    if not is_peft_model(model):
        return {name: name for name in names}
    from peft.utils import get_peft_model_state_dict

    # peft's own renaming, applied to numbered stand-ins so that each saved key can be traced back to its parameter
    probe = {name: torch.tensor(float(index)) for index, name in enumerate(names)}
    saved = {int(value.item()): key for key, value in get_peft_model_state_dict(model, state_dict=probe).items()}
    return {name: saved.get(index, name) for index, name in enumerate(names)}


def save_classifier_config(model: torch.nn.Module, folder: str) -> None:
    """Beside a peft adapter (peft saves none): the classifier's `config.json`, with its labels, architecture and
    e.g. the number of base layers kept, from which `load_adapter_model` builds the base model again."""
    import copy

    from .utils import atomic_path

    base = model.get_base_model()
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(base).__name__]
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
    if not base_path:
        raise ValueError(
            f"{os.path.join(path, ADAPTER_CONFIG_FILE)} names no base model (base_model_name_or_path is empty): the "
            "base was built from a config, not loaded. Load that base yourself and pass it to peft.PeftModel.from_pretrained."
        )
    try:
        config = AutoConfig.from_pretrained(path, revision=revision, token=token)
    except (OSError, ValueError):  # an adapter saved without the classifier's config
        config = AutoConfig.from_pretrained(base_path)
    model_class = model_class or auto_class(config)
    base = model_class.from_pretrained(base_path, config=config, **model_kwargs)
    return peft.PeftModel.from_pretrained(base, path, revision=revision, token=token)
