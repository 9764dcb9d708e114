"""IVON's per-weight arithmetic as fused CPU loops, compiled by torch.compile (Inductor's C++ backend).

On the CPU the optimizer is memory-bound: the foreach formulation of `VariationalIVON` makes about fourteen passes
over parameter-sized tensors per step and sample, where these kernels read and write each tensor once. A sample
reads m and h and writes the mean's copy, e and θ, computing e in the loop (`counter_normal`, whose arithmetic
overlaps the memory traffic); a step reads m, ḡ, momentum, h and e or mean(e⊙g), and writes m, momentum, h. The
formulas are those of `VariationalIVON._update_chunk` and `_update_mean`, written element-wise; the tests run both
against ivon-opt.

Compiling needs a C++ compiler and takes ~15 s the first time on a machine, then ~5 s per process (dynamo's trace;
Inductor's on-disk cache answers the rest).
`cpu_kernels()` compiles and runs the kernels once on a tiny input and reports why they are unavailable instead of
raising, so that the optimizer can fall back to its foreach formulation.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch

from .noise import counter_key, counter_normal

__all__ = ["cpu_kernels", "sample_coefficients", "update_coefficients"]


def _sample(weight: torch.Tensor, mean: torch.Tensor, noise: torch.Tensor, hess: torch.Tensor,
            coef: torch.Tensor, key: torch.Tensor) -> None:
    """mean ← m; e ← `counter_normal` of `key` into the noise buffer; θ = m + σ⊙e into the weight, with
    σ = ess^-1/2 / sqrt(h + δ). coef = (ess^-1/2, δ)."""
    # θ is formed from what was stored in mean and noise: with the same formula written on the weight and e,
    # torch 2.14's Inductor stores θ into the mean too (caught by `cpu_kernels`' check of its probe)
    mean.copy_(weight)
    noise.copy_(counter_normal(weight.shape, key, weight.device))
    weight.copy_(mean + noise * (coef[0] * torch.rsqrt(hess + coef[1])))


def _update(weight: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, hess: torch.Tensor,
            nxg: torch.Tensor, coef: torch.Tensor, times_grad: bool) -> None:
    """One IVON step of one tensor (Shen et al. 2024, Alg. 1 lines 5-8, ivon-opt's 'price' estimate), with `nxg`
    mean(e⊙g), or e of the step's one sample if `times_grad` (the product is formed here, where e and g are read).

    coef = (1-β1, 1-β2, δ, sqrt(ess), lr'/debias, δ·debias, r·debias), with r = inf when unclipped and 1-β2 = 0 for a
    fixed Hessian (both leave the update as the unclipped / fixed-Hessian formula for finite inputs, so one compiled
    loop serves every setting).
    """
    one_minus_b1, one_minus_b2, wd, root, step_size, decay, radius = coef.unbind()
    if times_grad:
        nxg = nxg * grad
    momentum.copy_(torch.lerp(momentum, grad, one_minus_b1))
    # h ← h + (1-β2) r q (s + ½(1-β2) r q), s = sqrt(h + δ), q = mean(e⊙g) - h/(r s): see `_update_chunk`
    s = torch.sqrt(hess + wd)
    q = nxg - hess / (root * s)
    hess.copy_(hess + one_minus_b2 * root * q * (s + 0.5 * one_minus_b2 * root * q))
    # m ← m - lr' clip((m̂ + δ m)/(h + δ), ±r), as clip(momentum + δ debias m, ±r debias)/debias
    direction = torch.clamp((momentum + decay * weight) / (hess + wd), -radius, radius)
    weight.copy_(weight - step_size * direction)


def sample_coefficients(group: dict, dtype: torch.dtype) -> torch.Tensor:
    """`_sample`'s coef for a param group, as a tensor (a Python float would be compiled in as a constant)."""
    return torch.tensor([group["ess"] ** -0.5, group["weight_decay"]], dtype=_coef_dtype(dtype))


def update_coefficients(group: dict, dtype: torch.dtype, *, step_size: float, debias: float) -> torch.Tensor:
    """`_update`'s coef for a param group at one step (β2 = 1, a fixed Hessian, gives 1-β2 = 0 exactly)."""
    wd = group["weight_decay"]
    values = [1.0 - group["beta1"], 1.0 - group["beta2"], wd, math.sqrt(group["ess"]), step_size, wd * debias,
              group["clip_radius"] * debias]
    return torch.tensor(values, dtype=_coef_dtype(dtype))


def _coef_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scalars in the precision the foreach ops compute in: float32 for float32 and narrower, else float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class CpuKernels:
    """The compiled `_sample` and `_update`, or `error` saying why they could not be built."""

    def __init__(self, sample: Callable | None, update: Callable | None, error: str | None) -> None:
        self.sample, self.update, self.error = sample, update, error


def _check_against_eager(sample: Callable, update: Callable) -> None:
    """Runs the compiled loops (which compiles them) on 37 elements, vectorised and scalar parts both, against the
    same functions run eagerly: a compiler that miscompiles them must not train a model."""
    g = torch.Generator().manual_seed(0)
    weight, grad, nxg = (torch.randn(37, generator=g) for _ in range(3))
    hess = torch.rand(37, generator=g) + 0.1
    sample_coef = torch.tensor([0.1, 0.01])
    update_coef = torch.tensor([0.1, 0.01, 0.01, 10.0, 0.1, 0.001, 0.5])
    calls = [(_sample, sample, lambda: (weight.clone(), torch.empty(37), torch.empty(37), hess.clone(), sample_coef,
                                        counter_key(0)))]
    for times_grad in (True, False):  # a bool is compiled in: each value is its own loop
        calls.append((_update, update, lambda times_grad=times_grad: (
            weight.clone(), grad, torch.zeros(37), hess.clone(), nxg.clone(), update_coef, times_grad)))
    for eager, compiled, args in calls:
        expected, got = args(), args()
        eager(*expected)
        compiled(*got)
        for a, b in zip(expected[:5], got[:5]):  # the tensors the loop may write
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"the compiled {eager.__name__} loop disagrees with its eager formula")


@functools.cache
def cpu_kernels() -> CpuKernels:
    """The kernels, compiled and checked against their eager formulas on a tiny float32 input (the compile happens
    there: sizes are dynamic)."""
    # importing the C++ backend warns that no CUDA runtime exists, which is irrelevant to CPU kernels
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        # A process's first backward sizes autograd's device threads, once; the fake tensors torch.compile traces
        # with would count as a device by then, and autograd refuses to run in forked children of a process with
        # device threads (e.g. multiprocessing's fork). A backward before compiling leaves autograd as without it.
        with torch.enable_grad():
            torch.ones(1, requires_grad=True).sum().backward()
        sample = torch.compile(_sample, dynamic=True, fullgraph=True)
        update = torch.compile(_update, dynamic=True, fullgraph=True)
        with torch.no_grad():
            _check_against_eager(sample, update)
        return CpuKernels(sample, update, None)
    except Exception as err:  # noqa: BLE001 - any failure to build means: use the foreach formulation
        first_line = (str(err).strip().splitlines() or [""])[0]
        return CpuKernels(None, None, f"{type(err).__name__}: {first_line}")
    finally:
        quiet.setLevel(level)
