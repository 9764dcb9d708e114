"""Model cards for models trained with varsmooth (huggingface_hub `ModelCard`, template in model_cards/)."""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import TYPE_CHECKING, Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

if TYPE_CHECKING:
    from ..trainer import VariationalTrainer

__all__ = ["build_model_card", "MODEL_CARD_TEMPLATE"]

MODEL_CARD_TEMPLATE = resources.files("varsmooth").joinpath("templates/model_card.md")

_FILE_DESCRIPTIONS = {
    "model.safetensors": "weights (the posterior mean)",
    "config.json": "model configuration",
    "posterior.safetensors": "posterior standard deviation of every trainable weight (varsmooth)",
    "label_noise.parquet": "per-example label noise of the training set (load with `datasets.load_dataset('parquet', ...)`)",
    "label_noise_summary.json": "summary of the label noise and mislabel-detection scores",
    "noise_report.json": "the label corruption: intended and realized transition matrices",
    "preprocessor_config.json": "image processor",
    "tokenizer.json": "tokenizer",
}
_METRIC_NAMES = {"accuracy": "Accuracy", "nll": "Negative log-likelihood", "ece": "Expected calibration error (15 bins)",
                 "brier": "Brier score"}


def _task(model: Any) -> tuple[str, str]:
    name = type(model).__name__
    if "ImageClassification" in name:
        return "image-classification", "AutoModelForImageClassification"
    return "text-classification", "AutoModelForSequenceClassification"


def _base_model(model: Any) -> str | None:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or ""
    if name and not os.path.isabs(name) and not name.startswith(".") and name.count("/") <= 1 and not os.path.isdir(name):
        return name
    return None


def _last_eval_metrics(trainer: "VariationalTrainer") -> dict[str, float]:
    for entry in reversed(trainer.state.log_history):
        if "eval_accuracy" in entry:
            return {k.removeprefix("eval_"): v for k, v in entry.items() if k.startswith("eval_")}
    return {}


def _matrix_table(matrix: list[list[float]], names: list[str]) -> str:
    header = "| clean \\ label | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    rows = "".join(f"| {names[i]} | " + " | ".join(f"{v:.3f}" for v in row) + " |\n" for i, row in enumerate(matrix))
    return header + rows


def _temperature_text(trainer: "VariationalTrainer") -> str:
    """The posterior temperature τ the model predicts with, and the validation NLL it was chosen by."""
    tau = trainer.posterior_temperature
    intro = (f"Predictions sample the weights with the posterior standard deviation scaled by **τ = {tau:g}** "
             "(0: the prediction at the posterior mean, 1: the learned posterior). ")
    report = trainer.posterior_temperature_report
    if report is None:
        how = ("fixed by `posterior_temperature`" if trainer.args.posterior_temperature is not None
               else "no validation data to choose it by")
        return intro + f"τ = {tau:g} was {how}."
    rows = "".join(f"| {t}{' (chosen)' if float(t) == tau else ''} | {nll:.4f} |\n" for t, nll in report["nll"].items())
    return (intro + f"τ was chosen after training by the negative log-likelihood on the eval dataset ({report['num_samples']} "
            "posterior samples, the same draws for every τ); an evaluation on that same set is slightly optimistic."
            "\n\n| τ | validation NLL |\n|---|---|\n" + rows)


def build_model_card(
    trainer: "VariationalTrainer",
    *,
    model_name: str | None = None,
    dataset: str | None = None,
    license: str | None = None,
    tags: list[str] | None = None,
    language: str | None = None,
    **_: Any,
) -> ModelCard:
    """The card of `trainer`'s model: base model, data, injected label noise, method, metrics, label noise, usage."""
    output_dir = trainer.args.output_dir
    model = trainer.accelerator.unwrap_model(trainer.model)
    task, auto_class = _task(model)
    repo_id = trainer.args.hub_model_id or model_name or os.path.basename(os.path.abspath(output_dir))
    model_name = model_name or repo_id.split("/")[-1]
    base_model = _base_model(model)
    metrics = _last_eval_metrics(trainer)
    method = trainer.method.name
    report = trainer.train_noise_report()
    is_ivon = trainer.method.uses_ivon

    eval_results = []
    for key, pretty in _METRIC_NAMES.items():
        for prefix, label in (("", "posterior-averaged" if is_ivon else ""), ("mean_", "posterior mean")):
            if prefix + key in metrics:
                eval_results.append(EvalResult(
                    task_type=task, dataset_type=dataset or "custom", dataset_name=dataset or "evaluation set",
                    metric_type=key, metric_value=float(metrics[prefix + key]),
                    metric_name=f"{pretty} ({label})" if label else pretty,
                ))
    card_data = ModelCardData(
        language=language, license=license, library_name="transformers", base_model=base_model,
        datasets=[dataset] if dataset else None, pipeline_tag=task, model_name=model_name,
        tags=sorted({"varsmooth", "noisy-labels", task, *(["ivon", "variational-learning"] if is_ivon else [method]), *(tags or [])}),
        eval_results=eval_results or None,
    )

    names = list(getattr(model.config, "id2label", {}).values()) if getattr(model, "config", None) else []
    if report is None:
        corruption_text = "No label corruption was injected: the model was trained on the dataset's own labels."
        transition_table = None
    else:
        intended = report.intended_rate
        corruption_text = (
            f"Noise type **{report.noise_type or 'unknown (recomputed from clean_label)'}**"
            + (f", parameters `{json.dumps(report.params)}`" if report.params else "")
            + (f", seed {report.seed}" if report.seed is not None else "") + ". "
            + (f"Intended rate {intended:.3f}; " if intended is not None else "")
            + f"realized rate **{report.realized_rate:.3f}** ({report.num_corrupted} of {report.num_examples} training labels differ from the clean ones)."
        )
        transition_table = _matrix_table(report.realized_transition, report.class_names or names or [str(i) for i in range(report.num_classes)])

    if metrics:
        rows = [f"| {pretty} | " + " | ".join(
            f"{metrics[p + key]:.4f}" if p + key in metrics else "–" for p in ("", "mean_")) + " |"
            for key, pretty in _METRIC_NAMES.items() if key in metrics]
        metrics_text = ("On the evaluation set" + (f" of `{dataset}`" if dataset else "") + ", "
                        + (f"with {trainer.args.eval_mc_samples} posterior samples averaged:" if is_ivon else "at the trained weights:"))
        metrics_table = "| metric | posterior-averaged | posterior mean |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    else:
        metrics_text, metrics_table = "The model was not evaluated.", None

    temperature_text = _temperature_text(trainer) if is_ivon else None

    summary_path = os.path.join(output_dir, "label_noise_summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        label_noise_text = (
            "`label_noise.parquet` holds, for every training example, the label noise ε̄ = p̄ − P̂ that IVON's posterior "
            "induces (seed 000, Eq. 15): large for ambiguous or atypical examples. To find wrong labels, rank by the "
            "posterior-predictive confidence in the given label instead.\n\n```json\n" + json.dumps(summary, indent=2)[:3000] + "\n```"
        )
    else:
        label_noise_text = "No per-example label noise was exported for this model."
    pictures = sorted(f for f in os.listdir(output_dir) if f.endswith(".png")) if os.path.isdir(output_dir) else []
    present = sorted(f for f in os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    files = {f: _FILE_DESCRIPTIONS[f] for f in present if f in _FILE_DESCRIPTIONS}
    files.update({p: "picture" for p in pictures})

    from .. import __version__

    return ModelCard.from_template(
        card_data,
        template_str=MODEL_CARD_TEMPLATE.read_text(encoding="utf-8"),
        model_name=model_name,
        repo_id=repo_id,
        task_name=task,
        auto_class=auto_class,
        method=method,
        base_model_text=f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "none (trained from a configuration)",
        dataset_text=f"`{dataset}`" if dataset else "not recorded",
        labels_text=", ".join(names) if names else "see config.json",
        corruption_text=corruption_text,
        transition_table=transition_table,
        hyperparameters={**trainer.method.hyperparameters(), "epochs": trainer.args.num_train_epochs,
                         "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
                         "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
                         "lr_scheduler_type": str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type)),
                         "seed": trainer.args.seed},
        metrics_text=metrics_text,
        metrics_table=metrics_table,
        temperature_text=temperature_text,
        label_noise_text=label_noise_text,
        pictures=pictures,
        files=files,
        version=__version__,
    )
