"""The model card's sentences about the posterior: how the model predicts (and why at the mean, if it does), what
IVON's posterior did while training, how much it smoothed the labels, and the posterior temperature τ."""

from __future__ import annotations

import math
from typing import Any

from ..label_noise.strength import label_smoothing_noise
from ..methods import METHODS
from ..posterior.diagnostics import HESSIAN_STUCK_TOLERANCE
from ..prediction.batchnorm import RECOMPUTED_LOG_KEY
from .record import RunRecord

__all__ = ["adaptivity_text", "label_noise_numbers", "method_text", "posterior_text", "prediction_kind",
           "temperature_text"]

#: the Spearman ρ between ‖ε̄‖₁ and ambiguity from which the card says ε̄ is larger for ambiguous examples, a moderate
#: correlation by Cohen's convention: over thousands of examples a ρ of 0.07 is significant yet ranks almost at random
AMBIGUITY_RHO = 0.3


def prediction_kind(record: RunRecord) -> str:
    """What the model's predictions are: "bma" (averaged over posterior samples), "mean" (an IVON model predicting
    at its posterior mean) or "weights" (a method without a posterior)."""
    if not record.learns_posterior:
        return "weights"
    return "bma" if record.eval_mc_samples > 0 and record.posterior_temperature.value > 0 else "mean"


def _mean_reason(record: RunRecord) -> str:
    """Why an IVON model predicts at its posterior mean."""
    if record.eval_mc_samples <= 0:
        return "`eval_mc_samples=0` was set, so no posterior samples are averaged"
    report = record.posterior_temperature.selection
    if report is None:
        return "the posterior temperature was fixed at τ = 0 (`posterior_temperature=0`)"
    criterion, nll = report.get("criterion", "validation NLL"), report["nll"]
    others = [f"{v:.4f} at τ = {t}" for t, v in nll.items() if float(t) > 0]
    tied = [t for t in report.get("tied", [0.0]) if t > 0]
    verdict = "scored best" if nll["0"] <= min(nll.values()) else "tied with the best"
    if tied:  # the validation split cannot tell these apart: the mean predicts in one pass
        verdict += (f" (τ = {', '.join(f'{t:g}' for t in tied)} tie with it within 2 paired standard errors, and the "
                    "mean predicts in one pass)")
    return (f"the posterior temperature τ = 0 was chosen after training, because the posterior mean {verdict} by the "
            f"{criterion} on the validation split ({nll['0']:.4f}, against " + ", ".join(others) + ")")


def method_text(record: RunRecord, weights_file: str = "model.safetensors") -> str:
    """The card's first paragraph after "trained with varsmooth": what the method computed, with its mean in
    `weights_file` (a PEFT adapter's `adapter_model.safetensors`), and how the model predicts."""
    prediction = prediction_kind(record)
    if prediction == "weights":
        info = METHODS.get(record.method)
        description = f" ({info.summary.rstrip('.')})" if info is not None else ""
        return (f" with the `{record.method}` method{description}. It learns no posterior over the weights: "
                "predictions are made at the trained weights.")
    text = (" by variational learning (IVON): training learned a Gaussian posterior over the weights, whose mean is "
            f"the model's weights (`{weights_file}`) and whose standard deviation σ ships in `posterior.safetensors`.")
    frozen = record.hyperparameters.get("frozen_mean_modules")
    if frozen:
        text += (f" The weights of {', '.join(f'`{m}`' for m in frozen)} are in that posterior with their mean frozen "
                 "at the loaded values (`frozen_mean_modules`): their σ was learned, the weights were not trained.")
    if prediction == "bma":
        return text + (f" Predictions average the softmax over {record.eval_mc_samples} samples of that posterior, "
                       f"with σ scaled by the posterior temperature τ = {record.posterior_temperature.value:g} "
                       "(Bayesian model averaging).")
    return text + f" Predictions are made at the posterior mean, without averaging: {_mean_reason(record)}."


def posterior_text(record: RunRecord) -> str | None:
    """What IVON's posterior did during training, from the last training log (`RunRecord.posterior_log`)."""
    log = record.posterior_log
    if not record.learns_posterior or not log:
        return None
    hp = record.hyperparameters
    h0, ess, prior = hp.get("hess_init"), hp.get("ess"), hp.get("weight_decay")
    text = (f"At step {log.get('step')} of training, IVON's Hessian estimate h had median "
            f"{log['hess_median']:.4g} and mean {log.get('hess_mean', math.nan):.4g}"
            + (f", starting from h0 = {h0:g}" if h0 is not None else "") + ".")
    change = log.get("hess_change_median")
    if change is not None:
        text += f" The median relative change |h − h0|/h0 over the weights is {change:.1%}"
        if change < HESSIAN_STUCK_TOLERANCE:
            text += (": the Hessian hardly moved, so σ is still mostly set by `ess` and `hess_init` rather than "
                     "learned from the data.")
        elif "hess_data_share" in log:
            text += (f". Had the data added no curvature, the moving average would have taken h0 to "
                     f"{log['hess_decayed']:.3g} (h0·β2^t); h ends at least {HESSIAN_STUCK_TOLERANCE:.0%} away from "
                     f"that value in {log['hess_data_share']:.0%} of the weights, where σ is learned from the data; in "
                     "the others σ follows from `hess_init`, `ess` and the run's length.")
        else:
            text += ": the posterior adapted to the data."
    if "posterior_std_median" in log:
        text += (" The posterior standard deviation σ = 1/sqrt(ess·(h + δ)) had median "
                 f"{log['posterior_std_median']:.4g} and mean {log.get('posterior_std_mean', math.nan):.4g}")
        if h0 is not None and ess and prior is not None:
            text += f" (σ0 = {1 / math.sqrt(ess * (h0 + prior)):.4g} at the start)"
        text += "."
    if log.get(RECOMPUTED_LOG_KEY):
        text += (" BatchNorm's running statistics were recomputed at the posterior mean from "
                 f"{log[RECOMPUTED_LOG_KEY]:,} training examples when training ended: those gathered while training "
                 "average over sampled weights.")
    return text


def adaptivity_text(adaptivity: dict | None) -> str:
    """Whether this run's ε̄ is larger for ambiguous examples, as the paper finds, by its measured correlation: said
    from ρ ≥ `AMBIGUITY_RHO` on, else that it is not (clearly)."""
    if not adaptivity:
        return "The paper finds it larger for ambiguous or atypical examples."
    rho, spread = adaptivity["noise_l1_entropy_spearman"], adaptivity["noise_l1_q90_over_q10"]
    measured = (f"Spearman ρ = {rho:.2f} between ‖ε̄‖₁ and the entropy of the posterior-mean prediction; its 90th "
                f"percentile is {spread:.2g}× its 10th")
    if rho >= AMBIGUITY_RHO:
        return f"On this run it is larger for ambiguous examples, as the paper finds ({measured})."
    if rho > 0:
        measured += f"; the card says larger from ρ = {AMBIGUITY_RHO:g} on"
    text = f"On this run it is *not* {'clearly ' if rho > 0 else ''}larger for ambiguous examples ({measured})."
    if "noise_l1_peak_confidence" in adaptivity:
        text += (f" ‖ε̄‖₁ is largest where the posterior mean predicts with confidence ≈ "
                 f"{adaptivity['noise_l1_peak_confidence']:.2f} and smaller for less confident predictions, as the "
                 "paper's Eq. 12 and Fig. 2 describe (no noise at the decision boundary); "
                 f"{adaptivity['below_noise_peak_share']:.0%} of the examples are predicted less confidently than that "
                 f"(median confidence {adaptivity['mean_confidence_median']:.2f}).")
    return text


#: a mean |ε̄|₁ below label smoothing's at this α counts as "hardly smoothed" (a near-point posterior)
NEAR_POINT_ALPHA = 0.01


def _ls_equivalent_text(mean_l1: float, num_classes: int, asked: float | None) -> str:
    """The measured mean |ε̄|₁ as the α of label smoothing of the same mean size, ‖ε‖₁ = 2α(1 − 1/K)."""
    alpha = mean_l1 / label_smoothing_noise(1.0, num_classes)
    text = (f" That is the size of label smoothing with α = {alpha:.2g}, whose ε has |ε|₁ = 2α(1 − 1/K) for every "
            f"example (α = 0.1: {label_smoothing_noise(0.1, num_classes):.3g})")
    if asked is not None:
        return text + (f"; IVON was set to smooth as LS at α = {asked:g} would with the model's own predictions for "
                       "labels (`ivon_smoothing`: mean |ε̄|₁ = α·|p̂ − 1/K|₁, which is below 2α(1 − 1/K) wherever the "
                       "posterior mean is unsure).")
    if alpha < NEAR_POINT_ALPHA:
        return text + (f": a near-point posterior, below α = {NEAR_POINT_ALPHA:g}, so training with IVON hardly "
                       "smoothed the labels at this ess. `ivon_smoothing` (an α, chosen on validation as LS's) sets "
                       "how much it smooths.")
    return text + "."


def label_noise_numbers(summary: dict[str, Any], asked: float | None = None) -> str | None:
    """Sentences of measured label-noise magnitudes |ε̄|₁ from `label_noise_summary.json`, against label smoothing's
    (`asked`: the run's `ivon_smoothing`, if set)."""
    l1 = summary.get("all", {}).get("noise_l1")
    if not l1:
        return None
    how = (f" ({summary['num_samples']} posterior samples" if "num_samples" in summary else "") + (
        f" at τ = {summary['posterior_temperature']:g}" if "posterior_temperature" in summary else "") + (
        ", each normalised with BatchNorm statistics of its own, as in training" if summary.get(
            "batchnorm_statistics_per_draw") else "") + (
        f", exported in {summary['export_seconds']:.1f} s" if "export_seconds" in summary else "") + (
        ")" if "num_samples" in summary else "")
    text = (f"Over the {summary.get('num_examples', 'training')} training examples{how}, |ε̄|₁ has mean "
            f"{l1['mean']:.3g} and median {l1['q50']:.3g}, from {l1['q10']:.3g} (10th percentile) to {l1['q90']:.3g} "
            "(90th).")
    clean, corrupted = (summary.get(k, {}).get("noise_l1") for k in ("clean", "corrupted"))
    if clean and corrupted:
        text += (f" Its mean is {corrupted['mean']:.3g} on the corrupted labels and {clean['mean']:.3g} on the clean "
                 "ones.")
    if summary.get("num_classes"):
        text += _ls_equivalent_text(l1["mean"], summary["num_classes"], asked)
    return text


def temperature_text(record: RunRecord) -> str:
    """The posterior temperature τ the model predicts with, and the validation NLL it was chosen by."""
    tau = record.posterior_temperature.value
    intro = (f"Predictions sample the weights with the posterior standard deviation scaled by **τ = {tau:g}** "
             "(0: the prediction at the posterior mean, 1: the learned posterior). ")
    report = record.posterior_temperature.selection
    if report is None:
        how = ("fixed by `posterior_temperature`" if record.posterior_temperature.fixed
               else "no validation data to choose it by")
        return intro + f"τ = {tau:g} was {how}."
    rows = "".join(f"| {t}{' (chosen)' if float(t) == tau else ''} | {nll:.4f} |\n" for t, nll in report["nll"].items())
    criterion = report.get("criterion", "validation NLL")  # posteriors saved before the criterion was recorded
    return (intro + f"τ was chosen after training by the {criterion} on the eval dataset ({report['num_samples']} "
            "posterior samples, the same draws for every τ); an evaluation on that same set is slightly optimistic."
            f"\n\n| τ | {criterion.split(' (')[0]} |\n|---|---|\n" + rows)
