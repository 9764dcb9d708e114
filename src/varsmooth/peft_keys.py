"""What peft calls the parameters of an adapted model: whether a model is a peft model, and the keys peft saves each
trainable parameter under. Low-level (it imports nothing of varsmooth), so that the posterior, which is saved under
those keys, and the adapters module, which builds and loads peft models, can both use it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["import_peft", "is_peft_model", "saved_keys", "saved_names"]


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
    """Whether `model` is a peft model (adapters on a base model); False when peft is not installed."""
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
    saved = saved_keys(model, names)
    return {name: saved.get(name, name) for name in names}


def saved_keys(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """Parameter name -> key in `adapter_model.safetensors`, for the names peft saves (adapters, trained heads)."""
    from peft.utils import get_peft_model_state_dict

    # peft's own renaming, applied to numbered stand-ins so that each saved key can be traced back to its parameter
    probe = {name: torch.tensor(float(index)) for index, name in enumerate(names)}
    return {names[int(value.item())]: key for key, value in get_peft_model_state_dict(model, state_dict=probe).items()}
