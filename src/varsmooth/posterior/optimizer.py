"""varsmooth's IVON optimizer: ivon-opt's update, in place, with per-parameter state.

The update is that of ivon-opt 0.1.3 (Shen et al. 2024, "Variational Learning is Effective for Large Deep
Networks", Alg. 1 with the 'price' Hessian estimate, debiasing and `rescale_lr`); ivon-opt stays the reference the
tests compare against. What differs is the machinery, which in ivon-opt concatenates every parameter into fresh flat
vectors at every sample and step and reassigns `p.data`:

* per-parameter state (`momentum`, `hess` in `self.state[p]`), so parameters may live on any mix of devices and
  dtypes, param groups keep their own lr / weight decay (prior precision) / ess, and checkpoints are ordinary
  per-parameter optimizer state dicts (ivon-opt's flat-vector checkpoints are converted on load);
* in-place arithmetic; the mean weights wait in a buffer while the parameters hold the sample, and are copied back
  (the parameter tensors are never replaced). On the CPU, where the step is memory-bound, a sample and a step are one
  fused loop each per tensor of `FUSED_MIN_NUMEL` elements or more (`varsmooth.posterior.fused`, compiled by
  torch.compile); elsewhere, for smaller tensors or without a C++ compiler, `torch._foreach_*` ops per (device,
  dtype) bucket;
* on accelerators the noise is not kept while the sample trains: it is drawn into the parameters and drawn again
  (the same counter) when the gradient arrives, so IVON holds one parameter-sized buffer more than AdamW (see
  `_keeps_noise`);
* counter-based noise: parameter i of draw d after optimizer step t on process r is a standard normal keyed by
  `derive_seed(noise_seed, r, t, d, i)`, so training is reproducible, resumes exactly without touching the global
  RNG, DDP ranks draw independent samples, and each parameter's draw can be regenerated alone. The fused loops
  compute it (`varsmooth.posterior.noise.counter_normal`, element by element from its index: a Gaussian draw was
  the largest cost of a CPU step), elsewhere a torch generator seeded with that key draws it; so the same seed
  gives other samples with `fused=False`, as on another device;
* parameters sharded as DTensors (FSDP2's `fully_shard`): each rank samples and updates its local shard, and the
  shards form one draw (FSDP2 has averaged the gradients: `sync` stays off): the fused loops number a shard's
  elements by their index in the whole parameter, elsewhere the noise is drawn whole and sliced. The state is
  sharded like the parameters and saves through `torch.distributed.checkpoint`;
* `sampled_params` restores the mean weights if the body raises (the sample is then not recorded), and treats a
  trainable parameter that got no gradient as a zero gradient instead of crashing (ivon-opt issue #2).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .fused import cpu_kernels, sample_coefficients, update_coefficients
from .noise import COUNTER_LIMIT, counter_key, derive_seed

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # a torch build without distributed support has no sharded parameters
    DTensor = ()

__all__ = ["VariationalIVON", "unwrap_ivon"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's (e.g. an FSDP2 parameter's) local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into one plain tensor on every rank (a collective), else the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _first_counter(p: torch.Tensor) -> int | None:
    """The row-major index, in the whole parameter, of the first element this process holds; None where its
    elements are not one run of consecutive indices (a DTensor sharded along a later dimension)."""
    if not isinstance(p, DTensor):
        return 0
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) != tuple(p.shape[1:]) or not p.to_local().is_contiguous():
        return None
    return offset[0] * math.prod(p.shape[1:]) if p.dim() else 0


def _local_slice(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole`, a tensor of the global shape of `t` (a DTensor) that every rank holds."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _add_scalar_into(out: list[torch.Tensor], tensors: list[torch.Tensor], scalar: float) -> None:
    """out ← tensors + scalar, in place in `out` (no temporaries)."""
    torch._foreach_copy_(out, tensors)
    torch._foreach_add_(out, scalar)


#: the fewest elements of a CPU tensor that runs the fused loops: a compiled call costs ~25 µs more than a foreach
#: op's per-tensor dispatch, so smaller tensors (biases, norms, LoRA factors) are faster with foreach ops
FUSED_MIN_NUMEL = 1 << 14

#: the fused step's flag "form e⊙g here", as tensors (see `fused._update`)
_TIMES_GRAD = {flag: torch.tensor(flag) for flag in (False, True)}

#: on the accelerator path, the most elements a step's or a sample's temporaries cover at once: temporaries stay a
#: small fraction of the model instead of one more parameter-sized buffer
CHUNK_NUMEL = 1 << 22


def _chunks(tensors: list[torch.Tensor]) -> Iterator[slice]:
    """Consecutive slices of `tensors` with at most `CHUNK_NUMEL` elements each (or one tensor, if larger)."""
    start, numel = 0, 0
    for i, t in enumerate(tensors):
        if i > start and numel + t.numel() > CHUNK_NUMEL:
            yield slice(start, i)
            start, numel = i, 0
        numel += t.numel()
    if start < len(tensors):
        yield slice(start, len(tensors))


def _flat(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """1-D views of a fused loop's operands when all are contiguous, so that one compiled loop serves every shape;
    else the tensors as they are (e.g. a channels-last weight beside its contiguous noise: the loop pairs elements
    by logical index)."""
    return tuple(t.view(-1) for t in tensors) if all(t.is_contiguous() for t in tensors) else tensors


def _buckets(params: list[torch.Tensor], fuses: Callable[[torch.Tensor], bool] = lambda p: False
             ) -> list[list[torch.Tensor]]:
    """`params` split by (device, dtype), as `torch._foreach_*` fast paths need one of each per call, and by
    whether `fuses` them (the fused loops run tensor by tensor)."""
    groups: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[(p.device, p.dtype, fuses(p))].append(p)
    return list(groups.values())


class VariationalIVON(torch.optim.Optimizer):
    """IVON (Shen et al. 2024, Alg. 1) with per-parameter state, in-place updates and counter-based noise.

    Use like ivon-opt: run forward and backward inside `with optimizer.sampled_params(train=True):` (once per MC
    sample or micro-batch; the samples are averaged), then call `step()`.

    Args:
        params: trainable parameters or param groups (a group may set its own lr, weight_decay, ess, hess_init,
            beta1, beta2, clip_radius). Frozen parameters would receive noise and weight decay: leave them out.
        lr, ess, hess_init, beta1, beta2, weight_decay, mc_samples, clip_radius, sync, debias, rescale_lr: as in
            `ivon.IVON` (weight_decay is the prior precision δ; `sync` all-reduces the averaged gradient and the
            Hessian estimate over the default process group in `step()`).
        hess_approx: only 'price' (the reparameterisation estimate of ivon-opt's default) is implemented.
        noise_seed: base seed of the weight noise; `None` draws from the global torch RNG.
        rank: process index, mixed into the noise seed so that DDP ranks are independent MC samples.
        fused: for CPU tensors of at least `FUSED_MIN_NUMEL` elements, the compiled fused loops of
            `varsmooth.posterior.fused` (torch.optim's `fused` flag): None uses them where they compile (a C++
            compiler is needed) and warns once otherwise, True raises where they do not compile, False keeps foreach
            ops. Parameters on accelerators always use foreach ops.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        ess: float,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        weight_decay: float = 1e-4,
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float = math.inf,
        sync: bool = False,
        debias: bool = True,
        rescale_lr: bool = True,
        *,
        noise_seed: int | None = 0,
        rank: int = 0,
        fused: bool | None = None,
    ) -> None:
        if hess_approx != "price":
            raise ValueError(f"hess_approx={hess_approx!r} is not implemented; use 'price' (ivon-opt's default).")
        if mc_samples < 1:
            raise ValueError(f"mc_samples must be >= 1, got {mc_samples}.")
        defaults = dict(lr=lr, mc_samples=mc_samples, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        hess_init=hess_init, ess=ess, clip_radius=clip_radius)
        self.mc_samples = mc_samples
        self.hess_approx = hess_approx
        self.sync = sync
        self.debias = debias
        self.rescale_lr = rescale_lr
        self.noise_seed = noise_seed
        self.rank = rank
        self.fused = fused
        self._kernels = cpu_kernels() if fused else None
        if fused and self._kernels.error:
            raise RuntimeError(f"fused=True, but IVON's fused CPU kernels do not compile ({self._kernels.error}): "
                               "install a C++ compiler (e.g. g++) for torch.compile and leave torch.compile switched "
                               "on, or pass fused=False.")
        self.current_step = 0
        self._draws_since_step = 0
        self._count = 0  # MC samples recorded since the last step
        self._sampling = False
        # buckets whose weights hold a sample (mean saved), with each parameter's index (its noise counter)
        self._perturbed: list[tuple[list[torch.Tensor], list[int]]] = []
        # Per-parameter scratch, allocated once and reused (fresh parameter-sized tensors cost page faults on the CPU
        # at every step): "mean" (m while the parameter holds θ), "avg_nxg" (the running mean of e⊙g) and, with
        # several samples per step, "avg_grad" (the running ḡ); with one sample ḡ is the gradient tensor itself, read
        # at step(). Where the noise is kept (`_keeps_noise`), also "noise" (e, then e⊙g), and "mean" is the foreach
        # step's scratch (the fused loops need none): two buffers besides momentum and Hessian. Elsewhere e is drawn
        # again into the free "mean" buffer when the gradient arrives, that buffer becomes "avg_nxg" and the next
        # sample's "mean" after step(), and the step's temporaries are chunked (`CHUNK_NUMEL`): one buffer more than
        # AdamW.
        self._buffers: dict[torch.Tensor, dict[str, torch.Tensor | None]] = {}
        self._avg_grad: dict[torch.Tensor, torch.Tensor] = {}  # ḡ per parameter: p.grad of the sample, or "avg_grad"
        # parameters (fused, one sample so far) whose "avg_nxg" still holds e: the step's loop multiplies it by ḡ as
        # it reads both anyway, which saves a pass over e and the gradient
        self._times_grad_pending: set[torch.Tensor] = set()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._refused_dtypes: set[torch.dtype] = set()  # dtypes the fused loops fail for, warned about once
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, low, high in (("lr", 0.0, math.inf), ("weight_decay", 0.0, math.inf), ("beta1", 0.0, 1.0),
                               ("beta2", 0.0, 1.0)):
            if not low <= group[key] <= high:
                raise ValueError(f"Invalid {key}: {group[key]} (must lie in [{low}, {high}]).")
        for key in ("ess", "hess_init", "clip_radius"):
            if not group[key] > 0:
                raise ValueError(f"Invalid {key}: {group[key]} (must be > 0).")
        for p in group["params"]:
            if not p.is_floating_point():
                raise ValueError(f"IVON needs floating-point parameters, got one of dtype {p.dtype}.")
            if self.sync and isinstance(p, DTensor):
                raise ValueError("sync=True averages whole gradients over the ranks, but this parameter is sharded "
                                 "(a DTensor, e.g. under FSDP2), whose gradients are already averaged: use sync=False.")
            self._init_state(group, p)

    def _init_state(self, group: dict[str, Any], p: torch.Tensor) -> None:
        self.state[p]["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self.state[p]["hess"] = torch.full_like(p, group["hess_init"], memory_format=torch.preserve_format)

    def _follow_replaced_params(self) -> None:
        """Fresh state for parameters that replaced those IVON was built with, whose state is dropped: accelerate's
        FSDP2 `prepare` swaps the sharded DTensor parameters into `param_groups` of an optimizer built before it."""
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        if len(self.state) == len(params) and all(p in self.state for _, p in params):
            return
        if self._count:
            raise RuntimeError("IVON's parameters were replaced between a gradient sample and step(): replace them "
                               "(e.g. accelerator.prepare) before training starts.")
        current = {p for _, p in params}
        for p in [p for p in self.state if p not in current]:
            del self.state[p]
            self._buffers.pop(p, None)
        for group, p in params:
            if "hess" not in self.state.get(p, {}):
                if self.sync and isinstance(p, DTensor):
                    raise ValueError("sync=True averages whole gradients over the ranks, but the parameters are now "
                                     "sharded (DTensors, e.g. under FSDP2), whose gradients are already averaged: "
                                     "use sync=False.")
                self._init_state(group, p)

    def _buffer(self, params: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        out = []
        for p in params:
            slots = self._buffers.setdefault(p, {})
            if slots.get(name) is None:
                # the noise buffer is filled by one draw per parameter: contiguous, so the draw is layout-independent
                layout = torch.contiguous_format if name == "noise" else torch.preserve_format
                slots[name] = torch.empty_like(_local(p), memory_format=layout)
            out.append(slots[name])
        return out

    # -- sampling ----------------------------------------------------------------------------------
    def _keeps_noise(self, t: torch.Tensor) -> bool:
        """Whether e waits in a buffer from the sample to its gradient. On the CPU a Gaussian draw costs about half an
        AdamW step, so it is drawn once and kept; on accelerators a draw is one cheap kernel while a parameter-sized
        buffer limits the model that fits, so e is drawn again from its counter (impossible without `noise_seed`)."""
        return self.noise_seed is None or t.device.type == "cpu"

    def _fuses(self, p: torch.Tensor) -> bool:
        """Whether the parameter `p` runs the fused CPU loops (`fused`, `FUSED_MIN_NUMEL` elements or more, and
        for a DTensor a local shard of consecutive elements); the first one compiles them. Its noise is then
        `counter_normal`'s, computed in the loop, else a torch generator's."""
        if (self.fused is False or p.device.type != "cpu" or not FUSED_MIN_NUMEL <= p.numel() <= COUNTER_LIMIT
                or _first_counter(p) is None):
            return False
        if self._kernels is None:
            self._kernels = cpu_kernels()
            if self._kernels.error:
                warnings.warn(f"IVON's fused CPU kernels do not compile ({self._kernels.error}); using foreach ops, "
                              "which are slower on the CPU. Install a C++ compiler (e.g. g++) for torch.compile and "
                              "leave torch.compile switched on, or pass fused=False to silence this.", RuntimeWarning)
        if self._kernels.error:
            return False
        error = self._kernels.error_for(p.dtype)
        if error and p.dtype not in self._refused_dtypes:
            if self.fused:
                raise RuntimeError(f"fused=True, but IVON's fused CPU kernels fail for {p.dtype} ({error}): pass "
                                   "fused=None to use foreach ops for it, or fused=False.")
            self._refused_dtypes.add(p.dtype)
            warnings.warn(f"IVON's fused CPU kernels fail for {p.dtype} ({error}); its tensors use foreach ops. "
                          "Pass fused=False to silence this.", RuntimeWarning)
        return error is None

    def _seed(self, p: torch.Tensor, index: int, draw: int) -> int:
        """The seed of parameter `index`'s noise in draw `draw` of this step: counter-based, with rank 0's seed on
        every rank for a sharded (DTensor) parameter, whose shards form one global draw."""
        if self.noise_seed is None:
            return int(torch.randint(0, 1 << 62, ()).item())
        return derive_seed(self.noise_seed, 0 if isinstance(p, DTensor) else self.rank, self.current_step, draw, index)

    def _draw_noise(self, out: list[torch.Tensor], params: list[torch.Tensor], indices: list[int], draw: int) -> None:
        """Standard normal e per (not fused) parameter into `out`, from a generator seeded by `_seed` and drawn in
        the parameter's logical (contiguous) order, so it can be drawn again into any buffer. A sharded (DTensor)
        parameter is drawn whole on every rank, which keeps its shard."""
        for e, p, index in zip(out, params, indices):
            if self.noise_seed is None:
                e.normal_()
                continue
            gen = self._generators.get(e.device)
            if gen is None:
                gen = self._generators[e.device] = torch.Generator(device=e.device)
            gen.manual_seed(self._seed(p, index, draw))
            if isinstance(p, DTensor):
                e.copy_(_local_slice(p, torch.empty(p.shape, dtype=e.dtype, device=e.device).normal_(generator=gen)))
            elif e.is_contiguous():
                e.normal_(generator=gen)
            else:
                e.copy_(torch.empty(e.shape, dtype=e.dtype, device=e.device).normal_(generator=gen))

    @torch.no_grad()
    def _sample_params(self) -> None:
        self._follow_replaced_params()
        if self._count:  # a further sample of this step: its backward may zero the gradient that holds ḡ so far
            self._multiply_pending()
            self._own_avg_grad()
        index = 0
        for group in self.param_groups:
            indices = {p: index + i for i, p in enumerate(group["params"])}
            index += len(group["params"])
            for params in _buckets(group["params"], self._fuses):
                weights = [_local(p) for p in params]
                means = self._buffer(params, "mean")
                bucket_indices = [indices[p] for p in params]
                hess = [_local(self.state[p]["hess"]) for p in params]
                if self._fuses(params[0]):
                    noise = self._buffer(params, "noise")
                    coef = sample_coefficients(group, weights[0].dtype)
                    done = 0
                    try:  # (mean ← m, e, θ into the weight) tensor by tensor: only those done are restored on a crash
                        for p, p_index, *tensors in zip(params, bucket_indices, weights, means, noise, hess):
                            key = counter_key(self._seed(p, p_index, self._draws_since_step), _first_counter(p))
                            self._kernels.sample(*_flat(tuple(tensors)), coef, key)
                            done += 1
                    finally:
                        if done:
                            self._perturbed.append((params[:done], bucket_indices[:done]))
                    continue
                torch._foreach_copy_(means, weights)
                self._perturbed.append((params, bucket_indices))
                if not self._keeps_noise(weights[0]):
                    # e drawn into the parameters, then θ = m + σ⊙e with σ from chunked temporaries
                    self._draw_noise(weights, params, bucket_indices, self._draws_since_step)
                    for c in _chunks(weights):
                        inv_std = torch._foreach_add(hess[c], group["weight_decay"])
                        torch._foreach_rsqrt_(inv_std)
                        torch._foreach_mul_(weights[c], inv_std)
                        torch._foreach_mul_(weights[c], group["ess"] ** -0.5)
                        torch._foreach_add_(weights[c], means[c])
                    continue
                noise = self._buffer(params, "noise")
                self._draw_noise(noise, params, bucket_indices, self._draws_since_step)
                # θ = m + σ⊙e with σ = 1/sqrt(ess (h + δ)), computed in the parameter itself (no σ buffer)
                _add_scalar_into(weights, hess, group["weight_decay"])
                torch._foreach_rsqrt_(weights)
                torch._foreach_mul_(weights, noise)
                torch._foreach_mul_(weights, group["ess"] ** -0.5)
                torch._foreach_add_(weights, means)
        self._draws_since_step += 1

    def _multiply_pending(self) -> None:
        """e⊙g where the step's fused loop was to form it, for a further sample or a sync that needs mean(e⊙g)."""
        for bucket in _buckets(list(self._times_grad_pending)):
            torch._foreach_mul_([self._buffers[p]["avg_nxg"] for p in bucket], [self._avg_grad[p] for p in bucket])
        self._times_grad_pending.clear()

    def _own_avg_grad(self) -> None:
        """ḡ of the samples so far into the "avg_grad" buffers (with one sample it is the gradient tensor itself)."""
        for p, grad in list(self._avg_grad.items()):
            own = self._buffer([p], "avg_grad")[0]
            if grad is not own:
                own.copy_(grad)
                self._avg_grad[p] = own

    @torch.no_grad()
    def _restore_param_average(self, train: bool) -> None:
        """Mean weights back into the parameters; with `train`, the gradients folded into the running averages."""
        perturbed, self._perturbed = self._perturbed, []
        for bucket, _ in perturbed:
            torch._foreach_copy_([_local(p) for p in bucket], self._buffer(bucket, "mean"))
        if not train:
            return
        if any(p.grad is not None and p.grad.is_sparse for bucket, _ in perturbed for p in bucket):
            raise RuntimeError("IVON does not support sparse gradients; use dense embeddings (sparse=False).")
        count = self._count + 1
        for bucket, indices in perturbed:
            # a trainable parameter the loss did not reach has gradient zero (ivon-opt issue #2)
            grads = [_local(p.grad) if p.grad is not None and p.requires_grad else torch.zeros_like(_local(p))
                     for p in bucket]
            # e⊙g, in the buffer that held e or, where e was not kept, in the now free buffer of the mean
            role = "noise" if self._keeps_noise(_local(bucket[0])) else "mean"
            nxg = self._buffer(bucket, role)
            if role == "mean":
                self._draw_noise(nxg, bucket, indices, self._draws_since_step - 1)
            if count == 1 and self._fuses(bucket[0]):
                self._times_grad_pending.update(bucket)
            else:
                torch._foreach_mul_(nxg, grads)
            if count == 1:
                # ḡ is the gradient itself until a further sample (or step) needs it: no copy
                self._avg_grad.update(zip(bucket, grads))
                for p in bucket:  # the product is the average: its buffer changes role, no copy
                    slots = self._buffers[p]
                    slots["avg_nxg"], slots[role] = slots[role], slots.get("avg_nxg")
                continue
            # running means over the samples of this step, a + (x - a)/count as ivon-opt's Welford mean
            torch._foreach_lerp_(self._buffer(bucket, "avg_nxg"), nxg, 1.0 / count)
            torch._foreach_lerp_([self._avg_grad[p] for p in bucket], grads, 1.0 / count)
        self._count = count

    @contextlib.contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Weights set to one posterior sample θ = m + σ⊙e for the body, then back to m.

        With `train=True` the gradients present at exit are recorded as one MC sample (Alg. 1 lines 2-4): forward
        and backward must both run inside the body. If the body raises, the mean weights are restored and the
        sample is not recorded. With one sample per step, `step()` reads ḡ from the gradient tensors (no copy):
        change them in place (e.g. clip) inside the body, not between the body and `step()`.
        """
        if self._sampling:
            raise RuntimeError("sampled_params() is already active: IVON samples one set of weights at a time.")
        self._sampling = True
        try:
            try:
                self._sample_params()
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
            losses = []
            for _ in range(self.mc_samples):
                with torch.enable_grad():
                    losses.append(closure())
            loss = sum(losses) / self.mc_samples
        if self._count == 0:
            raise RuntimeError(
                "IVON.step() was called without any gradient sample: run forward and backward inside "
                "`optimizer.sampled_params(train=True)` first."
            )
        if self.sync and dist.is_available() and dist.is_initialized():
            self._multiply_pending()
            self._sync_samples()
        self.current_step += 1
        for group in self.param_groups:
            for params in _buckets(group["params"], self._fuses):
                self._update(group, params)
        for p, slots in self._buffers.items():  # the average's buffer takes the role it had before the first sample
            keeps_noise = self._keeps_noise(_local(p))
            role = "noise" if keeps_noise else "mean"
            if slots.get(role) is None:
                slots[role], slots["avg_nxg"] = slots.get("avg_nxg"), None
            elif not keeps_noise:  # several samples: freed, so that only "mean" outlives the step (kept on the CPU,
                slots["avg_nxg"] = None  # where a fresh buffer costs page faults)
        self._reset_samples()
        return loss

    def _reset_samples(self) -> None:
        """No gradient sample recorded, no draw made since the last step."""
        self._draws_since_step = 0
        self._count = 0
        self._avg_grad.clear()
        self._times_grad_pending.clear()

    def _sync_samples(self) -> None:
        """Averages ḡ and mean(e⊙g) over the ranks (one all-reduce per device and dtype)."""
        world = dist.get_world_size()
        params = [p for g in self.param_groups for p in g["params"]]
        for bucket in _buckets(params):
            tensors = [self._avg_grad[p] for p in bucket] + self._buffer(bucket, "avg_nxg")
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat)
            flat.div_(world)
            torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One IVON step of a bucket: one fused loop per tensor (`_fuses`), else 10 foreach passes with the buffer of
        mean(e⊙g) and a second one as scratch: the buffer of the mean weights (free until the next sample) where the
        noise is kept, else chunked temporaries (that buffer holds mean(e⊙g))."""
        weights = [_local(p) for p in params]
        if self._fuses(params[0]):
            step_size, debias = self._step_scalars(group)
            coef = update_coefficients(group, weights[0].dtype, step_size=step_size, debias=debias)
            for p, w in zip(params, weights):
                state = self.state[p]
                tensors = (w, self._avg_grad[p], _local(state["momentum"]), _local(state["hess"]),
                           self._buffers[p]["avg_nxg"])
                self._kernels.update(*_flat(tensors), coef, _TIMES_GRAD[p in self._times_grad_pending])
            return
        if self._keeps_noise(weights[0]):
            self._update_chunk(group, params, self._buffer(params, "mean"))
            return
        for c in _chunks(weights):
            self._update_chunk(group, params[c], [torch.empty_like(w) for w in weights[c]])

    def _update_chunk(self, group: dict[str, Any], params: list[torch.Tensor], scratch: list[torch.Tensor]) -> None:
        b1, b2, wd, ess = group["beta1"], group["beta2"], group["weight_decay"], group["ess"]
        weights = [_local(p) for p in params]
        momentum = [_local(self.state[p]["momentum"]) for p in params]
        hess = [_local(self.state[p]["hess"]) for p in params]
        grad = [self._avg_grad[p] for p in params]
        nxg = self._buffer(params, "avg_nxg")
        # m ← β1 m + (1-β1) ḡ
        torch._foreach_lerp_(momentum, grad, 1.0 - b1)
        if b2 < 1.0:  # with β2 = 1 the Hessian stays h
            # h ← β2 h + (1-β2) f + ½(1-β2)² (h-f)²/(h+δ), with the 'price' estimate f = ess (h+δ) mean(σ⊙e⊙g)
            # = r s n (r = sqrt(ess), s = sqrt(h+δ), n = mean(e⊙g)). With q = n - h/(r s), f - h = r s q, so
            # h ← h + (1-β2) r s q + ½(1-β2)² r² q² = h + (1-β2) r q (s + ½(1-β2) r q)
            root = math.sqrt(ess)
            _add_scalar_into(scratch, hess, wd)
            torch._foreach_sqrt_(scratch)
            torch._foreach_addcdiv_(nxg, hess, scratch, value=-1.0 / root)
            torch._foreach_add_(scratch, nxg, alpha=0.5 * (1.0 - b2) * root)
            torch._foreach_addcmul_(hess, nxg, scratch, value=(1.0 - b2) * root)
        _add_scalar_into(scratch, hess, wd)
        self._update_mean(group, weights, momentum, nxg, scratch)

    def _step_scalars(self, group: dict[str, Any]) -> tuple[float, float]:
        """(lr' / debias, debias) of this step: lr' = lr (h0 + δ) if `rescale_lr`, debias = 1 - β1^t if `debias`."""
        debias = 1.0 - group["beta1"] ** self.current_step if self.debias else 1.0
        lr = group["lr"] * (group["hess_init"] + group["weight_decay"]) if self.rescale_lr else group["lr"]
        return lr / debias, debias

    def _update_mean(self, group: dict[str, Any], params: list[torch.Tensor], momentum: list[torch.Tensor],
                     scratch: list[torch.Tensor], hess_wd: list[torch.Tensor]) -> None:
        # m ← m - lr' clip((m̂ + δ m)/(h + δ), ±r), with m̂ the debiased momentum
        step_size, debias = self._step_scalars(group)
        # (m̂ + δ m) debias = m + δ debias m, in a free buffer
        direction = scratch
        torch._foreach_copy_(direction, momentum)
        torch._foreach_add_(direction, params, alpha=group["weight_decay"] * debias)
        if math.isinf(group["clip_radius"]):
            torch._foreach_addcdiv_(params, direction, hess_wd, value=-step_size)
            return
        # clip(x / debias, ±r) = clip(x, ±r debias) / debias
        torch._foreach_div_(direction, hess_wd)
        torch._foreach_clamp_min_(direction, -group["clip_radius"] * debias)
        torch._foreach_clamp_max_(direction, group["clip_radius"] * debias)
        torch._foreach_add_(params, direction, alpha=-step_size)

    # -- posterior ---------------------------------------------------------------------------------
    def posterior_std(self) -> list[torch.Tensor]:
        """σ = 1/sqrt(ess·(h + δ)) for each parameter, in `param_groups` order (Alg. 1 line 2)."""
        self._follow_replaced_params()
        return [(g["ess"] * (self.state[p]["hess"] + g["weight_decay"])).rsqrt() for g in self.param_groups
                for p in g["params"]]

    def hessian(self) -> torch.Tensor:
        """All parameters' h, flattened in `param_groups` order, on the first parameter's device (sharded
        parameters are gathered whole: a collective, which every rank must call)."""
        self._follow_replaced_params()
        hess = [self.state[p]["hess"] for g in self.param_groups for p in g["params"]]
        hess = [_whole(h).flatten() for h in hess]
        return torch.cat([h.to(hess[0].device) for h in hess]) if hess else torch.zeros(0)

    def restore_from_posterior(self, stds: list[torch.Tensor], step: int) -> None:
        """Set each h to 1/(ess σ²) − δ, the inverse of σ = 1/sqrt(ess (h + δ)), with zero momentum and IVON's step
        count `step`: a resume from a saved posterior when the optimizer state is missing. `stds` in `param_groups`
        order, whole (unsharded) parameters."""
        if self._sampling:
            raise RuntimeError("restore_from_posterior() inside sampled_params(): restore between optimizer steps.")
        self._follow_replaced_params()
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        if len(stds) != len(params):
            raise ValueError(f"Got {len(stds)} posterior stds for the {len(params)} parameters IVON trains.")
        for (group, p), std in zip(params, stds):
            hess = self.state[p]["hess"]
            if isinstance(hess, DTensor) or tuple(std.shape) != tuple(hess.shape):
                raise ValueError(f"A posterior std of shape {tuple(std.shape)} cannot restore IVON's Hessian of shape "
                                 f"{tuple(hess.shape)}{' (sharded)' if isinstance(hess, DTensor) else ''}.")
            std = std.to(hess)
            hess.copy_((1.0 / (group["ess"] * std.square()) - group["weight_decay"]).clamp_min(0.0))
            self.state[p]["momentum"].zero_()
        self.current_step = int(step)
        self._reset_samples()

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._sampling:
            raise RuntimeError("state_dict() inside sampled_params(): the parameters hold a sample, not the mean.")
        self._follow_replaced_params()
        state_dict = super().state_dict()
        # in every param group, since torch.distributed.checkpoint keeps only "state" and "param_groups"
        for group in state_dict["param_groups"]:
            group["current_step"] = self.current_step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a checkpoint of this class, or of the earlier ivon-opt based one (flat `hess`/`momentum` per group)."""
        if self._sampling:
            raise RuntimeError("load_state_dict() inside sampled_params(): load between optimizer steps.")
        self._follow_replaced_params()
        if "count" in state_dict["state"] or any("hess" in g for g in state_dict["param_groups"]):
            state_dict, step = self._from_flat_checkpoint(state_dict)
        else:
            step = state_dict["param_groups"][0].get("current_step") if state_dict["param_groups"] else None
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.pop("current_step", None)
        # the engine updates its state in place: own copies, laid out like the parameters, leave the input untouched
        for group in self.param_groups:
            for p in group["params"]:
                for key in ("momentum", "hess"):
                    own = torch.empty_like(p)
                    _local(own).copy_(_local(self.state[p][key]))
                    self.state[p][key] = own
        if step is not None:
            self.current_step = int(step)
        self._reset_samples()

    def _from_flat_checkpoint(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """ivon-opt's layout (one flat hess/momentum vector per group) split into per-parameter state."""
        old_state = state_dict["state"]
        if old_state.get("count", 0):
            raise ValueError("The IVON checkpoint holds gradient samples not yet used by a step; save after step().")
        state, groups = {}, []
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"The IVON checkpoint has {len(state_dict['param_groups'])} param groups, this optimizer "
                             f"{len(self.param_groups)}: it was written for another model or parameter grouping.")
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            saved = dict(saved)
            hess, momentum = saved.pop("hess"), saved.pop("momentum")
            saved.pop("numel", None)
            numel = sum(p.numel() for p in group["params"])
            if len(saved["params"]) != len(group["params"]) or hess.numel() != numel or momentum.numel() != numel:
                raise ValueError(
                    f"The IVON checkpoint's param group holds {len(saved['params'])} parameters with {hess.numel()} "
                    f"values, this optimizer's {len(group['params'])} with {numel}: it was written for another model."
                )
            offset = 0
            for index, p in zip(saved["params"], group["params"]):
                state[index] = {"momentum": momentum[offset:offset + p.numel()].view(p.shape),
                                "hess": hess[offset:offset + p.numel()].view(p.shape)}
                offset += p.numel()
            groups.append(saved)
        return {"state": state, "param_groups": groups}, old_state.get("current_step")


def unwrap_ivon(optimizer: Any) -> VariationalIVON | None:
    """The IVON inside accelerate's `AcceleratedOptimizer` (which forwards no `sampled_params`), or None."""
    while optimizer is not None and not isinstance(optimizer, VariationalIVON):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
