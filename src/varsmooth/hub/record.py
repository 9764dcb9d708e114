"""`RunRecord`: what a training run was, as its model card tells it (cf. transformers' `TrainingSummary`); the trainer
builds it (`VariationalTrainer.run_record`) from the values it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..prediction.temperature import PosteriorTemperature

if TYPE_CHECKING:
    from ..corruption import NoiseReport

__all__ = ["POSTERIOR_LOG_KEYS", "RunRecord", "as_list", "last_eval_metrics", "last_posterior_log", "training_schedule"]


def as_list(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


#: the IVON statistics of the training logs (`posterior.diagnostics.hessian_summary`) the card reports
POSTERIOR_LOG_KEYS = ("hess_mean", "hess_median", "hess_change_median", "hess_decayed", "hess_data_share",
                      "posterior_std_mean", "posterior_std_median")


def last_posterior_log(log_history: list[dict[str, Any]]) -> dict[str, float] | None:
    """IVON's Hessian and σ statistics of the last training log that has them, with its `step`; None without any."""
    for entry in reversed(log_history):
        if "hess_median" in entry:
            return {"step": entry.get("step"), **{k: entry[k] for k in POSTERIOR_LOG_KEYS if k in entry}}
    return None


def training_schedule(args: Any, method_hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """The training schedule as run: the learning rate (unless the method reports its own, as IVON's `lr`), and
    `max_steps` when it was set (it overrides the epochs), else the epochs."""
    length = {"max_steps": args.max_steps} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
    rate = {} if "lr" in method_hyperparameters else {"learning_rate": args.learning_rate}
    return {**rate, **length}


def last_eval_metrics(log_history: list[dict[str, Any]]) -> tuple[dict[str, float], str]:
    """The latest scores and where they come from: a test split when one was scored (`evaluate(...,
    metric_key_prefix="test")`: nothing was chosen on it), else the evaluation set."""
    for prefix, where in (("test_", "test set"), ("eval_", "evaluation set")):
        for entry in reversed(log_history):
            if prefix + "accuracy" in entry or prefix + "mean_accuracy" in entry:
                return {k.removeprefix(prefix): v for k, v in entry.items() if k.startswith(prefix)}, where
    return {}, "evaluation set"


@dataclass
class RunRecord:
    """What a run was: its training method and settings, the scores of its last evaluation, the posterior temperature
    it predicts with, the label corruption of its training set, and the names it is shared under.

    Args:
        method: the training method (`VariationalTrainingArguments.method`).
        learns_posterior: whether the method learns a posterior (IVON; the model then predicts by posterior averaging).
        hyperparameters: the method's settings (IVON's for IVON methods) and the training schedule.
        method_config_choice: what the method's config chose from the model and why (IVON's preset), None if nothing.
        repo_id: the Hub repository (or, unshared, the output folder's name); model_name: the model's name.
        metrics: the latest scores without their prefix (`nll`, `mean_nll`, ...); scored_on: the split they come from.
        eval_mc_samples: posterior samples each prediction averages.
        posterior_temperature: the temperature τ the posterior's σ is scaled by when predicting, and how it was set.
        posterior_log: IVON's Hessian and σ statistics (`POSTERIOR_LOG_KEYS`) and the `step` they were measured at: now,
            from the trainer's optimizer, else at the last training log that has them.
        stalled_loss: the training loss that barely fell below ln K (`varsmooth.training_health`), None if it fell.
        noise_report: the label corruption of the training set, None when the labels are the dataset's own.
        datasets: the data's names for readers (Hub ids or local paths); dataset_tags: the ids for the `datasets:`
            metadata (default: `datasets`); license, tags, language: as in `Trainer.create_model_card`.
    """

    method: str
    learns_posterior: bool
    hyperparameters: dict[str, Any]
    repo_id: str
    model_name: str
    method_config_choice: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    scored_on: str = "evaluation set"
    eval_mc_samples: int = 0
    posterior_temperature: PosteriorTemperature = field(default_factory=PosteriorTemperature)
    posterior_log: dict[str, float] | None = None
    stalled_loss: dict[str, Any] | None = None
    noise_report: NoiseReport | None = None
    datasets: list[str] = field(default_factory=list)
    dataset_tags: list[str] | None = None
    license: str | None = None
    tags: list[str] | None = None
    language: str | None = None
