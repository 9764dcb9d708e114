"""Extra heads that a method trains together with the model but that are not part of the saved classifier.

The heads are registered as one submodule, `model.varsmooth_aux`, so that everything the Trainer does to the
model reaches them without special cases: the optimizer (and its weight decay), device placement, DDP gradient
all-reduce, train/eval mode, gradient clipping. They are left out of `model.state_dict()` by a state-dict hook,
so `save_pretrained`, the Trainer's checkpoints and `push_to_hub` write exactly the original architecture
and `from_pretrained` loads it as a normal model; their weights travel in the method's own checkpoint state
(`method_state.pt`) instead, which makes resuming exact.

The heads run *inside* the model's forward (methods call them from forward hooks) and are tied to its
logits (`tie_to_logits`), so that DDP counts their parameters as used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..model_parts import AUX_MODULE_NAME, output_layer

__all__ = ["AUX_MODULE_NAME", "AuxiliaryHeads", "attach_heads", "output_layer", "tie_to_logits"]


def _drop_own_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]


def _ignore_own_missing_keys(module: nn.Module, incompatible_keys: Any) -> None:
    # a checkpoint of the model never holds the heads (see _drop_own_keys), so loading one must not report them
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys
                                         if AUX_MODULE_NAME not in k.split(".")]


class AuxiliaryHeads(nn.ModuleDict):
    """Method-owned heads: trained with the model, absent from its `state_dict`."""

    def __init__(self, heads: dict[str, nn.Module]) -> None:
        super().__init__(heads)
        self.register_state_dict_post_hook(_drop_own_keys)
        self.register_load_state_dict_post_hook(_ignore_own_missing_keys)

    def heads_state_dict(self) -> dict[str, torch.Tensor]:
        """The heads' parameters and buffers (what `state_dict()` deliberately leaves out), on the CPU."""
        tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return {name: t.detach().cpu().clone() for name, t in tensors.items()}

    @torch.no_grad()
    def load_heads_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        if set(state) != set(tensors):
            raise KeyError(f"Auxiliary heads mismatch: checkpoint has {sorted(state)}, model has {sorted(tensors)}.")
        for name, tensor in tensors.items():
            tensor.copy_(state[name])


def attach_heads(model: nn.Module, heads: dict[str, nn.Module]) -> AuxiliaryHeads:
    """Register `heads` as `model.varsmooth_aux`, on the device and dtype of the model's parameters."""
    if hasattr(model, AUX_MODULE_NAME):
        raise ValueError(f"The model already carries auxiliary heads ({AUX_MODULE_NAME}); attach them only once.")
    reference = next(model.parameters())
    aux = AuxiliaryHeads(heads).to(device=reference.device, dtype=reference.dtype)
    model.add_module(AUX_MODULE_NAME, aux)
    return aux


def tie_to_logits(output: Any, tensors: list[torch.Tensor]) -> Any:
    """`output` with its logits replaced by logits + 0·Σ tensors: same values, but `tensors` become reachable.

    DDP with `find_unused_parameters=True` (the Trainer's default) looks for the parameters in use by walking
    the autograd graph back from the *declared* fields of the forward's output; parameters of heads whose
    outputs are only kept aside would be marked unused, and their gradients would then arrive a second time.
    """
    anchor = 0.0 * sum(t.sum() for t in tensors)
    if isinstance(output, Mapping):
        output["logits"] = output["logits"] + anchor.to(output["logits"].dtype)
        return output
    if isinstance(output, tuple):
        return (output[0] + anchor.to(output[0].dtype), *output[1:])
    raise TypeError(f"Expected a ModelOutput, dict or tuple with the logits first, got {type(output).__name__}.")
