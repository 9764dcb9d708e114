"""varsmooth's IVON optimizer: ivon-opt 0.1.3's update (Shen et al. 2024, "Variational Learning is Effective for Large
Deep Networks", Alg. 1, 'price' estimate) in torch.optim's shape, its arithmetic per (device, dtype) bucket in
`kernels`. Draw d after step t of bucket b on process r is seeded by derive_seed(derive_seed(sample_seed, t, d), r, b),
so resumes are exact; FSDP2's shards draw with their mesh coordinate for r and form one sample together. Nothing in a
sample or a step waits for the device.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..presets import SCRATCH_PRESET
from . import kernels
from .ivon_opt_layout import is_flat_layout, per_parameter_state
from .kernels import Dispatch, _on_device, noise_times_grad, perturb, seeded, update
from .prefetch import NoisePrefetch
from .seeds import derive_seed
from .settings import SETTING_RANGES, check_ivon_setting
from .sharding import DTensor, full_tensor, to_local

__all__ = ["VariationalIVON", "unwrap_ivon"]

def _spare_core() -> bool:
    """Whether torch's threads in this node's processes (torchrun's and accelerate's LOCAL_WORLD_SIZE) leave a core
    this process may use idle. On a busy core a further thread slows the forward pass as much as it saves."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return torch.get_num_threads() * int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < cores


class _Bucket(NamedTuple):
    """A param group's parameters of one device, dtype and noise key (rank or shard coordinate, bucket number)."""
    group: dict[str, Any]
    params: list[torch.Tensor]
    indices: list[int]  # the parameters' positions over all param groups, which no bucketing changes
    seed_key: tuple[int, ...]

    def noise_seed(self, draw_seed: int) -> int:
        """The seed of this bucket's e in the draw seeded by `draw_seed` (the same on every rank and shard)."""
        return derive_seed(draw_seed, *self.seed_key)


def draw_noise(bucket: _Bucket, draw_seed: int, into: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """The bucket's e ~ N(0, I) in the draw seeded by `draw_seed`: drawn into `into` (buffers that keep e until the
    gradient arrives) and returned, or None where nothing keeps it: the kernels then draw e themselves, under the
    same seed at the sample and at the gradient. The one place e comes from, so that a test can replace it. A
    generator of its own (the same numbers as the device's default one seeded alike) lets it run off the main
    thread, where the forward pass draws dropout from the default one."""
    if into is None:
        return None
    generator = torch.Generator(into[0].device).manual_seed(bucket.noise_seed(draw_seed))
    for e in into:
        e.normal_(generator=generator)
    return into


class VariationalIVON(torch.optim.Optimizer):
    """IVON (Shen et al. 2024, Alg. 1). Use like ivon-opt: forward and backward inside
    `with optimizer.sampled_params(train=True):` (per MC sample or micro-batch; they are averaged), then `step()`.

    Args: `params` (trainable only: frozen ones would get noise and weight decay; groups may set lr, weight_decay,
    ess, hess_init, beta1, beta2, clip_radius; their ranges: `SETTING_RANGES`), the rest as in `ivon.IVON` but for the
    defaults, the scratch preset's (`varsmooth.presets.SCRATCH_PRESET`) (weight_decay: the prior precision δ;
    `sync` all-reduces ḡ and mean(e⊙g) in `step()`; hess_approx 'price' only), `sample_seed`, the seed of the weight
    samples (None: from the global RNG), `rank` (mixed into the seed: DDP ranks draw independent samples),
    `compiled` (whether the kernels run through torch.compile: `kernels.Dispatch`), `foreach` (as torch.optim's: None
    or True the foreach kernels, compiled or not; False the slower for-loop reference, one function per formula:
    `kernels._single_tensor_ivon`; not with compiled=True) and `prefetch` (whether the next training sample's e, where
    it is drawn into a buffer (the CPU), is drawn on another thread during this sample's forward and backward, for one
    more parameter-sized buffer: `prefetch.NoisePrefetch`; None: where this node's processes leave a core spare,
    `_spare_core`; never with `sample_seed=None`, whose draws are not known ahead).
    """

    # the defaults of the scratch preset, which `IVONConfig(ivon_preset="scratch")` fills its fields with
    def __init__(self, params: Any, lr: float, ess: float, hess_init: float = SCRATCH_PRESET["hess_init"],
                 beta1: float = 0.9, beta2: float = SCRATCH_PRESET["long_run_beta2"],
                 weight_decay: float = SCRATCH_PRESET["prior_precision"], mc_samples: int = 1,
                 hess_approx: str = "price", clip_radius: float = math.inf, sync: bool = False, debias: bool = True,
                 rescale_lr: bool = SCRATCH_PRESET["rescale_lr"], *,
                 sample_seed: int | None = 0, rank: int = 0, compiled: bool | None = None,
                 foreach: bool | None = None, prefetch: bool | None = None) -> None:
        if hess_approx != "price":
            raise ValueError(f"hess_approx={hess_approx!r} is not implemented; use 'price' (ivon-opt's default).")
        if mc_samples < 1:
            raise ValueError(f"mc_samples must be >= 1, got {mc_samples}.")
        defaults = dict(lr=lr, mc_samples=mc_samples, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        hess_init=hess_init, ess=ess, clip_radius=clip_radius)
        self.mc_samples, self.hess_approx, self.sync, self.debias = mc_samples, hess_approx, sync, debias
        self.rescale_lr, self.sample_seed, self.rank, self.compiled = rescale_lr, sample_seed, rank, compiled
        self.foreach, self._dispatch = foreach, Dispatch(compiled, foreach)
        self.prefetch = prefetch if prefetch is not None else _spare_core()
        self._prefetch = NoisePrefetch()
        self._draws_per_step = 1  # in the last step: where the draw after this one is predicted to fall
        self.current_step, self._count, self._sampling = 0, 0, False  # _count: MC samples since the last step
        self._draw_seeds: list[int] = []  # base seed of each draw since the last step
        self._perturbed: list[tuple[_Bucket, bool]] = []  # buckets holding a sample, and whether they keep e
        # Per-parameter scratch, reused (on the CPU a fresh buffer costs page faults): "mean" (m while the parameter
        # holds θ), "noise" (e, where kept) and, with several samples per step, "avg_grad" and "nxg".
        self._buffers: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        # ḡ and mean(e⊙g): after one sample, the gradient and e⊙g's buffer (e's or m's); after more, "avg_grad", "nxg"
        self._avg_grad: dict[torch.Tensor, torch.Tensor] = {}
        self._nxg: dict[torch.Tensor, torch.Tensor] = {}
        self._pending: set[torch.Tensor] = set()  # parameters whose `_nxg` still holds e, not yet e⊙g
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # a group may set its own values, which no `IVONConfig` has checked
        for key in SETTING_RANGES:
            check_ivon_setting(key, group[key])
        for p in group["params"]:
            self._init_state(group, p)

    def _init_state(self, group: dict[str, Any], p: torch.Tensor) -> None:
        if not p.is_floating_point():
            raise ValueError(f"IVON needs floating-point parameters, got one of dtype {p.dtype}.")
        if self.sync and isinstance(p, DTensor):
            raise ValueError("sync=True averages whole gradients over the ranks, but this parameter is sharded (a "
                             "DTensor, e.g. under FSDP2), whose gradients are already averaged: use sync=False.")
        self.state[p]["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self.state[p]["hess"] = torch.full_like(p, group["hess_init"], memory_format=torch.preserve_format)

    def _follow_replaced_params(self) -> None:
        """Fresh state for parameters swapped into `param_groups` (accelerate's FSDP2 `prepare` swaps in DTensors)."""
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        if len(self.state) == len(params) and all(p in self.state for _, p in params):
            return
        if self._count:
            raise RuntimeError("IVON's parameters were replaced between a gradient sample and step(): replace them "
                               "(e.g. accelerator.prepare) before training starts.")
        gone = {p for p in self.state} - {p for _, p in params}
        self._prefetch.forget(gone)
        for p in gone:
            del self.state[p]
            self._buffers.pop(p, None)
        for group, p in params:
            if "hess" not in self.state.get(p, {}):
                self._init_state(group, p)

    def _buffer(self, params: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        out = []
        for p in params:
            slots = self._buffers.setdefault(p, {})
            if name not in slots:
                # e is drawn in logical (contiguous) order, whatever the parameter's layout
                layout = torch.contiguous_format if name == "noise" else torch.preserve_format
                slots[name] = torch.empty_like(to_local(p), memory_format=layout)
            out.append(slots[name])
        return out

    def _buckets(self) -> list[_Bucket]:
        """The parameters split by group, device, dtype and (for DTensors) shard coordinate, in a fixed order."""
        buckets, start = [], 0
        for group in self.param_groups:
            split: dict[tuple, list[tuple[int, torch.Tensor]]] = defaultdict(list)
            for index, p in enumerate(group["params"], start):
                split[(p.device, p.dtype, self._noise_key(p))].append((index, p))
            start += len(group["params"])
            buckets += [_Bucket(group, [p for _, p in v], [i for i, _ in v], (*key[2], len(buckets) + n))
                        for n, (key, v) in enumerate(split.items())]
        return buckets

    def _noise_key(self, p: torch.Tensor) -> tuple[int, ...]:
        """The rank, or for a DTensor its coordinates on the mesh dimensions it is sharded over (replicas alike)."""
        if isinstance(p, DTensor):
            return tuple(c for c, pl in zip(p.device_mesh.get_coordinate() or [], p.placements) if pl.is_shard())
        return (self.rank,)

    # -- sampling ----------------------------------------------------------------------------------
    def _keeps_noise(self, t: torch.Tensor) -> bool:
        """Whether e waits in a buffer for the gradient: on the CPU and eagerly; else the kernel draws it again."""
        return t.device.type == "cpu" or not self._dispatch.compiles

    def _kernel_draws(self, bucket: _Bucket, draw: int,
                      noise: list[torch.Tensor] | None) -> contextlib.AbstractContextManager:
        """The generator state for the draws of `randn_like` in this bucket's kernels (none where `noise` is given)."""
        return contextlib.nullcontext() if noise is not None else seeded(
            bucket.params[0].device, bucket.noise_seed(self._draw_seeds[draw]))

    def _next_draw_seed(self, draw: int) -> int:
        """The seed of the draw predicted to follow draw `draw` of this step (the last step's count of draws)."""
        later = draw + 1 < self._draws_per_step  # else the next step's first draw
        return derive_seed(self.sample_seed, *((self.current_step, draw + 1) if later else (self.current_step + 1, 0)))

    @torch.no_grad()
    def _sample_params(self, train: bool) -> None:
        self._follow_replaced_params()
        # a further sample of this step: its backward may zero the gradient holding ḡ, and it writes m and e
        self._multiply_pending()
        for held, name in ((self._avg_grad, "avg_grad"), (self._nxg, "nxg")):
            for p, average in list(held.items()):
                held[p] = own = self._buffer([p], name)[0]
                if average is not own:
                    own.copy_(average)
        draw = len(self._draw_seeds)
        self._draw_seeds.append(derive_seed(self.sample_seed, self.current_step, draw) if self.sample_seed is not None
                                else int(torch.randint(0, 1 << 62, ()).item()))  # the CPU generator: no device sync
        buckets = self._buckets()
        keeping = [self._keeps_noise(to_local(b.params[0])) for b in buckets]
        kept = [b for b, keeps in zip(buckets, keeping) if keeps]
        prefetched = self._prefetch.take(self._draw_seeds[draw], kept, [self._buffer(b.params, "noise") for b in kept])
        if prefetched is not None:  # buffers that hold this draw's e already
            for bucket, noise in zip(kept, prefetched):
                for p, e in zip(bucket.params, noise):
                    self._buffers[p]["noise"] = e
        for bucket, keeps in zip(buckets, keeping):
            group = bucket.group
            weights = [to_local(p) for p in bucket.params]
            into = self._buffer(bucket.params, "noise") if keeps else None
            noise = into if keeps and prefetched is not None else draw_noise(bucket, self._draw_seeds[draw], into)
            self._perturbed.append((bucket, keeps))
            hess = [to_local(self.state[p]["hess"]) for p in bucket.params]
            if self.foreach is False:  # eager: e was drawn into its buffer
                kernels._single_tensor_sample(weights, self._buffer(bucket.params, "mean"), hess, noise,
                                              ess=group["ess"], weight_decay=group["weight_decay"])
            else:
                with self._kernel_draws(bucket, draw, noise):
                    self._dispatch(perturb, weights, self._buffer(bucket.params, "mean"), hess, noise,
                                   _on_device([group["ess"] ** -0.5, group["weight_decay"]], weights[0]))
        if train and self.prefetch and kept and self.sample_seed is not None:
            self._prefetch.start(self._next_draw_seed(draw), kept, draw_noise)

    @torch.no_grad()
    def _restore_param_average(self, train: bool) -> None:
        """Mean weights back into the parameters; with `train`, the gradients folded into the running averages."""
        self._prefetch.wait()
        perturbed, self._perturbed = self._perturbed, []
        for bucket, _ in perturbed:
            torch._foreach_copy_([to_local(p) for p in bucket.params], self._buffer(bucket.params, "mean"))
        if not train:
            return
        if any(p.grad is not None and p.grad.is_sparse for bucket, _ in perturbed for p in bucket.params):
            raise RuntimeError("IVON does not support sparse gradients; use dense embeddings (sparse=False).")
        count, draw = self._count + 1, len(self._draw_seeds) - 1
        for bucket, keeps in perturbed:
            # a trainable parameter the loss did not reach has gradient zero (ivon-opt issue #2)
            grads = [to_local(p.grad) if p.grad is not None and p.requires_grad else torch.zeros_like(to_local(p))
                     for p in bucket.params]
            # e⊙g, in the buffer that held e or, where e was not kept, in the now free buffer of the mean
            out = self._buffer(bucket.params, "noise" if keeps else "mean")
            if keeps and count == 1:  # e⊙g formed by the step's kernel, which reads e and g anyway
                self._pending.update(bucket.params)
            elif keeps:
                torch._foreach_mul_(out, grads)
            else:
                noise = draw_noise(bucket, self._draw_seeds[draw], None)
                with self._kernel_draws(bucket, draw, noise):
                    self._dispatch(noise_times_grad, out, grads, noise)
            if count == 1:  # one sample's ḡ and e⊙g are the means: no copy
                self._avg_grad.update(zip(bucket.params, grads))
                self._nxg.update(zip(bucket.params, out))
                continue
            # running means over the samples of this step, a + (x - a)/count as ivon-opt's Welford mean
            torch._foreach_lerp_([self._nxg[p] for p in bucket.params], out, 1.0 / count)
            torch._foreach_lerp_([self._avg_grad[p] for p in bucket.params], grads, 1.0 / count)
        self._count = count

    @contextlib.contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Weights set to one sample θ = m + σ⊙e for the body, then back to m. With `train=True` the gradients at exit
        are one MC sample (Alg. 1 lines 2-4): forward and backward run inside. If the body raises, m is restored and
        nothing recorded. `step()` may read ḡ from the gradient tensors: change them (clip) inside the body only."""
        if self._sampling:
            raise RuntimeError("sampled_params() is already active: IVON samples one set of weights at a time.")
        self._sampling = True
        try:
            try:
                self._sample_params(train)
                yield
            except BaseException:
                self._restore_param_average(False)
                raise
            self._restore_param_average(train)
        finally:
            self._sampling = False

    # -- update ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:  # ivon-opt's contract: the closure samples, runs forward/backward, returns the loss
            with torch.enable_grad():
                loss = sum(closure() for _ in range(self.mc_samples)) / self.mc_samples
        if self._count == 0:
            raise RuntimeError("IVON.step() was called without any gradient sample: run forward and backward inside "
                               "`optimizer.sampled_params(train=True)` first.")
        buckets = self._buckets()
        if self.sync and dist.is_available() and dist.is_initialized():
            self._multiply_pending()
            self._sync_samples(buckets)
        self.current_step += 1
        self._draws_per_step = len(self._draw_seeds)
        for bucket in buckets:
            group, params = bucket.group, bucket.params
            b1, b2, wd, root = group["beta1"], group["beta2"], group["weight_decay"], math.sqrt(group["ess"])
            debias = 1.0 - b1 ** self.current_step if self.debias else 1.0
            lr = group["lr"] * (group["hess_init"] + wd) if self.rescale_lr else group["lr"]
            rate, times_grad = (1.0 - b2) * root, params[0] in self._pending
            tensors = ([to_local(p) for p in params], [self._avg_grad[p] for p in params],
                       [to_local(self.state[p]["momentum"]) for p in params],
                       [to_local(self.state[p]["hess"]) for p in params], [self._nxg[p] for p in params])
            if self.foreach is False:
                kernels._single_tensor_ivon(*tensors, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, ess=group["ess"],
                                            debias=debias, clip_radius=group["clip_radius"], times_grad=times_grad)
            else:
                coef = _on_device([b1, 1.0 - b1, wd, root, 0.5 * rate, rate, debias, lr], params[0])
                self._dispatch(update, *tensors, coef, hessian_moves=b2 < 1.0, radius=group["clip_radius"],
                               times_grad=times_grad)
        self.reset_samples()
        return loss

    def reset_samples(self) -> None:
        """Forget the gradient samples and draws since the last step (a step that is not applied)."""
        self._draw_seeds, self._count = [], 0
        self._avg_grad.clear()
        self._nxg.clear()
        self._pending.clear()

    def _multiply_pending(self) -> None:
        """e⊙g where the step's kernel was to form it, for a further sample or a sync."""
        pending, self._pending = self._pending, set()
        if pending:
            torch._foreach_mul_([self._nxg[p] for p in pending], [self._avg_grad[p] for p in pending])

    def _sync_samples(self, buckets: list[_Bucket]) -> None:
        """Averages ḡ and mean(e⊙g) over the ranks (one all-reduce per bucket)."""
        for bucket in buckets:
            tensors = [self._avg_grad[p] for p in bucket.params] + [self._nxg[p] for p in bucket.params]
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))

    # -- posterior ---------------------------------------------------------------------------------
    def posterior_std(self) -> list[torch.Tensor]:
        """σ = 1/sqrt(ess·(h + δ)) for each parameter, in `param_groups` order (Alg. 1 line 2)."""
        self._follow_replaced_params()
        return [kernels._sigma(self.state[p]["hess"], ess=g["ess"], weight_decay=g["weight_decay"])
                for g in self.param_groups for p in g["params"]]

    def hessian(self) -> torch.Tensor:
        """All h, flat in `param_groups` order, on the first parameter's device (DTensors gathered: a collective)."""
        self._follow_replaced_params()
        hess = [full_tensor(self.state[p]["hess"]).flatten() for g in self.param_groups for p in g["params"]]
        return torch.cat([h.to(hess[0].device) for h in hess]) if hess else torch.zeros(0)

    # -- checkpointing -----------------------------------------------------------------------------
    def _between_steps(self, what: str) -> None:
        if self._sampling:
            raise RuntimeError(f"{what}() inside sampled_params(): the parameters hold a sample, not the mean; call "
                               "it between optimizer steps.")
        self._follow_replaced_params()

    def state_dict(self) -> dict[str, Any]:
        self._between_steps("state_dict")
        state_dict = super().state_dict()
        # in every param group, since torch.distributed.checkpoint keeps only "state" and "param_groups"
        for group in state_dict["param_groups"]:
            group["current_step"] = self.current_step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class, or of ivon-opt's layout (`ivon_opt_layout`)."""
        self._between_steps("load_state_dict")
        if is_flat_layout(state_dict):
            state_dict, step = per_parameter_state(state_dict, self.param_groups)
        else:
            step = state_dict["param_groups"][0].get("current_step") if state_dict["param_groups"] else None
        super().load_state_dict(state_dict)
        # the engine updates its state in place: own copies, laid out like the parameters, leave the input untouched
        for group in self.param_groups:
            group.pop("current_step", None)
            for p, key in ((p, key) for p in group["params"] for key in ("momentum", "hess")):
                own = torch.empty_like(p)
                to_local(own).copy_(to_local(self.state[p][key]))
                self.state[p][key] = own
        if step is not None:
            self.current_step = int(step)
        self.reset_samples()


def unwrap_ivon(optimizer: Any) -> VariationalIVON | None:
    """The IVON inside accelerate's `AcceleratedOptimizer` (which forwards no `sampled_params`), or None."""
    while optimizer is not None and not isinstance(optimizer, VariationalIVON):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
