"""Sharpness-aware minimization (SAM; Foret et al. 2020) and its adaptive variant (ASAM; Kwon et al. 2021).

SAM runs as a `training_step` around whatever optimizer the Trainer's `optim` builds (the "base optimizer"),
so learning-rate schedules, weight decay, gradient clipping and mixed precision stay the Trainer's own. Per
micro-batch (Foret et al. 2020, Eq. 2 and Alg. 1; Kwon et al. 2021 for ASAM; the update of davda54/sam and
`pytorch_optimizer.SAM`, verified against the latter in the tests):

    g   = ∇L_B(w)                                    pass 1 (no DDP all-reduce)
    ε̂   = ρ·T²g / (‖Tg‖₂ + 1e-12)                    T = I, or T = diag(|w|) with `sam_adaptive`
    g_B = ∇L_B(w + ε̂)                                pass 2, accumulated like any micro-batch gradient
    w is restored bit-exactly from a copy; the Trainer then clips and calls the base optimizer once per step.

Under gradient accumulation every micro-batch gets its own ε̂ from its own gradient ("m-sharpness" with m =
micro-batch size, Foret et al. 2020 §4.1, also what the paper does across accelerators), not one ε̂ from the full
accumulated batch. Under DDP each process likewise perturbs with its own gradient; pass 2 is all-reduced
as usual. Cost: two forward/backward passes per micro-batch and one copy of the weights.

BatchNorm running statistics are updated once per micro-batch, by pass 1 at the unperturbed weights: pass 2
runs with momentum 0 and `num_batches_tracked` restored (davda54 `bypass_bn.py`). Dropout draws different
masks in the two passes, as in the references.

Checkpoints: the perturbation exists only inside one micro-batch's `training_step` (checkpoints are written
between optimizer steps), so there is no SAM state to save beyond the base optimizer's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .base import MethodConfig, MethodContext, TrainingMethod, register_method

__all__ = ["SAMConfig", "SAMMethod", "sam_perturbation"]

#: added to the gradient norm in ε̂'s denominator (davda54, pytorch-optimizer)
PERTURB_EPS = 1e-12


@torch.no_grad()
def sam_perturbation(params: list[torch.Tensor], rho: float, adaptive: bool = False) -> list[torch.Tensor | None]:
    """ε̂ = ρ·T²g/(‖Tg‖₂ + 1e-12) from the gradients in `.grad`; the norm is global over all `params`.

    Returns None for parameters without a gradient, and all-zero perturbations when the norm is not finite
    (an fp16 overflow: the base step is then skipped by the grad scaler anyway).
    """
    grads = [(p, p.grad) for p in params if p.grad is not None]
    if not grads:
        return [None] * len(params)
    scaled = [g * p.abs() if adaptive else g for p, g in grads]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s.float()) for s in scaled]))
    scale = rho / (norm + PERTURB_EPS)
    finite = torch.isfinite(scale)
    perturbations = iter([
        torch.where(finite, (p * p if adaptive else 1.0) * g * scale.to(g.dtype), torch.zeros_like(g)) for p, g in grads
    ])
    return [next(perturbations) if p.grad is not None else None for p in params]


@contextlib.contextmanager
def batchnorm_stats_frozen(model: nn.Module) -> Iterator[None]:
    """BatchNorm layers normalise with the batch statistics as usual but leave their running statistics alone."""
    saved = []
    for module in model.modules():
        if isinstance(module, _BatchNorm) and module.track_running_stats and module.training:
            tracked = module.num_batches_tracked.clone() if module.num_batches_tracked is not None else None
            saved.append((module, module.momentum, tracked))
            module.momentum = 0.0  # running = (1 − 0)·running + 0·batch
    try:
        yield
    finally:
        for module, momentum, tracked in saved:
            module.momentum = momentum
            if tracked is not None:
                module.num_batches_tracked.copy_(tracked)


@dataclass
class SAMConfig(MethodConfig):
    """Settings of method='sam'."""

    sam_rho: float = field(default=0.05, metadata={"help": "method='sam': neighbourhood radius ρ (Foret et al. 2020)."})
    sam_adaptive: bool = field(
        default=False,
        metadata={"help": "method='sam': adaptive SAM (ASAM), perturbation scaled by |w|; use a ~10x larger sam_rho."},
    )

    def __post_init__(self) -> None:
        if not self.sam_rho >= 0:
            raise ValueError(f"sam_rho must be >= 0, got {self.sam_rho}.")


class SAMMethod(TrainingMethod):
    """Cross-entropy minimised by SAM (ρ = `sam_rho`) or ASAM (`sam_adaptive`, T = |w|) around the Trainer's
    optimizer."""

    paper: ClassVar[str] = ("Foret et al. 2020, Sharpness-Aware Minimization for Efficiently Improving Generalization; "
                            "ASAM: Kwon et al. 2021")
    #: SAM's own rate for a network trained from scratch, chosen on the image example's noisy validation split
    #: (benchmarks/example_learning_rates.py)
    scratch_learning_rate: ClassVar[float] = 3e-4
    config: SAMConfig

    def training_step(self, model: nn.Module, inputs: dict[str, Any], context: MethodContext) -> torch.Tensor:
        params = [p for p in model.parameters() if p.requires_grad]
        # SAM gradients of the earlier micro-batches of this step: pass 2 accumulates onto them, so that DDP
        # all-reduces the complete sum on the last micro-batch.
        accumulated = [p.grad for p in params]
        for p in params:
            p.grad = None
        no_sync = context.accelerator.no_sync(model) if context.accelerator is not None else contextlib.nullcontext()
        with no_sync:
            loss = self.training_loss(model, inputs, context)
            context.backward(loss)
        perturbations = sam_perturbation(params, self.config.sam_rho, self.config.sam_adaptive)
        originals = []
        with torch.no_grad():
            for p, e, g in zip(params, perturbations, accumulated):
                originals.append(p.detach().clone() if e is not None else None)
                if e is not None:
                    p.add_(e)
                p.grad = g
        try:
            with batchnorm_stats_frozen(model):
                perturbed_loss = self.training_loss(model, inputs, context)
            context.backward(perturbed_loss / context.gradient_accumulation_steps)
        finally:
            with torch.no_grad():
                for p, original in zip(params, originals):
                    if original is not None:
                        p.copy_(original)
        context.note_finite(loss, params if context.gradients_complete else None)
        # what the Trainer logs: the loss at w, the usual training loss
        return loss.detach() / context.gradient_accumulation_steps

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "micro_batch_perturbation": True}


register_method("sam", SAMConfig, SAMMethod)
