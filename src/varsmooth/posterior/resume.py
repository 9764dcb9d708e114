"""IVON's state from a checkpoint: its optimizer.pt, or, in a checkpoint saved without optimizer state
(`save_only_model=True`), the posterior saved beside its weights (`ivon_state_from_posterior`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior
from .optimizer import VariationalIVON
from .settings import USER_NAMES
from .sharding import DTensor

__all__ = ["RESUMED_SETTINGS", "ivon_state_from_posterior", "load_ivon_state", "restore_ivon_from_posterior",
           "resumed_settings"]

#: IVON's settings its optimizer state carries (param group key -> the user's name): a resume from optimizer.pt trains
#: on with the checkpoint's values of these, whatever the resuming run asked (the peak learning rate, `initial_lr`,
#: through the scheduler's state too)
RESUMED_SETTINGS = {**{key: USER_NAMES.get(key, key)
                       for key in ("ess", "hess_init", "beta1", "beta2", "weight_decay", "clip_radius")},
                    "initial_lr": USER_NAMES["lr"]}


def load_ivon_state(optimizer: VariationalIVON, model: torch.nn.Module, checkpoint: str, param_names: list[str],
                    default_step: int) -> str:
    """Load IVON's state from `checkpoint`'s optimizer.pt, else restore it from its posterior
    (`restore_ivon_from_posterior`); returns the name of the file it came from."""
    path = os.path.join(checkpoint, "optimizer.pt")
    if os.path.isfile(path):
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return "optimizer.pt"
    restore_ivon_from_posterior(optimizer, model, checkpoint, param_names, default_step)
    return POSTERIOR_FILE


def restore_ivon_from_posterior(optimizer: VariationalIVON, model: torch.nn.Module, checkpoint: str,
                                param_names: list[str], default_step: int) -> None:
    """Set IVON's Hessian to h = 1/(ess σ²) − δ (the inverse of σ = 1/sqrt(ess (h + δ))) and its step count from the
    posterior saved in `checkpoint` for the weights just loaded from it into `model` (the unwrapped network).

    param_names: the names of IVON's parameters in `param_groups` order; default_step: the step count when the
    posterior records none."""
    path = os.path.join(checkpoint, POSTERIOR_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"Cannot resume IVON from {checkpoint}: it has neither optimizer.pt nor {POSTERIOR_FILE}, so the "
            "posterior (IVON's Hessian) would silently restart from hess_init. Resume from a checkpoint saved with "
            "save_only_model=False, or start a new run."
        )
    posterior = DiagonalGaussianPosterior.load(model, path)
    if set(posterior.names) != set(param_names):
        raise ValueError(
            f"{path} covers {len(posterior.names)} parameters but IVON trains {len(param_names)}: the "
            "checkpoint was saved with other trainable parameters. Freeze the same parameters as in that run."
        )
    optimizer.load_state_dict(ivon_state_from_posterior(optimizer, [posterior.std[name] for name in param_names],
                                                        int(posterior.metadata.get("step", default_step))))


def ivon_state_from_posterior(optimizer: VariationalIVON, stds: list[torch.Tensor], step: int) -> dict[str, Any]:
    """The state dict of `optimizer` at the posterior of std `stds` (in `param_groups` order, whole parameters): the
    Hessian h = 1/(ess σ²) − δ, σ = 1/sqrt(ess (h + δ)) inverted, zero momentum and step count `step`."""
    state_dict = optimizer.state_dict()
    indexed = [(group, index) for group in state_dict["param_groups"] for index in group["params"]]
    if len(stds) != len(indexed):
        raise ValueError(f"Got {len(stds)} posterior stds for the {len(indexed)} parameters IVON trains.")
    for (group, index), std in zip(indexed, stds):
        hess = state_dict["state"][index]["hess"]
        if isinstance(hess, DTensor) or tuple(std.shape) != tuple(hess.shape):
            raise ValueError(f"A posterior std of shape {tuple(std.shape)} cannot restore IVON's Hessian of shape "
                             f"{tuple(hess.shape)}{' (sharded)' if isinstance(hess, DTensor) else ''}.")
        std = std.to(hess)
        state_dict["state"][index] = {"momentum": torch.zeros_like(std), "hess": (
            1.0 / (group["ess"] * std.square()) - group["weight_decay"]).clamp_min(0.0)}
        group["current_step"] = step
    return state_dict


def resumed_settings(used: Mapping[str, Any], asked: Mapping[str, Any], derived: set[str],
                     checkpoint: str) -> dict[str, Any]:
    """The checkpoint's values (by the user's names) of the settings the resuming run left to be `derived` (user's
    names) and got other values of: `used` is IVON's first param group after its state was loaded from `checkpoint`,
    `asked` the same group before. A setting given another value than the checkpoint's is refused: IVON's state would
    continue with the checkpoint's while the run reported this one's."""
    differ = {key: (used[key], asked[key]) for key in RESUMED_SETTINGS
              if key in used and key in asked and not math.isclose(used[key], asked[key], rel_tol=1e-9)}
    refused = {RESUMED_SETTINGS[key]: values for key, values in differ.items() if RESUMED_SETTINGS[key] not in derived}
    if refused:
        given = ", ".join(f"{name}={new!r} (the checkpoint's: {old!r})" for name, (old, new) in refused.items())
        keep = ", ".join(f"{name}={old!r}" for name, (old, _) in refused.items())
        raise ValueError(
            f"Resuming {checkpoint} with other IVON settings than it was trained with: {given}. IVON's state would "
            f"continue with the checkpoint's while the run reports these. Pass {keep} to resume it, or start a new "
            "run (train() without resume_from_checkpoint, in another output_dir) to train with the new settings."
        )
    return {RESUMED_SETTINGS[key]: old for key, (old, _) in differ.items()}
