"""How much IVON smooths, set like label smoothing's α: `ivon_smoothing`.

Label smoothing with rate α trains every example on y + ε, ε = α(u − y) (u = 1/K, K classes), of size
‖ε‖₁ = 2α(1 − 1/K). Training with IVON trains on y + ε̄_i, ε̄_i = softmax(f(x_i; m)) − E_q[softmax(f(x_i; θ))]
(Variational Learning Induces Adaptive Label Smoothing (Yang et al. 2025), Eq. 15): per example, as the data says,
but with a mean size that the effective sample size λ (`ess`) sets, since σ = 1/sqrt(λ(h + δ)) and, to second order
in σ, ε̄ is linear in σ², so mean ‖ε̄‖₁ ∝ 1/λ. Which λ gives a measurable smoothing depends on the network (the
expected loss increase of a draw is about P/(2λ) for P weights at the curvature h), not on the number of examples, so
no fixed λ suits every model.

`SmoothingStrengthCallback` turns that around: the user gives α, and λ follows the data so that the mean ‖ε̄_i‖₁
over a fixed probe of training examples is α times the mean ‖p̂_i − u‖₁, p̂_i = softmax(f(x_i; m)): LS's rule with the
model's prediction in place of the label. Where the mean predicts its labels with certainty that is LS's 2α(1 − 1/K);
where it predicts no better than uniform it is 0. The reference matters: as σ grows the draws' average tends to
uniform, so ‖ε̄_i‖₁ can never exceed about ‖p̂_i − u‖₁, and a fixed target of LS's size is out of reach while the mean
is unsure. Chasing one drove ess down by orders of magnitude, the draws' noise kept the mean from learning, its ε̄
shrank further, and a 2,000-sentence SST-2 run ended at chance (ess 1.8e-3). Relative to p̂ the loop runs the other
way: a mean that unlearns lowers its own target and ess goes back up.

The callback measures on the probe at evenly spaced steps and rescales λ by measured/target (the 1/λ law), the change
bounded per update because the mean moves between updates. Which examples get how much of that mean is still the
posterior's: the knob sets the total, as α does, and IVON distributes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..posterior import DiagonalGaussianPosterior
from ..prediction.bma import predictive_distribution

__all__ = ["LabelNoiseSums", "SmoothingStrengthCallback", "label_smoothing_noise", "mean_label_noise"]

#: below this mean ‖p̂ − u‖₁ the posterior mean predicts (almost) uniformly: nothing to smooth, ess is left alone
UNDECIDED_L1 = 1e-3


def label_smoothing_noise(alpha: float, num_classes: int) -> float:
    """‖ε‖₁ of label smoothing with rate α over K classes: y_LS = (1 − α)y + α/K, so ε = α(1/K − y), of L1 size
    α(1 − 1/K) at the label plus α/K at each of the K − 1 others."""
    return 2.0 * alpha * (1.0 - 1.0 / num_classes)


class LabelNoiseSums(NamedTuple):
    """Sums over examples, so that processes holding different shards can add theirs before dividing."""

    noise_l1: float  #: Σ_i ‖ε̄_i‖₁
    distance_from_uniform: float  #: Σ_i ‖p̂_i − 1/K‖₁, p̂_i the prediction at the posterior mean
    count: int  #: number of examples


@torch.no_grad()
def mean_label_noise(model: torch.nn.Module, posterior: DiagonalGaussianPosterior,
                     batches: Iterable[Mapping[str, Any]], num_samples: int, seed: int) -> LabelNoiseSums:
    """The label noise over `batches`, with `num_samples` draws of `posterior` at τ = 1 (the noise training with q
    induces, whatever τ prediction uses), the model in eval mode (no dropout)."""
    was_training = model.training
    model.eval()
    noise, distance, count = 0.0, 0.0, 0
    try:
        for batch in batches:
            out = predictive_distribution(model, posterior, batch, num_samples, seed)
            noise += float((out.mean_probs - out.probs).abs().sum())
            distance += float((out.mean_probs - 1.0 / out.probs.shape[-1]).abs().sum())
            count += out.probs.shape[0]
    finally:
        model.train(was_training)
    return LabelNoiseSums(noise, distance, count)


class SmoothingStrengthCallback(TrainerCallback):
    """Sets IVON's ess during training so that its mean label noise is α times the mean's distance from uniform.

    At `num_updates` evenly spaced optimizer steps (the last one included) it measures, on the trainer's probe, the
    mean ‖ε̄‖₁ of the current posterior and the target α·mean ‖p̂ − u‖₁. The first update solves for ess: decade steps
    until the target is bracketed, then `bisections` halvings of the bracket in log ess (a preset's ess may be orders
    of magnitude off); if `max_decades` do not bracket it, ess stays where it was. Later ones correct by the 1/λ law,
    ess × measured/target, bounded to [1/`max_factor`, `max_factor`], as the mean and h move. While the mean predicts
    almost uniformly (mean ‖p̂ − u‖₁ below `UNDECIDED_L1`) there is nothing to smooth and ess is left alone. Every
    process must call it, since the measure adds the shards. `history` holds each update (step, measured mean ‖ε̄‖₁
    before it, target, ess after it); the last also goes into the training logs as `label_noise_l1` and `ess`.
    `alpha` is `IVONConfig.ivon_smoothing`, whose range that config checks.
    """

    def __init__(self, alpha: float, num_updates: int = 5, num_samples: int = 8, max_factor: float = 3.0,
                 bisections: int = 4, max_decades: int = 10) -> None:
        if num_updates < 1 or num_samples < 1 or not max_factor > 1 or bisections < 0 or max_decades < 1:
            raise ValueError(f"Need num_updates >= 1, num_samples >= 1, max_factor > 1, bisections >= 0 and "
                             f"max_decades >= 1, got {num_updates}, {num_samples}, {max_factor}, {bisections}, "
                             f"{max_decades}.")
        self.alpha, self.num_updates, self.num_samples, self.max_factor = alpha, num_updates, num_samples, max_factor
        self.bisections, self.max_decades = bisections, max_decades
        self.history: list[dict[str, float]] = []
        self._measure: Callable[[int, int], tuple[float, float]] | None = None

    def connect(self, measure: Callable[[int, int], tuple[float, float]], scale_ess: Callable[[float], float],
                seed: int) -> "SmoothingStrengthCallback":
        """`measure(num_samples, seed)`: the mean ‖ε̄‖₁ and the mean ‖p̂ − u‖₁ on the trainer's probe of training
        examples; `scale_ess(factor)`: multiplies IVON's ess by `factor` and returns the new value."""
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
        measured, distance = self._measure(self.num_samples, seed)
        target = self.alpha * distance
        if distance < UNDECIDED_L1:
            ess = self._scale_ess(1.0)
        elif self.history or state.global_step != updates[0]:  # a resumed run's first update is a correction too
            ess = self._scale_ess(min(self.max_factor, max(1.0 / self.max_factor, measured / target)))
        else:
            ess = self._solve(measured, target, seed)
        self.history.append({"step": state.global_step, "label_noise_l1": measured, "target": target, "ess": ess})

    def _solve(self, measured: float, target: float, seed: int) -> float:
        """The ess (on a log scale, to within 10^(2^-bisections)) at which the probe's mean ‖ε̄‖₁ is `target`, given
        `measured` at the current ess; left there. Out of reach within `max_decades`: the current ess."""
        start = ess = self._scale_ess(1.0)

        def too_smooth(new: float) -> bool:  # sets ess to `new`
            nonlocal ess
            ess = self._scale_ess(new / ess)
            return self._measure(self.num_samples, seed)[0] > target

        # decades towards the target: ε̄ falls as ess grows
        step = 10.0 if measured > target else 0.1
        near = start
        for _ in range(self.max_decades):
            if too_smooth(near * step) != (measured > target):
                break
            near *= step
        else:
            return self._scale_ess(start / ess)
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
