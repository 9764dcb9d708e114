"""IVON (ivon-opt) made safe for `transformers.Trainer`.

ivon-opt 0.1.3 is used as is for the update (seed 000, Alg. 1); this subclass only fixes what a
Trainer integration needs (research notes ivon.md §0):

* `current_step` (the momentum debiasing counter) travels in `state_dict()`, and `hess`/`momentum`
  are moved back to the parameters' device and dtype on load, so checkpoint resume is exact;
* the weight noise comes from a dedicated generator seeded by (seed, rank, step, draw), so training is
  reproducible, resumes exactly without touching the global RNG, and DDP ranks draw independent
  samples (scheme (i) of ivon.md §4.2);
* `sampled_params` restores the mean weights if the body raises, and treats a trainable parameter
  that got no gradient as a zero gradient instead of crashing (ivon-opt issue #2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ivon
import torch

__all__ = ["VariationalIVON", "derive_seed", "unwrap_ivon"]

_MASK = (1 << 63) - 1


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that depends on every key (SplitMix64 mixing), for counter-based noise draws."""
    state = 0x9E3779B97F4A7C15
    for key in keys:
        state = (state ^ (int(key) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state & _MASK


class VariationalIVON(ivon.IVON):
    """`ivon.IVON` with exact checkpointing, seeded noise and an exception-safe sampling context.

    Args:
        params: trainable parameters only (frozen ones would receive noise and weight decay).
        noise_seed: base seed of the weight noise; `None` draws from the global torch RNG as ivon-opt does.
        rank: process index, mixed into the noise seed so that DDP ranks are independent MC samples.
        **kwargs: passed to `ivon.IVON` (lr, ess, hess_init, beta1, beta2, weight_decay, clip_radius, sync, ...).
    """

    def __init__(self, params: Any, *, noise_seed: int | None = 0, rank: int = 0, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.noise_seed = noise_seed
        self.rank = rank
        self._draws_since_step = 0
        self._generator: torch.Generator | None = None

    # -- noise -------------------------------------------------------------------------------------
    def _noise_generator(self) -> torch.Generator | None:
        if self.noise_seed is None:
            return None
        if self._generator is None or self._generator.device != self._device:
            self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(
            derive_seed(self.noise_seed, self.rank, self.current_step, self._draws_since_step)
        )
        return self._generator

    def _sample_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = self._noise_generator()
        self._draws_since_step += 1
        if generator is None:
            return super()._sample_params()
        param_avgs, noises = [], []
        for group in self.param_groups:
            # same arithmetic as ivon-opt, so a run seeded like ours reproduces it bit for bit
            noise = torch.randn(group["numel"], device=self._device, dtype=self._dtype, generator=generator) / (
                group["ess"] * (group["hess"] + group["weight_decay"])
            ).sqrt()
            noises.append(noise)
            offset = 0
            for p in group["params"]:
                flat = p.data.flatten()
                param_avgs.append(flat)
                p.data = (flat + noise[offset : offset + p.numel()]).view(p.shape)
                offset += p.numel()
        return torch.cat(param_avgs), torch.cat(noises)

    @contextlib.contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Weights set to one posterior sample θ = m + σ⊙e for the body, then back to m.

        With `train=True` the gradients present at exit are recorded as one MC sample (seed 000, Alg. 1
        lines 2-4): forward and backward must both run inside the body.
        """
        param_avg, noise = self._sample_params()
        try:
            yield
        except BaseException:
            self._restore_param_average(False, param_avg, noise)
            raise
        if train:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
        self._restore_param_average(train, param_avg, noise)

    def step(self, closure: Any = None) -> torch.Tensor | None:
        if self.state["count"] == 0:
            raise RuntimeError(
                "IVON.step() was called without any gradient sample: run forward and backward inside "
                "`optimizer.sampled_params(train=True)` first."
            )
        loss = super().step(closure)
        self._draws_since_step = 0
        return loss

    # -- posterior ---------------------------------------------------------------------------------
    def posterior_std(self) -> list[torch.Tensor]:
        """σ = 1/sqrt(ess·(h + δ)) for each parameter, in `param_groups` order (seed 000, Alg. 1 line 2)."""
        stds = []
        for group in self.param_groups:
            std = (group["ess"] * (group["hess"] + group["weight_decay"])).rsqrt()
            offset = 0
            for p in group["params"]:
                stds.append(std[offset : offset + p.numel()].view(p.shape).clone())
                offset += p.numel()
        return stds

    def hessian(self) -> torch.Tensor:
        return torch.cat([group["hess"] for group in self.param_groups])

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["state"] = dict(sd["state"], current_step=self.current_step)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state = dict(state_dict["state"])
        step = state.pop("current_step", None)
        state_dict["state"] = state
        super().load_state_dict(state_dict)
        self.state.pop("current_step", None)
        if step is not None:
            self.current_step = int(step)
        self._draws_since_step = 0
        # torch casts per-parameter state only; hess/momentum live in the param groups.
        for group in self.param_groups:
            for key in ("hess", "momentum"):
                group[key] = group[key].to(device=self._device, dtype=self._dtype)


def unwrap_ivon(optimizer: Any) -> VariationalIVON | None:
    """The IVON inside accelerate's `AcceleratedOptimizer` (which forwards no `sampled_params`), or None."""
    while optimizer is not None and not isinstance(optimizer, ivon.IVON):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
