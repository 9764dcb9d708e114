"""Variational prediction: Bayesian model averaging over posterior samples.

P̂(y|x) = (1/S) Σ_s softmax(f(x; θ_s)), θ_s ~ q — probabilities are averaged, not logits (as in
`do_evalbatch_ivon` of the IVON authors' code, Shen et al. 2024). The same sweep gives the posterior-mean prediction
p̄ = softmax(f(x; m)), the predictive entropy and mutual information, and the per-draw label noise
p̄ − softmax(f(x; θ_s)) (Variational Learning Induces Adaptive Label Smoothing (2025), Eq. 19) that the label-noise
export needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..outputs import VariationalClassifierOutput, entropy, model_logits
from ..posterior.gaussian import DiagonalGaussianPosterior
from ..posterior.seeds import derive_seed

__all__ = ["average_predictions", "draw_seeds", "predicts_at_the_mean", "predictive_distribution", "restored_buffers",
           "sampled_probs"]

def draw_seeds(seed: int, num_samples: int) -> list[tuple[int, bool]]:
    """(seed, mirrored) of the S draws: antithetic pairs θ = m ± τσ⊙e, the pair k from the seed derive_seed(seed, k).

    The label noise p̄ − P̂ that a prediction measures is second order in σ (Variational Learning Induces Adaptive Label
    Smoothing, Eq. 19: its first-order term has mean zero); with independent draws that first-order term is what the
    Monte-Carlo error is made of, and it cancels exactly within a pair (m + σe, m − σe). A pair costs two forward
    passes and one draw of e; an odd S ends with an unpaired draw.
    """
    return [(derive_seed(seed, s // 2), s % 2 == 1) for s in range(num_samples)]


@torch.no_grad()
def predictive_distribution(
    model: torch.nn.Module,
    posterior: DiagonalGaussianPosterior,
    inputs: Mapping[str, Any],
    num_samples: int,
    seed: int = 0,
    draw_buffers: Sequence[Mapping[str, torch.Tensor]] | None = None,
    temperature: float = 1.0,
) -> VariationalClassifierOutput:
    """BMA over `num_samples` draws of `posterior` and the prediction at the mean, for one batch.

    The draws are the antithetic pairs of `draw_seeds(seed, num_samples)`: the same S models for every batch and every
    call, so the trainer's evaluation and a model reloaded from disk agree exactly. The draws are scaled by the
    posterior temperature τ = `temperature`; `num_samples=0`, τ = 0 or a point-mass posterior predict at the mean (and
    then `mutual_information` and `noise_rms` are None: nothing was averaged to measure them). `draw_buffers`: see
    `sampled_probs`.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 (0 = predict at the posterior mean), got {num_samples}.")
    return average_predictions(model_logits(model, inputs),
                               sampled_probs(model, posterior, inputs, num_samples, seed, draw_buffers, temperature))


def predicts_at_the_mean(posterior: DiagonalGaussianPosterior, num_samples: int, temperature: float = 1.0) -> bool:
    """Whether a prediction with `num_samples` draws of `posterior` at `temperature` draws nothing: no draws asked
    for, a point mass, or τ = 0 (every draw would be the posterior mean)."""
    return num_samples <= 0 or posterior.is_point_mass or temperature == 0


def sampled_probs(model: torch.nn.Module, posterior: DiagonalGaussianPosterior, inputs: Mapping[str, Any],
                  num_samples: int, seed: int = 0, draw_buffers: Sequence[Mapping[str, torch.Tensor]] | None = None,
                  temperature: float = 1.0) -> Iterator[torch.Tensor]:
    """softmax(f(x; θ_s)) of the draws of `draw_seeds(seed, num_samples)`, scaled by the posterior temperature τ =
    `temperature`; none for τ = 0 or a point mass (they would all be the mean prediction).

    `draw_buffers[s]`: buffers of `model` by name that the draw s predicts with (its own BatchNorm statistics,
    `varsmooth.prediction.batchnorm.draw_batchnorm_statistics`); None: the model's own. The model's own are back once
    the draws are done."""
    if predicts_at_the_mean(posterior, num_samples, temperature):
        return
    with restored_buffers(model, draw_buffers[0] if draw_buffers else ()) as named:
        for s, (draw_seed, mirrored) in enumerate(draw_seeds(seed, num_samples)):
            with posterior.sampled(draw_seed, mirrored=mirrored, scale=temperature):
                for name, value in (draw_buffers[s] if draw_buffers else {}).items():
                    named[name].copy_(value)
                yield model_logits(model, inputs).softmax(-1)


@contextlib.contextmanager
def restored_buffers(model: torch.nn.Module, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
    """The buffers `names` of `model`, by name, to change inside the block; their values are back after it."""
    named = dict(model.named_buffers())
    own = {name: named[name].clone() for name in names}
    try:
        yield named
    finally:
        for name, value in own.items():
            named[name].copy_(value)


def average_predictions(mean_logits: torch.Tensor, sample_probs: Iterable[torch.Tensor]) -> VariationalClassifierOutput:
    """The output for the prediction `mean_logits` at the weights and the probabilities of S stochastic draws
    (posterior samples, dropout masks): P̂ their average, its entropy and mutual information; no draws: the prediction
    at the weights, with `mutual_information` and `noise_rms` None."""
    mean_probs = mean_logits.softmax(-1)
    probs = torch.zeros_like(mean_probs)
    expected_entropy = torch.zeros(mean_probs.shape[:-1], device=mean_probs.device)
    noise_sq = torch.zeros_like(expected_entropy)
    num_samples = 0
    for sample in sample_probs:
        probs += sample
        expected_entropy += entropy(sample)
        noise_sq += (mean_probs - sample).square().sum(-1)
        num_samples += 1
    if num_samples == 0:  # a point prediction: there is no spread over models to report
        return VariationalClassifierOutput(
            logits=mean_logits.log_softmax(-1), probs=mean_probs, mean_logits=mean_logits, mean_probs=mean_probs,
            entropy=entropy(mean_probs),
        )
    probs /= num_samples
    total_entropy = entropy(probs)
    return VariationalClassifierOutput(
        logits=probs.clamp_min(1e-30).log(),
        probs=probs,
        mean_logits=mean_logits,
        mean_probs=mean_probs,
        entropy=total_entropy,
        mutual_information=(total_entropy - expected_entropy / num_samples).clamp_min(0.0),
        noise_rms=(noise_sq / num_samples).sqrt(),
    )
