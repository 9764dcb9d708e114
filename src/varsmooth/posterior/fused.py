"""IVON's per-weight arithmetic as fused CPU loops, compiled by torch.compile (Inductor's C++ backend).

On the CPU the optimizer is memory-bound: the foreach formulation of `VariationalIVON` makes about fourteen passes
over parameter-sized tensors per step and sample, where these kernels read and write each tensor once. A sample
reads m and h and writes the mean's copy, e and θ, computing e in the loop (`counter_normal`, whose arithmetic
overlaps the memory traffic); a step reads m, ḡ, momentum, h and e or mean(e⊙g), and writes m, momentum, h. The
formulas are those of `VariationalIVON._update_chunk` and `_update_mean`, written element-wise; the tests run both
against ivon-opt.

Compiling needs a C++ compiler and takes ~15 s the first time on a machine, then ~5 s per process (dynamo's trace;
Inductor's on-disk cache answers the rest).
`cpu_kernels()` compiles the kernels and runs them against the same functions run eagerly, on a tiny input, and
reports why they are unavailable instead of raising, so that the optimizer can fall back to its foreach formulation;
`CpuKernels.error_for` does the same for each further dtype. The check is no formality: torch 2.14's Inductor
miscompiled one formulation of `_sample` (see there).
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
            nxg: torch.Tensor, coef: torch.Tensor, times_grad: torch.Tensor) -> None:
    """One IVON step of one tensor (Shen et al. 2024, Alg. 1 lines 5-8, ivon-opt's 'price' estimate), with `nxg`
    mean(e⊙g), or e of the step's one sample if `times_grad` (the product is formed here, where e and g are read).
    `times_grad` is a bool tensor, not a bool: dynamo compiles a loop per value of a Python bool, and every loop
    counts towards its limit of 8 per function, which several dtypes would exceed.

    coef = (1-β1, 1-β2, δ, sqrt(ess), lr'/debias, δ·debias, r·debias), with r = inf when unclipped and 1-β2 = 0 for a
    fixed Hessian (both leave the update as the unclipped / fixed-Hessian formula for finite inputs, so one compiled
    loop serves every setting).
    """
    one_minus_b1, one_minus_b2, wd, root, step_size, decay, radius = coef.unbind()
    nxg = torch.where(times_grad, nxg * grad, nxg)
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
    """The compiled `_sample` and `_update`, or `error` saying why they could not be built.

    Each dtype compiles its own loops on first use; `error_for(dtype)` checks them against the eager formulas then,
    once per process, like the float32 loops `cpu_kernels` checks.
    """

    def __init__(self, sample: Callable | None, update: Callable | None, error: str | None) -> None:
        self.sample, self.update, self.error = sample, update, error
        self._errors: dict[torch.dtype, str | None] = {torch.float32: error}

    def error_for(self, dtype: torch.dtype) -> str | None:
        """Why the loops cannot run tensors of `dtype` (None: they can)."""
        if dtype not in self._errors:
            self._errors[dtype] = _build_error(lambda: _check_against_eager(self.sample, self.update, dtype))
        return self._errors[dtype]


def _check_against_eager(sample: Callable, update: Callable, dtype: torch.dtype) -> None:
    """Runs the compiled loops (which compiles them) on 37 elements of `dtype`, vectorised and scalar parts both,
    against the same functions run eagerly: a compiler that miscompiles them must not train a model. Half precision
    rounds each eager operation, the loops only their results: a tolerance of a few of its units."""
    g = torch.Generator().manual_seed(0)
    weight, grad, nxg = (torch.randn(37, generator=g).to(dtype) for _ in range(3))
    hess = (torch.rand(37, generator=g) + 0.1).to(dtype)
    sample_coef = torch.tensor([0.1, 0.01], dtype=_coef_dtype(dtype))
    update_coef = torch.tensor([0.1, 0.01, 0.01, 10.0, 0.1, 0.001, 0.5], dtype=_coef_dtype(dtype))
    buffer = lambda: torch.empty(37, dtype=dtype)  # noqa: E731
    # the weight is a parameter, as in training: dynamo's guards tell tensors that require grad apart
    calls = [(_sample, sample, lambda: (weight.clone().requires_grad_(), buffer(), buffer(), hess.clone(),
                                        sample_coef, counter_key(0)))]
    for times_grad in (True, False):
        calls.append((_update, update, lambda times_grad=times_grad: (
            weight.clone().requires_grad_(), grad, torch.zeros(37, dtype=dtype), hess.clone(), nxg.clone(),
            update_coef, torch.tensor(times_grad))))
    rtol, atol = (1e-5, 1e-6) if torch.finfo(dtype).bits >= 32 else (2e-2, 2e-2)
    with torch.no_grad():
        for eager, compiled, args in calls:
            expected, got = args(), args()
            eager(*expected)
            compiled(*got)
            for a, b in zip(expected[:5], got[:5]):  # the tensors the loop may write
                if not torch.allclose(a, b, rtol=rtol, atol=atol):
                    raise RuntimeError(f"the compiled {eager.__name__} loop disagrees with its eager formula "
                                       f"for {dtype}")


def _build_error(build: Callable[[], None]) -> str | None:
    """Runs `build`, which compiles and checks loops; returns why it failed (its error's first line), or None."""
    # importing the C++ backend warns that no CUDA runtime exists, which is irrelevant to CPU kernels
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        build()
        return None
    except Exception as err:  # noqa: BLE001 - any failure to build means: use the foreach formulation
        first_line = (str(err).strip().splitlines() or [""])[0]
        return f"{type(err).__name__}: {first_line}"
    finally:
        quiet.setLevel(level)


@functools.cache
def cpu_kernels() -> CpuKernels:
    """The kernels, compiled and checked against their eager formulas on a tiny float32 input (the compile happens
    there: sizes are dynamic)."""
    kernels = {}

    def build() -> None:
        # A process's first backward sizes autograd's device threads, once; the fake tensors torch.compile traces
        # with would count as a device by then, and autograd refuses to run in forked children of a process with
        # device threads (e.g. multiprocessing's fork). A backward before compiling leaves autograd as without it.
        with torch.enable_grad():
            torch.ones(1, requires_grad=True).sum().backward()
        kernels["sample"] = torch.compile(_sample, dynamic=True, fullgraph=True)
        kernels["update"] = torch.compile(_update, dynamic=True, fullgraph=True)
        if kernels["sample"] is _sample:  # eager, `counter_normal` costs 10× the foreach formulation's draw
            raise RuntimeError("torch.compile is switched off (TORCHDYNAMO_DISABLE=1)")
        _check_against_eager(kernels["sample"], kernels["update"], torch.float32)

    error = _build_error(build)
    return CpuKernels(None, None, error) if error else CpuKernels(kernels["sample"], kernels["update"], None)
