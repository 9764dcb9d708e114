"""FSDP2's sharded parameters (DTensors) seen as plain tensors: the shard this process holds, the whole tensor, and a
process's part of a whole tensor."""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # a torch build without distributed support has no sharded parameters
    DTensor = ()

__all__ = ["DTensor", "full_tensor", "local_slice", "to_local"]


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's (e.g. an FSDP2 parameter's) local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into one plain tensor on every rank (a collective), else the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_slice(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole`, a tensor of the global shape of `t` (a DTensor) that every rank holds."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
