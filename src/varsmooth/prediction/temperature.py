"""Posterior temperature τ: predict with draws θ = m + τ·σ⊙e, τ chosen after training by validation NLL.

τ = 0 is the prediction at the posterior mean, τ = 1 the learned posterior; in between, a posterior narrower than the
learned one, in the spirit of the "cold posterior" of Wenzel et al. (2020, "How good is the Bayes posterior in deep
neural networks really?"), which tempers the whole posterior rather than σ alone. Which end is better depends on the
run: when the Hessian barely moves in a short run, σ stays at its initial value, too wide for the weights the
prediction is sensitive to, and averaging over it is worse calibrated than the mean; on longer runs averaging wins.
A 1-D search over `TEMPERATURE_GRID`, which contains 0 and 1, can only match or improve both on the validation NLL;
when its largest τ wins, wider ones (`TEMPERATURE_EXTENSION`) are tried until one loses. Every τ of the search is
scored with the same antithetic draws e (common random numbers), so the comparison has no Monte-Carlo noise between
grid points, and a few draws (`SELECTION_SAMPLES`) resolve it: the search must cost less than the training it follows.
When τ = 0 wins, predictions are made at the posterior mean and the trainer says so; the label-noise export still
samples the learned posterior (τ = 1), since ε̄ is defined by it.

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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..outputs import IGNORE_INDEX, LABEL_KEYS, model_logits
from ..posterior.gaussian import DiagonalGaussianPosterior
from .bma import average_predictions, sampled_probs

__all__ = ["SELECTION_SAMPLES", "TEMPERATURE_EXTENSION", "TEMPERATURE_GRID", "TEMPERATURE_KEY", "PosteriorTemperature",
           "check_temperature", "check_transition_matrix",
           "choose_temperature", "paired_standard_errors", "search_temperatures", "select_temperature",
           "temperature_logs", "temperature_losses", "temperature_nll", "tied_temperatures"]

logger = logging.getLogger(__name__)

#: how τ was chosen, as the report, logs and card say it
NLL_CRITERION = "validation NLL"
CORRECTED_NLL_CRITERION = ("noise-corrected validation NLL (forward correction with the validation labels' transition "
                           "matrix, Patrini et al. 2017)")
#: the τ values tried; 0 and 1 must stay in it, so the chosen τ is never worse than either on the validation NLL
TEMPERATURE_GRID = (0.0, 0.1, 0.25, 0.5, 1.0, 1.5)
#: tried one by one while the largest τ tried so far has the lowest NLL (1.5 won 3 of 3 IVON runs on a real noisy text
#: set): a wider posterior than the learned one is then better calibrated; the search stops at the last
TEMPERATURE_EXTENSION = (2.0, 3.0, 4.0, 6.0, 8.0)
#: metadata key of τ in the posterior file (a saved prediction's, `PosteriorPredictor.save`; absent means 1)
TEMPERATURE_KEY = "posterior_temperature"
#: metadata key of how τ was chosen (the report of `select_temperature`), saved with the posterior
SELECTION_KEY = "posterior_temperature_selection"


def check_temperature(value: Any) -> None:
    """Refuses a posterior temperature τ that is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"The posterior temperature must be a finite number >= 0 (0 = the posterior mean, 1 = the learned "
            f"posterior), got {value!r}."
        )


@dataclass(frozen=True)
class PosteriorTemperature:
    """The τ a prediction is made at and where it came from; a `PosteriorPredictor` holds it, the one place τ is.

    `value`: σ is scaled by it when predicting (0: the posterior mean, 1: the learned posterior). `fixed`: set by the
    user (`posterior_temperature`) rather than chosen. `selection`: when chosen on validation, `select_temperature`'s
    report (the NLL at each τ tried), else None. Saved with σ (`metadata()`, `from_metadata`), and the model card tells
    it from the run's record.
    """

    value: float = 1.0
    fixed: bool = False
    selection: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_temperature(self.value)

    @classmethod
    def from_argument(cls, tau: float | None) -> PosteriorTemperature:
        """For `posterior_temperature=tau`: τ fixed at `tau`, or for None the learned posterior (τ = 1) until
        validation chooses."""
        return cls() if tau is None else cls(float(tau), fixed=True)

    @classmethod
    def chosen(cls, report: Mapping[str, Any]) -> PosteriorTemperature:
        """The τ `select_temperature` chose, with its `report`."""
        return cls(float(report["temperature"]), selection=report)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> PosteriorTemperature:
        """What `metadata()` saved (τ = 1 when a file records none)."""
        return cls(float(metadata.get(TEMPERATURE_KEY, 1.0)), selection=metadata.get(SELECTION_KEY))

    def metadata(self) -> dict[str, Any]:
        """The posterior's metadata entries for τ: its value, and how it was chosen if it was."""
        return {TEMPERATURE_KEY: self.value, **({} if self.selection is None else {SELECTION_KEY: self.selection})}


#: the most posterior draws τ is chosen with (fewer if eval_mc_samples is smaller): every τ is scored with the same
#: antithetic draws, so NLL differences between τ values are resolved with a few draws, and the selection, which
#: costs (grid size − 1) × draws forward passes over the validation split, must cost less than training
SELECTION_SAMPLES = 2


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
    if (not torch.isfinite(t).all() or (t < 0).any()
            or not torch.allclose(t.sum(1), torch.ones(len(t), dtype=t.dtype), atol=1e-6)):
        raise ValueError("The label-noise transition matrix must hold probabilities T[i, j] = P(observed j | true i): "
                         "non-negative, each row summing to 1.")
    if torch.linalg.cond(t) > 1e6:
        raise ValueError("The label-noise transition matrix is (nearly) singular: some true classes produce the same "
                         "noisy labels, so the noisy labels cannot score predictions of the clean ones (e.g. a noise "
                         "rate at or above (K-1)/K for symmetric noise).")
    return t


@torch.no_grad()
def temperature_losses(
    model: torch.nn.Module,
    posterior: DiagonalGaussianPosterior,
    batches: Iterable[Mapping[str, Any]],
    temperatures: Sequence[float] = TEMPERATURE_GRID,
    num_samples: int = 32,
    seed: int = 0,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    transition: Any = None,
    draw_buffers: Callable[[float], Sequence[Mapping[str, torch.Tensor]] | None] | None = None,
    progress: bool = False,
) -> dict[float, torch.Tensor]:
    """The NLL −log P̂_τ(y|x) of the BMA prediction at each temperature, per labelled example (float64, CPU), over
    labelled `batches` (labels −100 are ignored, as by `evaluate()`).

    One BMA evaluation per τ with the draws e of `seed` (those of `predictive_distribution`), so τ = 1 scores the
    prediction of `evaluate()` and τ = 0 that of the posterior mean. `gather` collects the per-example NLLs of all
    processes (e.g. `accelerator.gather_for_metrics`). With `transition` (T, the noise of the labels, see
    `check_transition_matrix`) the forward-corrected NLL −log (Tᵀ P̂_τ)[y]. `draw_buffers(τ)`: the buffers
    each draw at τ predicts with (its own BatchNorm statistics, `varsmooth.prediction.batchnorm`), as the prediction
    at the chosen τ will. `progress` shows a progress bar over the batches.
    """
    log_transition = None  # log T, checked against the model's classes and moved to its device at the first batch
    for t in temperatures:
        check_temperature(t)
    temperatures = [float(t) for t in temperatures]
    if not temperatures:
        raise ValueError("temperature_nll needs at least one temperature.")
    buffers = {t: draw_buffers(t) if draw_buffers is not None and t > 0 else None for t in temperatures}
    chunks = []
    for batch in tqdm(batches, desc=f"Validation NLL at τ = {', '.join(f'{t:g}' for t in temperatures)}",
                      disable=not progress, leave=False):
        labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        if labels is None:
            raise ValueError(
                f"A validation batch has no labels (keys: {sorted(batch)}): the temperature is chosen by the NLL "
                "of the given labels, so the eval dataset needs a 'label' or 'labels' column."
            )
        labels = torch.as_tensor(labels).long()
        keep = labels != IGNORE_INDEX  # unlabelled rows, as evaluate() and the loss ignore them
        if not keep.any():
            continue
        labels = labels[keep]
        columns = []
        mean_logits = model_logits(model, batch)  # one pass at the mean serves every τ
        for t in temperatures:
            out = average_predictions(mean_logits,
                                      sampled_probs(model, posterior, batch, num_samples, seed, buffers[t], t))
            log_probs = out.logits[keep.to(out.logits.device)]
            if transition is not None:  # log Σ_i p_i T[i, j], the predicted distribution of the noisy label
                if log_transition is None:
                    log_transition = check_transition_matrix(transition,
                                                             log_probs.shape[-1]).log().to(log_probs.device)
                log_probs = torch.logsumexp(log_probs.double()[:, :, None] + log_transition, dim=1)
            columns.append(-log_probs.gather(-1, labels.to(log_probs.device)[:, None]).squeeze(-1))
        nll = torch.stack(columns, -1)
        chunks.append((gather(nll) if gather is not None else nll).double().cpu())
    if not chunks:
        raise ValueError(f"temperature_nll got no labelled examples: the validation set is empty or every label is "
                         f"{IGNORE_INDEX}.")
    losses = torch.cat(chunks)
    return {t: losses[:, i] for i, t in enumerate(temperatures)}


def temperature_nll(model: torch.nn.Module, posterior: DiagonalGaussianPosterior, batches: Iterable[Mapping[str, Any]],
                    temperatures: Sequence[float] = TEMPERATURE_GRID, num_samples: int = 32, seed: int = 0,
                    **kwargs: Any) -> dict[float, float]:
    """The mean of `temperature_losses` (same arguments) at each temperature: the validation NLL of each τ."""
    losses = temperature_losses(model, posterior, batches, temperatures, num_samples, seed, **kwargs)
    return {t: float(v.mean()) for t, v in losses.items()}


#: NLLs closer than this (relative) count as a tie whatever their standard error: a narrow posterior (e.g. a fine-tune's
#: σ ≈ 3e-3) changes the NLL in its fifth digit, where which τ "wins" is rounding
TIE_TOLERANCE = 1e-4
#: standard errors within which a τ ties with the best: the validation set cannot tell apart NLLs closer than this
TIE_STANDARD_ERRORS = 2.0


def paired_standard_errors(losses: Mapping[float, torch.Tensor]) -> dict[float, float]:
    """For each τ, the standard error of its mean NLL's difference from the lowest mean NLL's, over the same examples
    (paired: the examples' own difficulty cancels)."""
    best = min(losses, key=lambda t: float(losses[t].mean()))
    out = {}
    for t, values in losses.items():
        difference = (values - losses[best]).double()
        out[t] = float(difference.std() / math.sqrt(len(difference))) if len(difference) > 1 else 0.0
    return out


def tied_temperatures(nll: Mapping[float, float], standard_error: Mapping[float, float] | None = None) -> list[float]:
    """The τ whose validation NLL ties with the lowest: within `TIE_TOLERANCE` of it, or within `TIE_STANDARD_ERRORS`
    paired standard errors (`paired_standard_errors`) when given."""
    finite = {t: v for t, v in nll.items() if math.isfinite(v)}
    if not finite:
        raise ValueError(f"No temperature has a finite validation NLL ({dict(nll)}): the model's outputs are not "
                         "finite.")
    best = min(finite.values())
    margin = {t: max(TIE_TOLERANCE * abs(best), TIE_STANDARD_ERRORS * (standard_error or {}).get(t, 0.0))
              for t in finite}
    return sorted(t for t, v in finite.items() if v <= best + margin[t])


def choose_temperature(nll: Mapping[float, float], standard_error: Mapping[float, float] | None = None) -> float:
    """The τ of lowest NLL; among the τ tied with it (`tied_temperatures`), the smallest (0 = the posterior mean): it
    predicts in one forward pass instead of S, and validation data that cannot tell the two apart gives no reason to
    pay for the draws."""
    return min(tied_temperatures(nll, standard_error))


def search_temperatures(score: Callable[[Sequence[float]], dict[float, float]]) -> dict[float, float]:
    """The NLL at every τ tried: `TEMPERATURE_GRID`, then each τ of `TEMPERATURE_EXTENSION` in turn while the widest
    τ tried so far has the lowest NLL. `score(temperatures)` returns the NLL at each."""
    nll = score(TEMPERATURE_GRID)
    for wider in TEMPERATURE_EXTENSION:
        if choose_temperature(nll) != max(nll):
            break
        nll.update(score([wider]))
    return nll


def select_temperature(
    model: torch.nn.Module,
    posterior: DiagonalGaussianPosterior,
    batches: Callable[[], Iterable[Mapping[str, Any]]],
    num_samples: int,
    seed: int = 0,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    transition: Any = None,
    draw_buffers: Callable[[float], Sequence[Mapping[str, torch.Tensor]] | None] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Choose τ for `posterior` by the NLL of `model`'s predictions on the labelled validation batches that `batches()`
    yields (called once per pass; `gather`, `transition`, `draw_buffers`, `progress` as in `temperature_losses`).

    Scores `TEMPERATURE_GRID`, then `TEMPERATURE_EXTENSION` one value at a time while the largest τ tried wins, with
    `num_samples` draws of `seed`. Returns the report: the chosen `temperature`, the `nll` at every τ tried, the
    `num_samples`, the `criterion` (and the `transition` when given); `temperature_logs(report)` gives its log entries.
    """
    model.eval()

    losses: dict[float, torch.Tensor] = {}

    def score(temperatures: Sequence[float]) -> dict[float, float]:
        losses.update(temperature_losses(model, posterior, batches(), temperatures, num_samples, seed, gather=gather,
                                         transition=transition, draw_buffers=draw_buffers, progress=progress))
        return {t: float(losses[t].mean()) for t in temperatures}

    start = time.perf_counter()
    nll = search_temperatures(score)
    standard_error = paired_standard_errors({t: losses[t] for t in nll})
    tied = tied_temperatures(nll, standard_error)
    chosen = choose_temperature(nll, standard_error)
    criterion = NLL_CRITERION if transition is None else CORRECTED_NLL_CRITERION
    report = {"temperature": chosen, "nll": {f"{t:g}": v for t, v in nll.items()},
              "standard_error": {f"{t:g}": v for t, v in standard_error.items()}, "tied": tied,
              "num_samples": num_samples, "criterion": criterion}
    seconds = time.perf_counter() - start
    if transition is not None:
        report["transition"] = torch.as_tensor(transition).tolist()
    logger.info("Posterior temperature %g chosen by %s in %.1f s: %s%s", chosen, criterion, seconds,
                ", ".join(f"τ={t:g}: {v:.4f} ± {standard_error[t]:.4f}" for t, v in nll.items()),
                f"; τ = {', '.join(f'{t:g}' for t in tied)} tie (within {TIE_STANDARD_ERRORS:g} paired standard errors "
                "or rounding), and the smallest is used" if len(tied) > 1 else "")
    if chosen == 0:
        verdict = "tied with" if 1.0 in tied else "scored worse than"
        logger.warning(
            "Predictions are made at the posterior mean (posterior temperature 0): by %s, averaging over the learned "
            "posterior %s the mean's prediction (%.4f at τ=1 vs %.4f at τ=0). evaluate(), predict(), the saved model "
            "and its pipeline predict at the mean; the label-noise export and the pipeline's mutual information still "
            "sample the learned posterior.", criterion, verdict, nll[1.0], nll[0.0],
        )
    return report


def temperature_logs(report: Mapping[str, Any]) -> dict[str, float]:
    """The training-log entries of a `select_temperature` report: τ, and the NLL at τ = 0, 1 and the chosen τ (the
    corrected score is another quantity than evaluate()'s eval_nll: it is named apart)."""
    nll, chosen = report["nll"], report["temperature"]
    name = "eval_nll" if report["criterion"] == NLL_CRITERION else "eval_corrected_nll"
    return {"posterior_temperature": chosen, f"{name}_temperature_0": nll["0"], f"{name}_temperature_1": nll["1"],
            f"{name}_temperature_chosen": nll[f"{chosen:g}"]}
