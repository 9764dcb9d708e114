"""ivon-opt's layout of IVON's state (its `IVON.state_dict()`, and what `VariationalIVON` wrote before it had an engine
of its own): one flat `hess` and `momentum` vector per param group, split here into the per-parameter state of
`VariationalIVON`, so that a run of either continues where it stopped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["is_flat_layout", "per_parameter_state"]


def is_flat_layout(state_dict: dict[str, Any]) -> bool:
    """Whether `state_dict` is in ivon-opt's layout (a sample count in its state, vectors in its param groups)."""
    return "count" in state_dict["state"] or any("hess" in g for g in state_dict["param_groups"])


def per_parameter_state(state_dict: dict[str, Any],
                        param_groups: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], int | None]:
    """`state_dict` of ivon-opt's layout as the state dict of an optimizer holding `param_groups`, and its step."""
    old_state, state, groups = state_dict["state"], {}, []
    if old_state.get("count", 0):
        raise ValueError("The IVON checkpoint holds gradient samples not yet used by a step; save after step().")
    if len(state_dict["param_groups"]) != len(param_groups):
        raise ValueError(f"The IVON checkpoint has {len(state_dict['param_groups'])} param groups, this optimizer "
                         f"{len(param_groups)}: it was written for another model or parameter grouping.")
    for saved, group in zip(state_dict["param_groups"], param_groups):
        saved = {k: v for k, v in saved.items() if k != "numel"}
        hess, momentum, numel = saved.pop("hess"), saved.pop("momentum"), sum(p.numel() for p in group["params"])
        if len(saved["params"]) != len(group["params"]) or hess.numel() != numel or momentum.numel() != numel:
            raise ValueError(f"The IVON checkpoint's param group holds {len(saved['params'])} parameters with "
                             f"{hess.numel()} values, this optimizer's {len(group['params'])} with {numel}: it was "
                             "written for another model.")
        ends = torch.tensor([p.numel() for p in group["params"]]).cumsum(0).tolist()
        for index, p, end in zip(saved["params"], group["params"], ends):
            state[index] = {"momentum": momentum[end - p.numel():end].view(p.shape),
                            "hess": hess[end - p.numel():end].view(p.shape)}
        groups.append(saved)
    return {"state": state, "param_groups": groups}, old_state.get("current_step")
