"""`RunRecord`: what a training run was, as its model card tells it (cf. transformers' `TrainingSummary`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..corruption import NoiseReport
    from ..trainer import VariationalTrainer

__all__ = ["RunRecord"]


def _as_list(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


#: the IVON statistics of the training logs (`posterior.diagnostics.hessian_summary`) the card reports
POSTERIOR_LOG_KEYS = ("hess_mean", "hess_median", "hess_change_median", "posterior_std_mean", "posterior_std_median")


def _last_posterior_log(log_history: list[dict[str, Any]]) -> dict[str, float] | None:
    """IVON's Hessian and σ statistics of the last training log that has them, with its `step`; None without any."""
    for entry in reversed(log_history):
        if "hess_median" in entry:
            return {"step": entry.get("step"), **{k: entry[k] for k in POSTERIOR_LOG_KEYS if k in entry}}
    return None


def _posterior_state(trainer: "VariationalTrainer") -> dict[str, float] | None:
    """IVON's Hessian and σ statistics of the trainer's optimizer now (after training: the posterior that was saved),
    else of its last training log; None for a method without a posterior."""
    if not trainer.method.uses_ivon:
        return None
    summary = trainer.hessian_summary()
    if summary:
        return {"step": trainer.state.global_step, **{k: summary[k] for k in POSTERIOR_LOG_KEYS if k in summary}}
    return _last_posterior_log(trainer.state.log_history)


def _schedule(args: Any, method_hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """The training schedule as run: the learning rate (unless the method reports its own, as IVON's `lr`), and
    `max_steps` when it was set (it overrides the epochs), else the epochs."""
    length = {"max_steps": args.max_steps} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
    rate = {} if "lr" in method_hyperparameters else {"learning_rate": args.learning_rate}
    return {**rate, **length}


def _last_eval_metrics(log_history: list[dict[str, Any]]) -> tuple[dict[str, float], str]:
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
        uses_ivon: whether the method learns a posterior with IVON (the model then predicts by posterior averaging).
        hyperparameters: the method's settings (IVON's for IVON methods) and the training schedule.
        repo_id: the Hub repository (or, unshared, the output folder's name); model_name: the model's name.
        metrics: the latest scores without their prefix (`nll`, `mean_nll`, ...); scored_on: the split they come from.
        eval_mc_samples: posterior samples each prediction averages.
        posterior_temperature: the temperature τ the posterior's σ is scaled by when predicting.
        posterior_log: IVON's Hessian and σ statistics (`POSTERIOR_LOG_KEYS`) and the `step` they were measured at: now,
            from the trainer's optimizer, else at the last training log that has them.
        temperature_selection: how τ was chosen (`VariationalTrainer.select_posterior_temperature`), None if not.
        temperature_fixed: whether τ was fixed by `posterior_temperature` instead of chosen.
        noise_report: the label corruption of the training set, None when the labels are the dataset's own.
        datasets: the data's names for readers (Hub ids or local paths); dataset_tags: the ids for the `datasets:`
            metadata (default: `datasets`); license, tags, language: as in `Trainer.create_model_card`.
    """

    method: str
    uses_ivon: bool
    hyperparameters: dict[str, Any]
    repo_id: str
    model_name: str
    metrics: dict[str, float] = field(default_factory=dict)
    scored_on: str = "evaluation set"
    eval_mc_samples: int = 0
    posterior_temperature: float = 1.0
    temperature_selection: dict[str, Any] | None = None
    temperature_fixed: bool = False
    posterior_log: dict[str, float] | None = None
    noise_report: NoiseReport | None = None
    datasets: list[str] = field(default_factory=list)
    dataset_tags: list[str] | None = None
    license: str | None = None
    tags: list[str] | None = None
    language: str | None = None

    @classmethod
    def from_trainer(
        cls,
        trainer: "VariationalTrainer",
        *,
        model_name: str | None = None,
        dataset: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        license: str | None = None,
        tags: list[str] | None = None,
        language: str | None = None,
        **_: Any,
    ) -> "RunRecord":
        """The record of `trainer`'s run so far; the keywords are those of `Trainer.create_model_card` (others are
        ignored, as `push_to_hub` passes all of its keywords on)."""
        args = trainer.args
        repo_id = args.hub_model_id or model_name or os.path.basename(os.path.abspath(args.output_dir))
        metrics, scored_on = _last_eval_metrics(trainer.state.log_history)
        method_hyperparameters = trainer.method.hyperparameters()
        return cls(
            method=trainer.method.name,
            uses_ivon=trainer.method.uses_ivon,
            hyperparameters={**method_hyperparameters, **_schedule(args, method_hyperparameters),
                             "per_device_train_batch_size": args.per_device_train_batch_size,
                             "gradient_accumulation_steps": args.gradient_accumulation_steps,
                             "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
                             "seed": args.seed},
            repo_id=repo_id,
            model_name=model_name or repo_id.split("/")[-1],
            metrics=metrics,
            scored_on=scored_on,
            eval_mc_samples=args.eval_mc_samples,
            posterior_temperature=trainer.posterior_temperature,
            temperature_selection=trainer.posterior_temperature_report,
            temperature_fixed=args.posterior_temperature is not None,
            posterior_log=_posterior_state(trainer),
            noise_report=trainer.train_noise_report(),
            datasets=_as_list(dataset),
            dataset_tags=_as_list(dataset_tags) or None,
            license=license,
            tags=tags,
            language=language,
        )
