"""IVON's state from a checkpoint: its optimizer.pt, or, in a checkpoint saved without optimizer state
(`save_only_model=True`), the posterior saved beside its weights."""

from __future__ import annotations

import os

import torch

from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior
from .optimizer import VariationalIVON

__all__ = ["load_ivon_state", "restore_ivon_from_posterior"]


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
    optimizer.restore_from_posterior([posterior.std[name] for name in param_names],
                                     step=int(posterior.metadata.get("step", default_step)))
