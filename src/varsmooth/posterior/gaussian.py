"""The weight posterior q = N(m, diag σ²) that IVON learns, detached from the optimizer.

The mean m is the model's own weights; this object holds σ per trainable parameter and can draw
weight samples without an optimizer, so that evaluation inside the Trainer, label-noise export and a
model reloaded from disk all sample the *same* weights for the same seed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..utils import atomic_path
from .ivon import derive_seed

__all__ = ["POSTERIOR_FILE", "DiagonalGaussianPosterior"]

logger = logging.getLogger(__name__)

POSTERIOR_FILE = "posterior.safetensors"
#: metadata key of the posterior temperature τ (σ is scaled by τ when sampling; absent means 1)
TEMPERATURE_KEY = "posterior_temperature"
#: default memory for cached weight perturbations (a tiny CNN's 64 draws take a few MB; a ResNet-34's, 5 GB)
DEFAULT_CACHE_BYTES = 256 * 2**20


class DiagonalGaussianPosterior:
    """q(θ) = N(m, diag σ²) over the named parameters of `model` (seed 000, Eq. 6 with IVON's q).

    Args:
        model: the network; its current weights are the posterior mean m.
        std: parameter name -> σ (same shape as the parameter). Parameters not listed are deterministic.
        metadata: JSON-safe facts about how σ was obtained (ess, prior precision, hess_init, ...). Its
            `"posterior_temperature"` entry is the temperature τ (see `temperature`).
        cache_bytes: memory for keeping drawn perturbations σ⊙e (σ is fixed for the object's lifetime).
    """

    def __init__(self, model: torch.nn.Module, std: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        params = dict(model.named_parameters())
        missing = [name for name in std if name not in params]
        if missing:
            raise ValueError(
                f"The posterior has standard deviations for parameters the model does not have: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}. Load it into the architecture it was trained with."
            )
        for name, s in std.items():
            if tuple(s.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"Posterior std of {name!r} has shape {tuple(s.shape)} but the model parameter has shape "
                    f"{tuple(params[name].shape)}: the posterior file does not belong to this model."
                )
        self.model = model
        # the model's parameter order, not the mapping's (safetensors sorts keys): it fixes which noise each draws
        self.names = [name for name in params if name in std]
        self.std = {name: std[name].detach().to(params[name].device, params[name].dtype) for name in self.names}
        self.metadata = dict(metadata or {})
        _check_temperature(self.metadata.get(TEMPERATURE_KEY, 1.0))
        self.cache_bytes = cache_bytes
        self._cache: dict[int, list[torch.Tensor]] = {}
        self._cache_used = 0

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_ivon(cls, model: torch.nn.Module, optimizer: Any, names: list[str], metadata: Mapping[str, Any] | None = None) -> "DiagonalGaussianPosterior":
        """σ = 1/sqrt(ess·(h+δ)) read from a `VariationalIVON` whose parameters are `names` of `model`."""
        stds = optimizer.posterior_std()
        if len(stds) != len(names):
            raise ValueError(f"IVON holds {len(stds)} parameters but {len(names)} names were given.")
        return cls(model, dict(zip(names, stds)), metadata)

    @classmethod
    def zero(cls, model: torch.nn.Module) -> "DiagonalGaussianPosterior":
        """A point mass at the current weights: sampling returns the mean (used when no posterior exists)."""
        return cls(model, {}, {"kind": "point_mass"})

    @classmethod
    def load(cls, model: torch.nn.Module, path: str | os.PathLike) -> "DiagonalGaussianPosterior":
        if os.path.isdir(path):
            path = os.path.join(path, POSTERIOR_FILE)
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
            std = {key: f.get_tensor(key) for key in f.keys()}
        metadata = json.loads(raw.get("varsmooth", "{}"))
        return cls(model, std, metadata)

    def save(self, path: str | os.PathLike) -> str:
        """Write σ as safetensors (whole file or nothing) with the metadata as JSON."""
        if os.path.isdir(path):
            path = os.path.join(path, POSTERIOR_FILE)
        # IVON's parameters are views of one flat storage: clone so safetensors accepts them.
        tensors = {name: s.detach().to("cpu").clone().contiguous() for name, s in self.std.items()}
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata={"format": "pt", "varsmooth": json.dumps(self.metadata)})
        return str(path)

    # -- sampling ----------------------------------------------------------------------------------
    @property
    def temperature(self) -> float:
        """τ ≥ 0: draws are θ = m + τ·σ⊙e, so τ = 0 predicts at the mean and τ = 1 with the learned posterior.

        Kept in `metadata`, so that it is saved and loaded with σ (`varsmooth.posterior.temperature` chooses it).
        """
        return float(self.metadata.get(TEMPERATURE_KEY, 1.0))

    @temperature.setter
    def temperature(self, value: float) -> None:
        _check_temperature(value)
        self.metadata[TEMPERATURE_KEY] = float(value)

    @property
    def is_point_mass(self) -> bool:
        return not self.std

    def _perturbation(self, seed: int, params: dict[str, torch.nn.Parameter]) -> list[torch.Tensor]:
        """σ⊙e for the draw `seed`, one tensor per name; kept while the cache budget allows, since evaluation and
        label-noise export ask for the same S draws on every batch and drawing e costs as much as a forward pass."""
        self._follow_parameters(params)
        cached = self._cache.get(seed)
        if cached is not None:
            return cached
        generators: dict[torch.device, torch.Generator] = {}
        perturbation = []
        for index, name in enumerate(self.names):
            p = params[name]
            gen = generators.setdefault(p.device, torch.Generator(device=p.device))
            gen.manual_seed(derive_seed(seed, index))
            perturbation.append(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * self.std[name])
        size = sum(t.numel() * t.element_size() for t in perturbation)
        if self._cache_used + size <= self.cache_bytes:
            self._cache[seed] = perturbation
            self._cache_used += size
        return perturbation

    def _follow_parameters(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Move σ to wherever (and whatever dtype) the model's parameters are now: a pipeline or `model.to(...)` may
        move the model after the posterior was loaded; cached draws on the old device are dropped."""
        moved = False
        for name in self.names:
            p = params[name]
            if self.std[name].device != p.device or self.std[name].dtype != p.dtype:
                self.std[name] = self.std[name].to(p.device, p.dtype)
                moved = True
        if moved:
            self._cache.clear()
            self._cache_used = 0

    @contextlib.contextmanager
    def sampled(self, seed: int) -> Iterator[None]:
        """Set the model's weights to θ = m + σ⊙e, e ~ N(0, I) drawn from `seed`; restore m on exit, always.

        The draw depends on the seed, the parameter order and the device only — not on batch size or on
        the global RNG — so the s-th sample of an evaluation is the same model on every batch.
        """
        params = dict(self.model.named_parameters())
        saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            with torch.no_grad():
                temperature = self.temperature
                for name, delta in zip(self.names, self._perturbation(seed, params)):
                    p = params[name]
                    saved.append((p, p.data))
                    # the cache holds σ⊙e: τ is applied here, so changing τ reuses the same draws e
                    p.data = p.data + (delta if temperature == 1.0 else temperature * delta)
            yield
        finally:
            for p, mean in saved:
                p.data = mean

    def summary(self) -> dict[str, float]:
        if self.is_point_mass:
            return {}
        flat = torch.cat([s.flatten().float() for s in self.std.values()])
        return {"posterior_std_mean": flat.mean().item(), "posterior_std_median": flat.median().item(),
                TEMPERATURE_KEY: self.temperature}


def _check_temperature(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"The posterior temperature must be a finite number >= 0 (0 = the posterior mean, 1 = the learned "
            f"posterior), got {value!r}."
        )
