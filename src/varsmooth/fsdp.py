"""FSDP2 with a model the user sharded beforehand, the README's workaround for accelerate's own FSDP2 preparation."""

from typing import Any

import torch


def keep_presharded_model(fsdp_plugin: Any, model: torch.nn.Module | None) -> None:
    """Turns off `fsdp_plugin`'s wrap policy when `model` is already an FSDP2 module (`fully_shard`).

    accelerate (1.15) resolves a transformer-based wrap policy by class name before it notices that the model is
    already sharded and keeps it as it is; `fully_shard` renamed those classes (`ViTLayer` became `FSDPViTLayer`), so
    the lookup fails with "Could not find the transformer layer class ViTLayer". A policy has nothing left to wrap."""
    from torch.distributed.fsdp import FSDPModule

    if fsdp_plugin is not None and isinstance(model, FSDPModule):
        fsdp_plugin.auto_wrap_policy = None
