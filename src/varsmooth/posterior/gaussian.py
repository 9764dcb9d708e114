"""The weight posterior q = N(m, diag σ²) that IVON learns, detached from the optimizer.

The mean m is the model's own weights; this object holds σ per trainable parameter and can draw
weight samples without an optimizer, so that evaluation inside the Trainer, label-noise export and a
model reloaded from disk all sample the *same* weights for the same seed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..files import atomic_path
from ..peft_keys import saved_names
from ..presets import HESSIAN_MOVE_THRESHOLD
from .seeds import derive_seed
from .sharding import DTensor, full_tensor, local_slice, to_local

__all__ = ["POSTERIOR_FILE", "DiagonalGaussianPosterior", "hessian_movement", "non_finite_tensors", "std_summary",
           "tensors_sha256", "weights_fingerprint"]

logger = logging.getLogger(__name__)

#: the file of a saved model folder that holds the posterior's σ and its metadata (`DiagonalGaussianPosterior.save`)
POSTERIOR_FILE = "posterior.safetensors"
#: the key prefix of the tensors a file holds beside σ (`save`'s `extra`; σ's keys are parameter names, never so)
EXTRA_PREFIX = "draw_buffers/"
#: default memory for cached weight perturbations (a tiny CNN's 64 draws take a few MB; a ResNet-34's, 5 GB)
DEFAULT_CACHE_BYTES = 256 * 2**20


def weights_fingerprint(model: torch.nn.Module, names: Iterable[str]) -> str:
    """SHA-256 over the names, dtypes, shapes and raw bytes of `model`'s parameters `names` (sorted).

    It binds a saved σ to the mean weights it was learned with; it costs one pass over the weights (25M float32
    parameters, 100 MB: 0.7 s on a shared CPU core), paid at each save and load. Sharded (FSDP2 DTensor) parameters
    are gathered: every process must call it then.
    """
    params = dict(model.named_parameters())
    return tensors_sha256({name: full_tensor(params[name].detach()) for name in names})


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names (sorted), dtypes, shapes and raw bytes of `tensors` (whole, not sharded)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(tensors[name].shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy())
    return digest.hexdigest()


def non_finite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors (parameters, buffers, state-dict entries) holding a NaN or ±inf; a
    sharded (DTensor) one is checked on this process's shard. For saves and loads: one host sync per tensor."""
    return [name for name, t in named
            if t is not None and t.is_floating_point() and not bool(torch.isfinite(to_local(t.detach())).all())]


def std_summary(stds: Iterable[torch.Tensor]) -> dict[str, float]:
    """Mean and median of every entry of the posterior standard deviations `stds` (the σ numbers of training logs
    and label-noise summaries); FSDP2-sharded (DTensor) ones are gathered whole first."""
    flat = torch.cat([full_tensor(s).flatten().float() for s in stds])
    return {"posterior_std_mean": flat.mean().item(), "posterior_std_median": flat.median().item()}


def hessian_movement(hess: torch.Tensor, hess_init: float, beta2: float | None = None, step: int | None = None,
                     tolerance: float = HESSIAN_MOVE_THRESHOLD) -> dict[str, float]:
    """How far IVON's Hessian h (all weights, flat) moved, and how much of that the data did.

    `hess_change_median`: the median of |h − h0|/h0 (0: σ is still its initial 1/sqrt(ess·(h0 + δ))). Its moving
    average takes h0 to `hess_decayed` = h0·β2^step when the Hessian estimates add nothing, so a change up to there is
    h0 forgotten, not curvature learned; `hess_data_share` (with `beta2` and `step`) is the share of weights whose h
    ends at least `tolerance` of that value away from it: those whose σ the data set."""
    hess = hess.double()
    movement = {"hess_change_median": ((hess - hess_init).abs().median() / hess_init).item()}
    if beta2 is not None and step is not None:
        decayed = hess_init * beta2**step
        learned = (hess - decayed).abs() >= tolerance * decayed
        movement.update(hess_decayed=decayed, hess_data_share=learned.double().mean().item())
    return movement


class DiagonalGaussianPosterior:
    """q(θ) = N(m, diag σ²) over the named parameters of `model` (Variational Learning Induces Adaptive Label
    Smoothing (2025), Eq. 6, with IVON's q).

    Args:
        model: the network; its current weights are the posterior mean m.
        std: parameter name -> σ (same shape as the parameter). Parameters not listed are deterministic.
        metadata: JSON-safe facts about how σ was obtained (ess, prior precision, hess_init, ...).
        cache_bytes: memory for keeping drawn perturbations σ⊙e (σ is fixed for the object's lifetime).

    How a prediction scales and uses the draws (the posterior temperature τ, each draw's BatchNorm statistics) is the
    predictor's (`varsmooth.prediction.PosteriorPredictor`), which saves them in the same file (`save`'s `extra`).
    """

    def __init__(self, model: torch.nn.Module, std: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, Any] | None = None,
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
        self.cache_bytes = cache_bytes
        self._cache: dict[int, list[torch.Tensor]] = {}
        self._cache_used = 0
        self._fingerprint: str | None = None  # set by `gathered`

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_ivon(cls, model: torch.nn.Module, optimizer: Any, names: list[str],
                  metadata: Mapping[str, Any] | None = None) -> "DiagonalGaussianPosterior":
        """σ = 1/sqrt(ess·(h+δ)) read from a `VariationalIVON` whose parameters are `names` of `model`."""
        stds = optimizer.posterior_std()
        if len(stds) != len(names):
            raise ValueError(f"IVON holds {len(stds)} parameters but {len(names)} names were given.")
        return cls(model, dict(zip(names, stds)), metadata)

    @classmethod
    def point_mass(cls, model: torch.nn.Module) -> "DiagonalGaussianPosterior":
        """A point mass at the current weights: sampling returns the mean (used when no posterior exists)."""
        return cls(model, {}, {"kind": "point_mass"})

    @classmethod
    def load(cls, model: torch.nn.Module, path: str | os.PathLike) -> "DiagonalGaussianPosterior":
        """Read σ saved by `save` for `model`, whose current weights must be the ones σ was saved with (`read`, without
        what the file holds beside σ)."""
        return cls.read(model, path)[0]

    @classmethod
    def read(cls, model: torch.nn.Module, path: str | os.PathLike,
             ) -> tuple["DiagonalGaussianPosterior", dict[str, torch.Tensor]]:
        """(σ saved by `save` for `model`, the tensors saved beside it under `EXTRA_PREFIX`, by their names without the
        prefix); `model`'s current weights must be the ones σ was saved with.

        Refuses (naming the file) a file that differs from its folder's manifest (edited after the save), is
        unreadable, holds other σ than the hash it records of its own tensors (σ rewritten, even with its metadata
        kept and without the manifest), covers other parameters than it recorded, holds no σ or a σ that is not
        finite and positive, or belongs to other weights than `model`'s (fingerprint mismatch).
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, POSTERIOR_FILE)
        from ..files import check_manifest

        # σ scaled, τ edited, a file of another save: refused by its hash, before it is read
        check_manifest(os.path.dirname(os.path.abspath(path)), [os.path.basename(path)])
        try:
            with safe_open(path, framework="pt") as f:
                raw = f.metadata() or {}
                tensors = {key: f.get_tensor(key) for key in f.keys()}
            metadata = json.loads(raw.get("varsmooth", "{}"))
        except FileNotFoundError:
            raise
        except Exception as error:  # safetensors raises its own error types for truncated or garbled files
            raise ValueError(
                f"{path} cannot be read ({type(error).__name__}: {error}): the file is truncated or corrupted. "
                "Save the model again (trainer.save_model()), or delete the file to predict at the weights."
            ) from error
        std = {key: t for key, t in tensors.items() if not key.startswith(EXTRA_PREFIX)}
        extra = {key[len(EXTRA_PREFIX):]: t for key, t in tensors.items() if key.startswith(EXTRA_PREFIX)}
        _check_std(path, std, metadata)
        # the hash covers every tensor of the file: σ and what was saved beside it
        if "std_sha256" in metadata and tensors_sha256(tensors) != metadata["std_sha256"]:
            raise ValueError(
                f"{path} holds other standard deviations than the ones it was saved with (the SHA-256 of its tensors, "
                "σ and what was saved beside it, such as the draws' statistics, "
                "differs from the one its metadata records): σ was rewritten after the save, and would sample another "
                "posterior than the one trained. Save the model again (trainer.save_model()), or delete the file to "
                "predict at the weights."
            )
        # an adapter's posterior is keyed as peft keys the adapter weights (`saved_names`): back to the model's names
        model_name = {saved: name for name, saved in saved_names(model, dict(model.named_parameters())).items()}
        std = {model_name.get(key, key): s for key, s in std.items()}
        posterior = cls(model, std, metadata)
        posterior._check_weights(path)
        return posterior, extra

    def _check_weights(self, path: str) -> None:
        expected = self.metadata.get("weights_sha256")
        if expected is None:
            warnings.warn(f"{path} records no fingerprint of its weights (saved by an older varsmooth): it cannot be "
                          "checked that σ belongs to these weights. Save the model again to record one.",
                          UserWarning, stacklevel=3)
            return
        params = dict(self.model.named_parameters())
        dtypes = {str(params[name].dtype) for name in self.names}
        if dtypes != {self.metadata.get("weights_dtype")}:
            warnings.warn(f"The weights are {sorted(dtypes)} but {path} was saved for "
                          f"{self.metadata.get('weights_dtype')} weights: their fingerprint cannot be checked. Load "
                          "the model in that dtype to check it.", UserWarning, stacklevel=3)
            return
        if weights_fingerprint(self.model, self.names) != expected:
            raise ValueError(
                f"{path} belongs to other weights than the model's (their fingerprint differs): the weights were "
                "replaced after the posterior was saved (a later run saved into the same folder, an interrupted save, "
                "an edited file). Save weights and posterior together again (trainer.save_model()), or delete "
                f"{POSTERIOR_FILE} to predict at the weights."
            )

    def gathered(self) -> "DiagonalGaussianPosterior":
        """This posterior with whole σ and the weights' fingerprint taken now, for one process to `save` alone: for
        sharded (FSDP2 DTensor) parameters this gathers, and every process must call it. (Sample from the original.)"""
        out = copy.copy(self)
        out.std = {name: full_tensor(s.detach()) for name, s in self.std.items()}
        out._fingerprint = weights_fingerprint(self.model, self.names)
        out._cache, out._cache_used = {}, 0
        return out

    def save(self, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None,
             extra: Mapping[str, torch.Tensor] | None = None) -> str:
        """Write σ as safetensors (whole file or nothing) with the metadata, and `metadata` besides, as JSON; `extra`
        tensors (a prediction's, `read` gives them back) are saved beside σ, under `EXTRA_PREFIX`. Sharded σ and
        weights are gathered (a collective): in an FSDP run, every process calls `gathered()` and the main one saves
        that."""
        if os.path.isdir(path):
            path = os.path.join(path, POSTERIOR_FILE)

        # an adapter's σ under the keys of the adapter weights in peft's adapter_model.safetensors
        key = saved_names(self.model, self.names)
        # IVON's parameters are views of one flat storage: clone so safetensors accepts them.
        tensors = {key[name]: full_tensor(s.detach()).to("cpu").clone().contiguous() for name, s in self.std.items()}
        tensors.update({f"{EXTRA_PREFIX}{name}": t.detach().to("cpu").contiguous()
                        for name, t in (extra or {}).items()})
        params = dict(self.model.named_parameters())
        fingerprint = (self._fingerprint if self._fingerprint is not None
                       else weights_fingerprint(self.model, self.names))
        binding = {"parameters": [key[name] for name in self.names], "weights_sha256": fingerprint,
                   "weights_dtype": str(params[self.names[0]].dtype) if self.names else None,
                   "std_sha256": tensors_sha256(tensors)}
        bad = non_finite_tensors(tensors.items())
        if bad:
            raise FloatingPointError(f"Not saving {path}: the posterior standard deviations of {bad[:5]} are not "
                                     "finite (NaN or inf); nothing was written. Save a posterior with finite σ (e.g. "
                                     "loaded from an earlier save).")
        # one metadata entry: safetensors writes several in a random order, and identical runs would differ in bytes
        with atomic_path(path) as tmp:
            save_file(tensors, tmp,
                      metadata={"varsmooth": json.dumps({**self.metadata, **(metadata or {}), **binding})})
        return str(path)

    # -- sampling ----------------------------------------------------------------------------------
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
            e = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):  # every rank draws e whole and keeps its shard of σ⊙e: one global draw
                perturbation.append(local_slice(p, e) * to_local(self.std[name]))
            else:
                perturbation.append(e * self.std[name])
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
    def sampled(self, seed: int, mirrored: bool = False, scale: float = 1.0) -> Iterator[None]:
        """Set the model's weights to θ = m + scale·σ⊙e, e ~ N(0, I) drawn from `seed` (θ = m − scale·σ⊙e, the
        antithetic twin, with `mirrored`); restore m on exit, always. `scale` is a prediction's posterior temperature
        τ (1: the learned posterior).

        The draw depends on the seed, the parameter order and the device only — not on batch size or on
        the global RNG — so the s-th sample of an evaluation is the same model on every batch.
        """
        sharded = any(isinstance(s, DTensor) for s in self.std.values())
        if sharded:  # after a forward FSDP2 registers its gathered weights as the parameters, until it reshards
            _reshard(self.model)
        params = dict(self.model.named_parameters())
        saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            with torch.no_grad():
                signed = -scale if mirrored else scale
                for name, delta in zip(self.names, self._perturbation(seed, params)):
                    p = params[name]
                    delta = delta if signed == 1.0 else signed * delta
                    if isinstance(p, DTensor):  # FSDP2 gathers from the shard's storage: change it in place
                        saved.append((p, to_local(p).clone()))
                        to_local(p).add_(delta)
                        continue
                    saved.append((p, p.data))
                    # the cache holds σ⊙e: the scale is applied here, so another τ reuses the same draws e
                    p.data = p.data + delta
            yield
        finally:
            with torch.no_grad():
                for p, mean in saved:
                    if isinstance(p, DTensor):
                        to_local(p).copy_(mean)
                    else:
                        p.data = mean
            if sharded:  # the forwards gathered the sample: the next one must gather the mean
                _reshard(self.model)

    def summary(self) -> dict[str, float]:
        """σ's mean and median, and, when the metadata records IVON's ess, hess_init and weight_decay (δ), how far
        the Hessian behind σ (h = 1/(ess σ²) − δ) moved from h0 and, with β2 and the step count, how much of that
        the data did (`hessian_movement`): near 0, σ was never learned. A σ sharded by FSDP2 is gathered: every
        process must call it then."""
        if self.is_point_mass:
            return {}
        summary = std_summary(self.std.values())
        meta = self.metadata
        if all(isinstance(meta.get(k), (int, float)) for k in ("ess", "hess_init", "weight_decay")):
            flat = torch.cat([full_tensor(s).flatten().double() for s in self.std.values()])
            hess = 1.0 / (meta["ess"] * flat.square()) - meta["weight_decay"]
            decay = {k: meta[k] for k in ("beta2", "step") if isinstance(meta.get(k), (int, float))}
            summary.update(hessian_movement(hess, meta["hess_init"], **decay))
        return summary


def _reshard(model: torch.nn.Module) -> None:
    """Drop the gathered weights FSDP2 keeps after a forward without backward (the root module's, always), so the
    next forward gathers the shards again: after their weights changed in place it would use the old ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _check_std(path: str, std: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    if not std:
        raise ValueError(
            f"{path} holds no standard deviations: it is empty or was written without a posterior. Delete it to "
            "predict at the weights (VariationalModel then warns that there is no posterior), or save the model again."
        )
    recorded = metadata.get("parameters")
    if recorded is not None and set(recorded) != set(std):
        missing = sorted(set(recorded) - set(std))
        extra = sorted(set(std) - set(recorded))
        raise ValueError(
            f"{path} does not cover the parameters it was saved for: {len(missing)} missing {missing[:3]}, "
            f"{len(extra)} unexpected {extra[:3]}. Those weights would silently be deterministic: the file was edited "
            "or mixed from two saves. Save the model again (trainer.save_model())."
        )
    for name, s in std.items():
        if not torch.isfinite(s).all() or not (s > 0).all():
            bad = "non-finite" if not torch.isfinite(s).all() else "zero or negative"
            raise ValueError(
                f"{path} has a {bad} standard deviation for {name!r}: σ must be finite and > 0. Training diverged "
                "before the save, or the file was edited. Save again from a healthy run."
            )
