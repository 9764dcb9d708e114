"""How much IVON smooths, set like label smoothing's α: `ivon_smoothing`.

Label smoothing with rate α trains every example on y + ε with ‖ε‖₁ = 2α(1 − 1/K) (K classes). Training with IVON
trains on y + ε̄_i, ε̄_i = softmax(f(x_i; m)) − E_q[softmax(f(x_i; θ))] (Variational Learning Induces Adaptive Label
Smoothing (Yang et al. 2025), Eq. 15): per example, as the data says, but with a mean size that the effective sample
size λ (`ess`) sets, since σ = 1/sqrt(λ(h + δ)) and, to second order in σ, ε̄ is linear in σ², so mean ‖ε̄‖₁ ∝ 1/λ.
Which λ gives a measurable smoothing depends on the network (the expected loss increase of a draw is about P/(2λ) for
P weights at the curvature h), not on the number of examples, so no fixed λ suits every model.

`SmoothingStrengthCallback` turns that around: the user gives α, and λ follows the data so that the mean ‖ε̄_i‖₁ over
a fixed probe of training examples equals LS's 2α(1 − 1/K). It measures ε̄ on the probe at evenly spaced steps and
rescales λ by measured/target (the 1/λ law), the change bounded per update because early in training (a fresh
classification head predicts uniformly, where ε̄ vanishes for any σ) the law does not hold yet. Which examples get how
much of that mean is still the posterior's: the knob sets the total, as α does, and IVON distributes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..posterior import DiagonalGaussianPosterior
from ..prediction import predictive_distribution

__all__ = ["SmoothingStrengthCallback", "label_smoothing_noise", "mean_label_noise"]


def label_smoothing_noise(alpha: float, num_classes: int) -> float:
    """‖ε‖₁ of label smoothing with rate α over K classes: y_LS = (1 − α)y + α/K, so ε = α(1/K − y), of L1 size
    α(1 − 1/K) at the label plus α/K at each of the K − 1 others."""
    return 2.0 * alpha * (1.0 - 1.0 / num_classes)


@torch.no_grad()
def mean_label_noise(model: torch.nn.Module, posterior: DiagonalGaussianPosterior,
                     batches: Iterable[Mapping[str, Any]], num_samples: int, seed: int) -> tuple[float, int, int]:
    """(Σ_i ‖ε̄_i‖₁, number of examples, number of classes) over `batches`, with `num_samples` draws of `posterior` at
    τ = 1 (the noise training with q induces, whatever τ prediction uses), the model in eval mode (no dropout). A sum
    and a count, so that processes holding different shards can add theirs before dividing."""
    posterior = posterior.at_temperature(1.0)
    was_training = model.training
    model.eval()
    total, count, num_classes = 0.0, 0, 0
    try:
        for batch in batches:
            out = predictive_distribution(model, posterior, batch, num_samples, seed)
            total += float((out.mean_probs - out.probs).abs().sum())
            count, num_classes = count + out.probs.shape[0], out.probs.shape[-1]
    finally:
        model.train(was_training)
    return total, count, num_classes


class SmoothingStrengthCallback(TrainerCallback):
    """Sets IVON's ess during training so that its mean label noise matches label smoothing with rate `alpha`.

    At `num_updates` evenly spaced optimizer steps (the last one included) it measures the mean ‖ε̄‖₁ of the current
    posterior on the trainer's probe. The first update solves for ess: decade steps until the target is bracketed, then
    `bisections` halvings of the bracket in log ess (a preset's ess may be orders of magnitude off). Later ones correct
    by the 1/λ law, ess × measured/target, bounded to [1/`max_factor`, `max_factor`], as the mean and h move. Every
    process must call it, since the measure adds the shards. `history` holds each update (step, measured mean
    ‖ε̄‖₁ before it, target, ess after it); the last also goes into the training logs as `label_noise_l1` and `ess`.
    """

    def __init__(self, alpha: float, num_updates: int = 5, num_samples: int = 8, max_factor: float = 3.0,
                 bisections: int = 4, max_decades: int = 10) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"ivon_smoothing is a label-smoothing rate α in (0, 1], got {alpha}.")
        if num_updates < 1 or num_samples < 1 or not max_factor > 1 or bisections < 0 or max_decades < 1:
            raise ValueError(f"Need num_updates >= 1, num_samples >= 1, max_factor > 1, bisections >= 0 and "
                             f"max_decades >= 1, got {num_updates}, {num_samples}, {max_factor}, {bisections}, "
                             f"{max_decades}.")
        self.alpha, self.num_updates, self.num_samples, self.max_factor = alpha, num_updates, num_samples, max_factor
        self.bisections, self.max_decades = bisections, max_decades
        self.history: list[dict[str, float]] = []
        self._measure: Callable[[int, int], tuple[float, int]] | None = None

    def connect(self, measure: Callable[[int, int], tuple[float, int]], scale_ess: Callable[[float], float],
                seed: int) -> "SmoothingStrengthCallback":
        """`measure(num_samples, seed)`: the mean ‖ε̄‖₁ on the trainer's probe of training examples and the number of
        classes K; `scale_ess(factor)`: multiplies IVON's ess by `factor` and returns the new value."""
        self._measure, self._scale_ess, self._seed = measure, scale_ess, seed
        return self

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._measure is None:
            raise RuntimeError("SmoothingStrengthCallback needs a varsmooth.VariationalTrainer training IVON (it "
                               "measures that trainer's posterior): set ivon_smoothing in its arguments.")

    def updates_at(self, max_steps: int) -> list[int]:
        """The optimizer steps after which ess is updated: `num_updates` evenly spaced, the last at the run's end, so
        that the posterior saved is the one whose label noise was set (ε̄ grows as the mean's predictions sharpen:
        with the last update at 5/6 of a run, the exported mean |ε̄|₁ came out about twice the target)."""
        interval = max_steps / self.num_updates
        return sorted({s for k in range(1, self.num_updates + 1) if 0 < (s := math.floor(k * interval)) <= max_steps})

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        updates = self.updates_at(state.max_steps)
        if state.global_step not in updates:
            return
        seed = self._seed + state.global_step  # the same draws on every process and in a resumed run
        measured, num_classes = self._measure(self.num_samples, seed)
        target = label_smoothing_noise(self.alpha, num_classes)
        if self.history or state.global_step != updates[0]:  # a resumed run's first update is a correction too
            ess = self._scale_ess(min(self.max_factor, max(1.0 / self.max_factor, measured / target)))
        else:
            ess = self._solve(measured, target, seed)
        self.history.append({"step": state.global_step, "label_noise_l1": measured, "target": target, "ess": ess})

    def _solve(self, measured: float, target: float, seed: int) -> float:
        """The ess (on a log scale, to within 10^(2^-bisections)) at which the probe's mean ‖ε̄‖₁ is `target`, given
        `measured` at the current ess; left there."""
        ess = self._scale_ess(1.0)

        def too_smooth(new: float) -> bool:  # sets ess to `new`
            nonlocal ess
            ess = self._scale_ess(new / ess)
            return self._measure(self.num_samples, seed)[0] > target

        # decades towards the target: ε̄ falls as ess grows
        step = 10.0 if measured > target else 0.1
        near = ess
        for _ in range(self.max_decades):
            if too_smooth(near * step) != (measured > target):
                break
            near *= step
        else:  # out of range: stay at the last decade tried
            return ess
        low, high = sorted((near, near * step))  # too smooth at `low`, not smooth enough at `high`
        for _ in range(self.bisections):
            middle = math.sqrt(low * high)
            low, high = (middle, high) if too_smooth(middle) else (low, middle)
        return self._scale_ess(math.sqrt(low * high) / ess)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs or not self.history:
            return
        last = {"label_noise_l1": self.history[-1]["label_noise_l1"], "ess": self.history[-1]["ess"]}
        logs.update(last)
        if state.log_history and "loss" in state.log_history[-1]:
            state.log_history[-1].update(last)
