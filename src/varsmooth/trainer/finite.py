"""Stop an optimizer step whose loss, gradients or buffers are not finite, before it is applied: the weights (and
IVON's posterior) then stay those of the last finite step, so no checkpoint or save ever holds NaN or inf."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..posterior.sharding import to_local

__all__ = ["NonFiniteGuard", "non_finite_step_error"]


class NonFiniteGuard:
    """Collects, on the device, whether every loss, gradient and buffer of an optimizer step is finite (`note`, no
    host sync), and reads the verdict once per step (`verdict`: one host sync, one all-reduce across processes)."""

    def __init__(self) -> None:
        self._flags: torch.Tensor | None = None  # (loss, gradients, buffers) finite over the step so far

    def note(self, loss: torch.Tensor, params: Iterable[torch.Tensor] | None, buffers: Iterable[torch.Tensor],
             check_gradients: bool = True) -> None:
        """Record whether `loss`, the gradients of `params` (None: not complete yet, not checked) and, with them, the
        floating-point `buffers` (e.g. BatchNorm's running statistics, updated by the forward) are finite.
        `check_gradients=False` under fp16's gradient scaler, which expects inf gradients and skips those steps."""
        loss_ok = torch.isfinite(loss.detach()).all()

        def finite(tensors: list[torch.Tensor]) -> torch.Tensor:
            # a NaN or ±inf entry makes the sum non-finite (as would a sum past float32's 3e38, far beyond any
            # trainable gradient); one sum per tensor costs ~2 % of a ResNet-18 forward+backward on a CPU core, where
            # a max-norm costs ~25 %
            if not tensors:
                return torch.ones_like(loss_ok)
            return torch.isfinite(torch.stack([t.sum(dtype=torch.float32).to(loss_ok.device) for t in tensors]).sum())

        grads = [to_local(p.grad) for p in params or () if p.grad is not None] if check_gradients else []
        floats = [to_local(b) for b in buffers if b.is_floating_point()] if params is not None else []
        flags = torch.stack([loss_ok, finite(grads), finite(floats)])  # no copy to the host until the step ends
        self._flags = flags if self._flags is None else self._flags & flags

    def verdict(self, device: torch.device | str, distributed: bool) -> tuple[bool, bool, bool] | None:
        """(loss, gradients, buffers) finite over the step noted so far, in every process when `distributed`; None
        when nothing was noted. Starts the next step afresh."""
        if self._flags is None:
            return None
        flags, self._flags = self._flags.to(device).int(), None
        if distributed:  # under DDP and FSDP each process saw other gradients
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
        loss_ok, grads_ok, buffers_ok = (bool(f) for f in flags.tolist())
        return loss_ok, grads_ok, buffers_ok


def non_finite_step_error(verdict: tuple[bool, bool, bool], step: int, method: str, step_settings: str,
                          bad_buffers: list[str]) -> FloatingPointError:
    """The error that stops optimizer step `step` (counted from 1) of `method` for a `NonFiniteGuard.verdict`, naming
    what was not finite, what was kept, and the fix: lower `step_settings` (the method's settings that bound a step,
    `TrainingMethod.step_settings`); `bad_buffers` are the buffers now non-finite (saving is refused)."""
    loss_ok, grads_ok, _ = verdict
    what = ("training loss" if not loss_ok else
            "gradients (NaN, inf or past float32's range, with a finite loss)" if not grads_ok else
            "buffers (running statistics the forward pass updates)")
    after = f"after step {step - 1}" if step > 1 else "the initial ones"
    state = ("and saving them is safe" if not bad_buffers else
             f"but the forward pass made the buffers {bad_buffers[:5]} non-finite, so saving is refused: resume from "
             "the last checkpoint, or load the last save")
    return FloatingPointError(
        f"Non-finite {what} in optimizer step {step} with method={method!r}. That step was not applied: the weights "
        f"and optimizer state are those of the last finite step ({after}), {state}. Check the inputs for NaN or inf "
        f"values (a single inf feature gives a finite loss but inf gradients), or lower {step_settings}."
    )
