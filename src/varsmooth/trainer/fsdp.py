"""FSDP2 through accelerate's own preparation, which fails on HF's ViT, BERT and ResNet (accelerate 1.15,
`benchmarks/accelerate_fsdp2_repro.py`), and with a model the user sharded beforehand."""

import contextlib
from collections.abc import Iterator
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


@contextlib.contextmanager
def shardable_by_accelerate(accelerator: Any, model: torch.nn.Module | None) -> Iterator[None]:
    """Within it, an HF model is one that `accelerator.prepare` can shard with FSDP2 as it is, with all the plugin's
    settings (wrap policy, mixed precision, offload, rank 0's weights under `cpu_ram_efficient_loading`). Outside
    FSDP2, or for a model sharded beforehand, nothing changes.

    accelerate (1.15) fails in three places on HF's image and text classifiers (`benchmarks/accelerate_fsdp2_repro.py`):

    * after the modules its wrap policy picks, it shards `get_input_embeddings()` as a unit of its own; ViT's and
      BERT's embeddings sit inside a module the policy has sharded already (`ViTEmbeddings` and `BertEmbeddings` are
      in `_no_split_modules`), and `fully_shard` fails on their DTensor parameters. Here the method answers None for
      them: they stay in the unit around them;
    * ResNet has no input embeddings, and transformers raises NotImplementedError: None here too;
    * with `cpu_ram_efficient_loading` (`accelerate launch`'s default) it broadcasts rank 0's state dict as if every
      entry were a sharded parameter, failing on the buffers (BatchNorm's statistics: "'Tensor' object has no
      attribute 'device_mesh'"). For a model with buffers in its state dict, rank 0's weights and buffers are
      broadcast here instead, whole, and the plugin's efficient loading is off while accelerate prepares the model."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if getattr(fsdp_plugin, "fsdp_version", 1) != 2 or isinstance(model, FSDPModule):
        yield
        return
    with contextlib.ExitStack() as stack:
        if hasattr(model, "get_input_embeddings"):
            stack.enter_context(_embeddings_accelerate_can_shard(model))
        if fsdp_plugin.cpu_ram_efficient_loading and _has_persistent_buffers(model):
            stack.enter_context(_weights_from_rank_0(model, fsdp_plugin, accelerator.device))
        yield


def _has_persistent_buffers(model: torch.nn.Module) -> bool:
    return any(name not in module._non_persistent_buffers_set
               for module in model.modules() for name, _ in module.named_buffers(recurse=False))


@contextlib.contextmanager
def _embeddings_accelerate_can_shard(model: torch.nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    own = model.get_input_embeddings

    def embeddings() -> torch.nn.Module | None:
        try:
            module = own()
        except NotImplementedError:
            return None
        if module is None or isinstance(module, FSDPModule):
            return module
        return None if any(isinstance(p, DTensor) for p in module.parameters()) else module

    model.get_input_embeddings = embeddings  # an attribute of the instance hides the class's method
    try:
        yield
    finally:
        del model.get_input_embeddings


@contextlib.contextmanager
def _weights_from_rank_0(model: torch.nn.Module, fsdp_plugin: Any, device: torch.device) -> Iterator[None]:
    import torch.distributed as dist

    shared: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and id(tensor) not in shared:
                    shared[id(tensor)] = _from_rank_0(tensor, device, dist)
                if tensor is not None:
                    store[name] = shared[id(tensor)]
    fsdp_plugin.cpu_ram_efficient_loading = False
    try:
        yield
    finally:
        fsdp_plugin.cpu_ram_efficient_loading = True


def _from_rank_0(tensor: torch.Tensor, device: torch.device, dist: Any) -> torch.Tensor:
    """Rank 0's `tensor` on every rank: the same tensor holding it, so an optimizer built on it still holds it; a new
    one on the ranks where transformers' efficient loading left it on the meta device, which cannot hold data."""
    value = tensor.detach().to(device) if dist.get_rank() == 0 else torch.empty_like(tensor, device=device)
    dist.broadcast(value, src=0)
    if not tensor.is_meta:
        tensor.data = value
        return tensor
    return torch.nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else value
