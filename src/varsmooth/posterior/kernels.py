"""IVON's arithmetic as functions over the tensor lists of one (device, dtype) bucket, run eagerly or compiled.

`_single_tensor_ivon` (with `_single_tensor_sample`) is the step written formula by formula, one tensor at a time, as
torch.optim's `_single_tensor_adamw` and ivon-opt write theirs: the reference the others are tested against, which
`VariationalIVON(foreach=False)` runs. The functions the optimizer runs by default are written once with
`torch._foreach_*` ops, like torch.optim's `_multi_tensor_*`: run eagerly they are the foreach path; `torch.compile`
of them (Inductor's C++ on the CPU, Triton on CUDA) fuses each tensor's ops into one pass. Their hyperparameters come
as one tensor (`coef`), so that new values (a learning-rate schedule) compile no new graph, and the Hessian update is
rewritten to fewer operations: both read against the reference.

Given `noise=None`, a function draws e with `torch.randn_like` from the device's default generator, seeded by
`seeded`: compiled, that is Inductor's in-kernel Philox (`tl.randn` on CUDA), so the same seed draws e again when the
gradient arrives and no buffer keeps it. Not on the CPU: Inductor's `randn_cpu` costs ~42 ns a weight against ~3.5 ns
for torch's CPU generator (8.4 M weights, 2 cores: 355 vs 29 ms), which draws e there into a buffer passed in.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Dispatch", "noise_times_grad", "perturb", "seeded", "update"]

#: compiled graphs per function: one per bucket layout (list length, dtype), as a sweep over models may need
RECOMPILE_LIMIT = 64


# -- the reference: torch.optim's for-loop implementation (VariationalIVON(foreach=False)), one function per formula,
# named as ivon-opt's `_ivon.py` names them. Eager, one tensor at a time: each formula reads as the paper writes it.

def _sigma(h: torch.Tensor, *, ess: float, weight_decay: float) -> torch.Tensor:
    """σ = 1/sqrt(λ (h + δ)), the posterior std (Alg. 1 line 2; ivon-opt's `_sample_params`)."""
    return (ess * (h + weight_decay)).rsqrt()


def _nll_hess(h: torch.Tensor, nxg: torch.Tensor, *, ess: float, weight_decay: float) -> torch.Tensor:
    """ĥ, the 'price' (reparameterisation) Hessian estimate ĝ⊙(θ - m)/σ² = λ (h + δ) σ⊙mean(e⊙g) (Alg. 1 line 4;
    ivon-opt's `_get_nll_hess` times ess, whose avg_nxg is σ⊙mean(e⊙g)). σ is the samples': h has not changed since."""
    return ess * (h + weight_decay) * (_sigma(h, ess=ess, weight_decay=weight_decay) * nxg)


def _new_momentum(mom: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """m̄ ← β1 m̄ + (1-β1) ĝ, in place (Alg. 1 line 5)."""
    return mom.mul_(beta1).add_(g * (1.0 - beta1))


def _new_hess(h: torch.Tensor, f: torch.Tensor, *, beta2: float, weight_decay: float) -> torch.Tensor:
    """h ← β2 h + (1-β2) ĥ + ½(1-β2)² (h - ĥ)²/(h + δ) (Alg. 1 line 6): the EMA, and a correction term that keeps h
    positive where ĥ is negative."""
    return beta2 * h + (1.0 - beta2) * f + 0.5 * (1.0 - beta2) ** 2 * (h - f).square() / (h + weight_decay)


def _new_param_average(m: torch.Tensor, h: torch.Tensor, mom: torch.Tensor, *, lr: float, weight_decay: float,
                       clip_radius: float, debias: float) -> torch.Tensor:
    """m ← m - lr clip((m̄/debias + δ m)/(h + δ), ±r), in place (Alg. 1 line 7, with ivon-opt's element-wise clip): a
    Newton-like step with the debiased momentum, the prior precision δ as weight decay."""
    direction = (mom / debias + m * weight_decay) / (h + weight_decay)
    return m.sub_(direction.clamp(-clip_radius, clip_radius) * lr)


def _single_tensor_sample(weights: list[torch.Tensor], means: list[torch.Tensor], hess: list[torch.Tensor],
                          noise: list[torch.Tensor], *, ess: float, weight_decay: float) -> None:
    """m into `means`, the sample θ = m + σ⊙e into the weights (Alg. 1 line 3)."""
    for w, m, h, e in zip(weights, means, hess, noise):
        m.copy_(w)
        w.add_(_sigma(h, ess=ess, weight_decay=weight_decay) * e)


def _single_tensor_ivon(weights: list[torch.Tensor], grads: list[torch.Tensor], momentum: list[torch.Tensor],
                        hess: list[torch.Tensor], nxg: list[torch.Tensor], *, lr: float, beta1: float, beta2: float,
                        weight_decay: float, ess: float, debias: float, clip_radius: float,
                        times_grad: bool = False) -> None:
    """One IVON step, in place (Shen et al. 2024, "Variational Learning is Effective for Large Deep Networks", Alg. 1
    lines 4-7). `grads` is the gradient estimate ĝ and `nxg` mean(e⊙g) (e, if `times_grad`: one sample, whose e
    waited for its gradient), both averaged over the step's samples θ = m + σ⊙e by the optimizer; `lr` the rate
    applied (ivon-opt's `rescale_lr`: lr (h0 + δ)), `debias` 1 - β1^t (or 1)."""
    for m, g, mom, h, n in zip(weights, grads, momentum, hess, nxg):
        f = _nll_hess(h, n * g if times_grad else n, ess=ess, weight_decay=weight_decay)
        _new_momentum(mom, g, beta1)
        h.copy_(_new_hess(h, f, beta2=beta2, weight_decay=weight_decay))
        _new_param_average(m, h, mom, lr=lr, weight_decay=weight_decay, clip_radius=clip_radius, debias=debias)


def _on_device(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A kernel's scalars on `like`'s device (no wait for it), as a tensor: new values compile no new graph."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    if like.device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(like.device, non_blocking=True)


def perturb(weights: list[torch.Tensor], means: list[torch.Tensor], hess: list[torch.Tensor],
            noise: list[torch.Tensor] | None, coef: torch.Tensor) -> None:
    """m into `means`, θ = m + σ⊙e into the weights, σ = ess^-1/2 / sqrt(h + δ); coef = (ess^-1/2, δ)."""
    noise = [torch.randn_like(w) for w in weights] if noise is None else noise
    torch._foreach_copy_(means, weights)
    std = torch._foreach_rsqrt(torch._foreach_add(hess, coef[1]))
    torch._foreach_mul_(std, noise)
    torch._foreach_mul_(std, coef[0])
    torch._foreach_add_(weights, std)


def noise_times_grad(out: list[torch.Tensor], grads: list[torch.Tensor], noise: list[torch.Tensor] | None) -> None:
    """out ← e⊙g, e drawn again (`noise=None`, the generator seeded as for `perturb`) or given."""
    noise = [torch.randn_like(o) for o in out] if noise is None else noise
    torch._foreach_copy_(out, torch._foreach_mul(noise, grads))


def update(weights: list[torch.Tensor], grads: list[torch.Tensor], momentum: list[torch.Tensor],
           hess: list[torch.Tensor], nxg: list[torch.Tensor], coef: torch.Tensor, *, hessian_moves: bool,
           radius: float, times_grad: bool) -> None:
    """One IVON step (Alg. 1 lines 5-8), with ḡ `grads` and mean(e⊙g) `nxg` (e if `times_grad`); coef = (β1, 1-β1,
    δ, sqrt(ess), ½(1-β2) sqrt(ess), (1-β2) sqrt(ess), 1-β1^t (or 1), lr' (lr (h0 + δ) if rescale_lr))."""
    nxg = torch._foreach_mul(nxg, grads) if times_grad else nxg
    b1, one_minus_b1, wd, root, half_rate, rate, debias, lr = coef.unbind()
    torch._foreach_mul_(momentum, b1)  # m ← β1 m + (1-β1) ḡ
    torch._foreach_add_(momentum, torch._foreach_mul(grads, one_minus_b1))
    if hessian_moves:  # β2 < 1
        # h ← β2 h + (1-β2) f + ½(1-β2)² (h-f)²/(h+δ), with the 'price' estimate f = ess (h+δ) mean(σ⊙e⊙g)
        # = r s n (r = sqrt(ess), s = sqrt(h+δ), n = mean(e⊙g)). With q = n - h/(r s), f - h = r s q, so
        # h ← h + (1-β2) r q (s + ½(1-β2) r q)
        s = torch._foreach_sqrt(torch._foreach_add(hess, wd))
        q = torch._foreach_sub(nxg, torch._foreach_div(hess, torch._foreach_mul(s, root)))  # nxg is not written
        torch._foreach_add_(s, torch._foreach_mul(q, half_rate))
        torch._foreach_mul_(q, s)
        torch._foreach_mul_(q, rate)
        torch._foreach_add_(hess, q)
    # m ← m - lr' clip((m̂ + δ m)/(h + δ), ±r), with m̂ the debiased momentum
    direction = torch._foreach_div(momentum, debias)
    torch._foreach_add_(direction, torch._foreach_mul(weights, wd))
    torch._foreach_div_(direction, torch._foreach_add(hess, wd))
    if radius < math.inf:
        torch._foreach_clamp_min_(direction, -radius)
        torch._foreach_clamp_max_(direction, radius)
    torch._foreach_mul_(direction, lr)
    torch._foreach_sub_(weights, direction)


@contextlib.contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """`device`'s default generator seeded for the body, then as it was (Inductor's kernels take their seeds there)."""
    gen = (torch.default_generator if device.type == "cpu"  # a parameter's device has its index
           else torch.get_device_module(device.type).default_generators[device.index])
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # A process's first backward sizes autograd's device threads, once: after torch.compile's fake tensors, a device
    # would count, and autograd then refuses to run in forked children. A backward before compiling prevents it.
    with torch.enable_grad():
        torch.ones(1, requires_grad=True).sum().backward()
    return torch.compile(fn, fullgraph=True)


class Dispatch:
    """Runs `perturb`, `noise_times_grad` and `update` through torch.compile or eagerly (foreach ops) by the
    optimizer's `compiled` flag: None compiles where torch.compile works, else warns once and runs eagerly (compiling
    fails before writing); True raises there; False runs eagerly. `foreach=False` (the optimizer then runs the
    for-loop reference, not these) compiles nothing, and refuses compiled=True as torch.optim refuses fused=True."""

    def __init__(self, compiled: bool | None, foreach: bool | None = None) -> None:
        if foreach is False and compiled:
            raise ValueError("compiled=True (ivon_compiled) compiles the foreach kernels, foreach=False (ivon_foreach) "
                             "runs the for-loop reference: pass one of them.")
        self.compiled, self.compiles = compiled, compiled is not False and foreach is not False

    def __call__(self, fn: Callable, *args: list[torch.Tensor] | torch.Tensor | None, **flags: Any) -> None:
        if self.compiles:
            try:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    return _compiled(fn)(*args, **flags)
            except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.FailOnRecompileLimitHit) as err:
                cause = getattr(err, "inner_exception", None) or err
                first_line = str(cause).strip().split("\n")[0]
                reason = f"IVON's kernels do not compile ({type(cause).__name__}: {first_line})"
                fix = ("a C++ compiler (g++; on GPUs Triton) for torch.compile, or pass compiled=False "
                       "(--ivon_compiled false)")
                if self.compiled:
                    raise RuntimeError(f"compiled=True, but {reason}: install {fix}.") from err
                warnings.warn(f"{reason}; using foreach ops, which are slower. Install {fix} to silence this.",
                              RuntimeWarning, stacklevel=1)
                self.compiles = False
        fn(*args, **flags)  # with temporaries of up to a few parameter sizes, as torch's foreach AdamW
