"""Posterior temperature τ: predict with draws θ = m + τ·σ⊙e, τ chosen after training by validation NLL.

τ = 0 is the prediction at the posterior mean, τ = 1 the learned posterior; in between, a posterior narrower than the
learned one, in the spirit of the "cold posterior" of Wenzel et al. (2020, "How good is the Bayes posterior in deep
neural networks really?"), which tempers the whole posterior rather than σ alone. Which end is better depends on the
run: when the Hessian barely moves in a short run, σ stays at its initial value, too wide for the weights the
prediction is sensitive to, and averaging over it is worse calibrated than the mean; on longer runs averaging wins.
A 1-D search over `TEMPERATURE_GRID`, which contains 0 and 1, can only match or improve both on the validation NLL.
Every τ of the search is scored with the same draws e (common random numbers), so the comparison has no Monte-Carlo
noise between grid points.

Without validation data τ stays 1. The trainer holds no part of the training data out (every example was fitted, so
the training set cannot tell whether averaging generalizes better than the mean): hold a split out and pass it as
`eval_dataset`, as the example scripts do (20 % of the training split) for a dataset without an evaluation split.
With noisy validation labels, the NLL rewards predictions calibrated to the noisy labels, not to the clean ones
(wider ones). When the noise process of the validation labels is known, a transition matrix T with T[i, j] =
P(observed j | true i) (the noise the library injected, or an estimate), each τ is scored by the forward-corrected NLL
−log (Tᵀp)[observed label] instead (Patrini et al. 2017, "Making Deep Neural Networks Robust to Label Noise: a Loss
Correction Approach", Sec. 3, forward correction): its expectation over the noisy labels is lowest at the clean-label
class probabilities when T is invertible, so it scores the prediction against the clean labels it cannot see.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from .gaussian import DiagonalGaussianPosterior
from .prediction import LABEL_KEYS, predictive_distribution

if TYPE_CHECKING:
    from ..trainer import VariationalTrainer

__all__ = ["TEMPERATURE_GRID", "check_transition_matrix", "choose_temperature", "select_trainer_temperature",
           "temperature_nll", "validation_batches"]

logger = logging.getLogger(__name__)

#: how τ was chosen, as the report, logs and card say it
NLL_CRITERION = "validation NLL"
CORRECTED_NLL_CRITERION = ("noise-corrected validation NLL (forward correction with the validation labels' transition "
                           "matrix, Patrini et al. 2017)")
#: the τ values tried; 0 and 1 must stay in it, so the chosen τ is never worse than either on the validation NLL
TEMPERATURE_GRID = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5)


def check_transition_matrix(transition: Any, num_classes: int | None = None) -> torch.Tensor:
    """`transition` as a float64 (K, K) tensor of label-noise probabilities T[i, j] = P(observed j | true i), refused
    with a clear error unless square, non-negative, with rows summing to 1 and invertible (forward correction cannot
    tell classes apart that T maps to the same noisy distribution)."""
    t = torch.as_tensor(transition, dtype=torch.float64)
    if t.ndim != 2 or t.shape[0] != t.shape[1]:
        raise ValueError(f"The label-noise transition matrix must be square (K x K), got shape {tuple(t.shape)}.")
    if num_classes is not None and t.shape[0] != num_classes:
        raise ValueError(f"The label-noise transition matrix is {t.shape[0]} x {t.shape[0]} but the model predicts "
                         f"{num_classes} classes.")
    if not torch.isfinite(t).all() or (t < 0).any() or not torch.allclose(t.sum(1), torch.ones(len(t), dtype=t.dtype), atol=1e-6):
        raise ValueError("The label-noise transition matrix must hold probabilities T[i, j] = P(observed j | true i): "
                         "non-negative, each row summing to 1.")
    if torch.linalg.cond(t) > 1e6:
        raise ValueError("The label-noise transition matrix is (nearly) singular: some true classes produce the same "
                         "noisy labels, so the noisy labels cannot score predictions of the clean ones (e.g. a noise "
                         "rate at or above (K-1)/K for symmetric noise).")
    return t


@torch.no_grad()
def temperature_nll(
    model: torch.nn.Module,
    posterior: DiagonalGaussianPosterior,
    batches: Iterable[Mapping[str, Any]],
    temperatures: Sequence[float] = TEMPERATURE_GRID,
    num_samples: int = 32,
    seed: int = 0,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    transition: Any = None,
) -> dict[float, float]:
    """Mean NLL −log P̂_τ(y|x) of the BMA prediction at each temperature, over labelled `batches`.

    One BMA evaluation per τ with the draws e of `seed` (those of `predictive_distribution`), so τ = 1 scores the
    prediction of `evaluate()` and τ = 0 that of the posterior mean. `gather` collects the per-example NLLs of all
    processes (e.g. `accelerator.gather_for_metrics`). With `transition` (T, the noise of the labels, see
    `check_transition_matrix`) the forward-corrected NLL −log (Tᵀ P̂_τ)[y]. The posterior's own temperature is left as
    it was.
    """
    log_transition = None  # log T, checked against the model's classes and moved to its device at the first batch
    temperatures = [float(t) for t in temperatures]
    if not temperatures:
        raise ValueError("temperature_nll needs at least one temperature.")
    original = posterior.temperature
    chunks = []
    try:
        for batch in batches:
            labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
            if labels is None:
                raise ValueError(
                    f"A validation batch has no labels (keys: {sorted(batch)}): the temperature is chosen by the NLL of "
                    "the given labels, so the eval dataset needs a 'label' or 'labels' column."
                )
            labels = torch.as_tensor(labels).long()
            columns = []
            for t in temperatures:
                posterior.temperature = t  # validates t
                out = predictive_distribution(model, posterior, batch, num_samples, seed)
                log_probs = out.logits
                if transition is not None:  # log Σ_i p_i T[i, j], the predicted distribution of the noisy label
                    if log_transition is None:
                        log_transition = check_transition_matrix(transition, log_probs.shape[-1]).log().to(log_probs.device)
                    log_probs = torch.logsumexp(log_probs.double()[:, :, None] + log_transition, dim=1)
                columns.append(-log_probs.gather(-1, labels.to(log_probs.device)[:, None]).squeeze(-1))
            nll = torch.stack(columns, -1)
            chunks.append((gather(nll) if gather is not None else nll).double().cpu())
    finally:
        posterior.temperature = original
    if not chunks:
        raise ValueError("temperature_nll got no batches: the validation set is empty.")
    means = torch.cat(chunks).mean(0)
    return {t: float(m) for t, m in zip(temperatures, means)}


def choose_temperature(nll: Mapping[float, float]) -> float:
    """The τ of lowest NLL; on a tie the one closest to 1 (the learned posterior, the default without selection)."""
    finite = {t: v for t, v in nll.items() if math.isfinite(v)}
    if not finite:
        raise ValueError(f"No temperature has a finite validation NLL ({dict(nll)}): the model's outputs are not finite.")
    best = min(finite.values())
    return min((t for t, v in finite.items() if v == best), key=lambda t: (abs(t - 1.0), t))


def validation_batches(trainer: "VariationalTrainer", eval_dataset: Any) -> Iterator[Mapping[str, Any]]:
    """The prepared batches of `eval_dataset` (a dataset or a dict of them, pooled), from the loaders of evaluate()."""
    # a dict of the trainer's own eval datasets by name: evaluate()'s cached loaders are reused
    named = eval_dataset if isinstance(eval_dataset, Mapping) else {None: eval_dataset}
    sources = [name if eval_dataset is trainer.eval_dataset and name is not None else dataset for name, dataset in named.items()]
    for source in sources:
        for batch in trainer.get_eval_dataloader(source):
            yield trainer._prepare_inputs(batch)


def select_trainer_temperature(trainer: "VariationalTrainer", eval_dataset: Any = None) -> dict[str, Any] | None:
    """Choose τ for `trainer` on `eval_dataset` (default: its eval datasets, pooled) and make it the trainer's.

    Returns the report (chosen τ, NLL at every τ, examples, draws), or None when there is nothing to choose: a method
    without a posterior, `eval_mc_samples=0` (prediction at the mean already) or no validation data, where τ stays 1.
    The training set is not used instead: every one of its examples was fitted, so it cannot tell whether averaging
    generalizes better than the mean.
    """
    args = trainer.args
    if trainer.ivon is None or args.eval_mc_samples <= 0:
        return None
    eval_dataset = trainer.eval_dataset if eval_dataset is None else eval_dataset
    if eval_dataset is None:
        logger.info(
            "No eval_dataset: predicting with the learned posterior (posterior temperature 1). Pass an eval_dataset "
            "(a validation split) to choose the temperature by validation NLL, or set posterior_temperature."
        )
        return None
    model = trainer.model
    model.eval()
    posterior = trainer.posterior()
    transition = trainer.eval_noise_transition
    nll = temperature_nll(model, posterior, validation_batches(trainer, eval_dataset), TEMPERATURE_GRID, args.eval_mc_samples, args.eval_seed,
                          gather=trainer.accelerator.gather_for_metrics, transition=transition)
    chosen = choose_temperature(nll)
    trainer.posterior_temperature = chosen
    criterion = NLL_CRITERION if transition is None else CORRECTED_NLL_CRITERION
    report = {"temperature": chosen, "nll": {f"{t:g}": v for t, v in nll.items()},
              "num_samples": args.eval_mc_samples, "criterion": criterion}
    if transition is not None:
        report["transition"] = transition.tolist()
    trainer.posterior_temperature_report = report
    logger.info("Posterior temperature %g chosen by %s: %s", chosen, criterion,
                ", ".join(f"τ={t:g}: {v:.4f}" for t, v in nll.items()))
    trainer.log({"posterior_temperature": chosen, "eval_nll_temperature_0": nll[0.0],
                 "eval_nll_temperature_1": nll[1.0], "eval_nll_temperature_chosen": nll[chosen]})
    return report


class PosteriorTemperatureCallback(TrainerCallback):
    """Chooses the posterior temperature when training ends (`VariationalTrainer` puts it first, so that callbacks
    predicting with the posterior at the end of training, such as the label-noise export, use the chosen τ)."""

    def __init__(self) -> None:
        self.trainer: VariationalTrainer | None = None

    def bind(self, trainer: "VariationalTrainer") -> "PosteriorTemperatureCallback":
        self.trainer = trainer
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a second train() starts again from the learned posterior (or the fixed τ)
        self.trainer.posterior_temperature = 1.0 if args.posterior_temperature is None else args.posterior_temperature
        self.trainer.posterior_temperature_report = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.posterior_temperature is None:
            select_trainer_temperature(self.trainer)
