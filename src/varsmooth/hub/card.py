"""Model cards for models trained with varsmooth (huggingface_hub `ModelCard`, template in model_cards/)."""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from importlib.metadata import version
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..corruption import NOISE_REPORT_FILE
from ..files import read_manifest
from ..posterior.settings import USER_NAMES
from ..prediction.modeling import AUTO_CLASSES, classification_task
from ..training_health import stalled_loss_text
from .posterior_text import (
    adaptivity_text,
    label_noise_numbers,
    method_text,
    posterior_text,
    prediction_kind,
    temperature_text,
)
from .record import RunRecord

__all__ = ["DEFAULT_LICENSE", "MODEL_CARD_TEMPLATE", "build_model_card", "is_hub_dataset_id"]

#: the Jinja template `build_model_card` fills (the package's `templates/model_card.md`)
MODEL_CARD_TEMPLATE = resources.files("varsmooth").joinpath("templates/model_card.md")

_FILE_DESCRIPTIONS = {
    "model.safetensors": "weights",
    "config.json": "model configuration",
    "posterior.safetensors": "posterior standard deviation of every trainable weight (varsmooth)",
    "label_noise.parquet": "per-example label noise of the training set (load with `datasets.load_dataset('parquet', "
                           "...)`)",
    "label_noise_summary.json": "summary of the label noise and mislabel-detection scores",
    NOISE_REPORT_FILE: "the label corruption: intended and realized transition matrices",
    "preprocessor_config.json": "image processor",
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer configuration",
    "special_tokens_map.json": "tokenizer's special tokens",
    "vocab.txt": "tokenizer vocabulary",
    "temperature_scaling.json": "the post-hoc temperature every prediction is scaled by (temperature scaling)",
    "adapter_model.safetensors": "PEFT adapter weights",
    "adapter_config.json": "PEFT adapter configuration",
    "mean_pooling_bert.py": "modeling code of the mean-pooling classifier, named by config.json's `auto_map` "
                            "(transformers runs it with `trust_remote_code=True`)",
}
#: the weights files, which hold the posterior mean of an IVON run
_WEIGHT_FILES = frozenset({"model.safetensors", "adapter_model.safetensors"})
#: the card's `license:` when the user names none: varsmooth cannot know the terms of the data or the base model, and
#: "unknown" is the Hub's identifier for that ("other" would need a license_name and license_link)
DEFAULT_LICENSE = "unknown"
_METRIC_NAMES = {"accuracy": "Accuracy", "nll": "Negative log-likelihood",
                 "ece": "Expected calibration error (15 bins)", "brier": "Brier score"}


def _adapter(model: Any) -> Any:
    """The active peft configuration of an adapter model, else None."""
    from ..adapters import is_peft_model

    return model.peft_config[model.active_adapter] if is_peft_model(model) else None


def _adapter_text(adapter: Any, is_ivon: bool) -> str | None:
    if adapter is None:
        return None
    kind = str(getattr(adapter.peft_type, "value", adapter.peft_type))
    targets = getattr(adapter, "target_modules", None)
    fields = {"r": getattr(adapter, "r", None), "lora_alpha": getattr(adapter, "lora_alpha", None),
              "lora_dropout": getattr(adapter, "lora_dropout", None),
              "target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
              "modules_to_save": getattr(adapter, "modules_to_save", None)}
    shown = ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return (f"{kind} ({shown}); only the adapter weights and `modules_to_save` were trained"
            + (", and the posterior is over them" if is_ivon else "") + ". `peft.PeftModel.from_pretrained` loads the "
            "adapter into the base model; `VariationalModel.from_pretrained` loads both, and the posterior.")


def _base_model(model: Any) -> str | None:
    config = getattr(model, "config", None)
    return _hub_id(getattr(config, "_name_or_path", "") or "")


def _base_model_text(base_model: str | None, model: Any, adapter: Any) -> str:
    """The card's base-model line: a link to a Hub id, else the local folder's name (its path on the training machine
    means nothing to readers), else that the model was built from a configuration."""
    if base_model:
        return f"[{base_model}](https://huggingface.co/{base_model})"
    local = (adapter.base_model_name_or_path if adapter is not None
             else getattr(getattr(model, "config", None), "_name_or_path", ""))
    if local:
        return f"`{os.path.basename(os.path.normpath(local))}` (local)"
    return "not recorded" if adapter is not None else "none (trained from a configuration)"


def _hub_id(name: str) -> str | None:
    """`name` if it can be a Hub model id, None for a local path (which means nothing to the card's readers)."""
    if (name and not os.path.isabs(name) and not name.startswith(".") and name.count("/") <= 1
            and not os.path.isdir(name)):
        return name
    return None


def is_hub_dataset_id(name: str) -> bool:
    """Whether `name` can name a dataset on the Hub ("user/name" or "name"), as opposed to a local path: a valid repo
    id by huggingface_hub's rules ("/tmp/x", "./data" and "a/b/c" are not) that is no file or folder here."""
    if os.path.exists(os.path.expanduser(name)):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _json_block(value: Any) -> str:
    """A ```json block that any JSON parser reads: non-finite numbers (e.g. an AUROC without corrupted examples) as
    null."""
    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, list):
            return [finite(x) for x in v]
        return v

    return "```json\n" + json.dumps(finite(value), indent=2, allow_nan=False) + "\n```"


def _better_prediction_text(metrics: dict[str, float]) -> str | None:
    """One sentence naming the better of the two predictions on this run, by NLL (a proper scoring rule)."""
    if "nll" not in metrics or "mean_nll" not in metrics:
        return None
    bma, mean = round(metrics["nll"], 4), round(metrics["mean_nll"], 4)  # as the table shows them
    if bma == mean:
        return f"On this run both predictions have the same negative log-likelihood ({bma:.4f})."
    if bma < mean:
        return ("On this run the **posterior-averaged** prediction is the better one by negative log-likelihood "
                f"(lower is better): {bma:.4f} vs {mean:.4f} at the posterior mean.")
    return (f"On this run the **posterior-mean** prediction is the better one by negative log-likelihood (lower is "
            f"better): {mean:.4f} vs {bma:.4f} with posterior averaging; `VariationalModel.from_pretrained(..., "
            f"num_samples=0)` predicts at the mean.")


def _matrix_table(matrix: list[list[float]], names: list[str]) -> str:
    header = "| clean \\ label | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    rows = "".join(f"| {names[i]} | " + " | ".join(f"{v:.3f}" for v in row) + " |\n" for i, row in enumerate(matrix))
    return header + rows


RELIABILITY_DIAGRAM_FILE = "reliability_diagram.png"


def write_reliability_diagram(diagram: dict[str, Any] | None, folder: str | os.PathLike, bma: bool) -> str | None:
    """Draw `diagram` (`varsmooth.metrics.reliability_diagram` of the last evaluation) into
    `folder/reliability_diagram.png` (the card embeds every picture of the run) and return its path; None when there
    is nothing to draw (no evaluation yet)."""
    if diagram is None or diagram["count"].sum() == 0:
        return None
    from ..figures import plot_reliability_diagram  # matplotlib only when there is something to draw

    os.makedirs(folder, exist_ok=True)
    prediction = "posterior-averaged prediction" if bma else "prediction"
    return plot_reliability_diagram(diagram, os.fspath(folder), RELIABILITY_DIAGRAM_FILE,
                                    title=f"Reliability of the {prediction}")


def build_model_card(record: RunRecord, model: Any, folder: str | os.PathLike) -> ModelCard:
    """The card of `model` trained by the run `record` and saved in `folder`: base model, data, injected label noise,
    method, metrics, label noise, usage.

    `record.datasets` names the data in the text; the `datasets:` metadata lists `record.dataset_tags` (default:
    `record.datasets`) that are Hub dataset ids, never local paths (`is_hub_dataset_id`); the license defaults to
    `DEFAULT_LICENSE`. The files listed are those of `folder`'s manifest, and its label-noise summary is shown.
    """
    output_dir = os.fspath(folder)
    adapter = _adapter(model)
    if adapter is not None:  # the card describes the base with its adapters, as peft's own cards do
        model = model.get_base_model()
    task = classification_task(model)
    auto_class = AUTO_CLASSES[task].__name__
    repo_id, model_name = record.repo_id, record.model_name
    # an adapter whose base was loaded from a local copy of a Hub model names its Hub id in the base's config
    base_model = (adapter is not None and _hub_id(adapter.base_model_name_or_path or "")) or _base_model(model)
    metrics, scored_on = record.metrics, record.scored_on
    method = record.method
    report = record.noise_report
    is_ivon = record.learns_posterior
    datasets = record.datasets
    hub_datasets = [d for d in record.dataset_tags or datasets if is_hub_dataset_id(d)]
    # a local folder is named by its last component: its path on the training machine means nothing to readers
    shown = [(d, True) if is_hub_dataset_id(d) else (os.path.basename(os.path.normpath(d)), False) for d in datasets]
    dataset_name = ", ".join(name for name, _ in shown) if shown else None
    license = record.license or DEFAULT_LICENSE
    tags, language = record.tags, record.language

    eval_results = []
    prediction = prediction_kind(record)
    if prediction == "bma":
        predictions = (("", "posterior-averaged"), ("mean_", "posterior mean"))
        if metrics.get("mean_nll", math.inf) < metrics.get("nll", math.inf):  # the better prediction first
            predictions = predictions[::-1]
    elif prediction == "mean":  # τ = 0 also reports the (equal) mean_* scores
        predictions = (("mean_" if "mean_nll" in metrics else "", "posterior mean"),)
    else:
        predictions = (("", ""),)
    for key, pretty in _METRIC_NAMES.items():
        for prefix, label in predictions:
            if prefix + key in metrics:
                eval_results.append(EvalResult(
                    task_type=task, dataset_type=hub_datasets[0] if hub_datasets else "custom",
                    dataset_name=dataset_name or scored_on,
                    metric_type=key, metric_value=float(metrics[prefix + key]),
                    metric_name=f"{pretty} ({label})" if label else pretty,
                ))
    card_data = ModelCardData(
        language=language, license=license, library_name="transformers" if adapter is None else "peft",
        base_model=base_model, datasets=hub_datasets or None, pipeline_tag=task, model_name=model_name,
        tags=sorted({"varsmooth", "noisy-labels", task, *(["ivon", "variational-learning"] if is_ivon else [method]),
                     *(tags or []), *([str(getattr(adapter.peft_type, "value", adapter.peft_type)).lower()]
                       + ([f"base_model:adapter:{base_model}"] if base_model else []) if adapter is not None else [])}),
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
            + f"realized rate **{report.realized_rate:.3f}** ({report.num_corrupted} of {report.num_examples} training "
              "labels differ from the clean ones)."
        )
        transition_table = _matrix_table(report.realized_transition,
                                         report.class_names or names or [str(i) for i in range(report.num_classes)])

    if metrics:
        columns = {"bma": (("",
                            f"posterior-averaged ({record.eval_mc_samples} samples, τ = "
                            f"{record.posterior_temperature.value:g})"),
                           ("mean_", "posterior mean")),
                   "mean": ((predictions[0][0], "posterior mean (no averaging)"),),
                   "weights": (("", "trained weights"),)}[prediction]
        rows = [f"| {pretty} | " + " | ".join(
            f"{metrics[p + key]:.4f}" if p + key in metrics else "–" for p, _ in columns) + " |"
            for key, pretty in _METRIC_NAMES.items() if any(p + key in metrics for p, _ in columns)]
        metrics_text = f"On the {scored_on}" + (f" of `{dataset_name}`" if dataset_name else "") + ":"
        metrics_table = ("| metric | " + " | ".join(label for _, label in columns) + " |\n|---|"
                         + "---|" * len(columns) + "\n" + "\n".join(rows) + "\n")
    else:
        metrics_text, metrics_table = "The model was not evaluated.", None
    better_text = _better_prediction_text(metrics) if prediction == "bma" else None
    if record.stalled_loss is not None:
        metrics_text = f"**Warning.** {stalled_loss_text(record.stalled_loss)}\n\n{metrics_text}"

    temperature = temperature_text(record) if is_ivon else None

    summary_path = os.path.join(output_dir, "label_noise_summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        detection = summary.get("detection")
        numbers = label_noise_numbers(summary, record.hyperparameters.get("ivon_smoothing"))
        label_noise_text = (
            "`label_noise.parquet` holds, for every training example, the label noise ε̄ = p̄ − P̂ that IVON's "
            "posterior induces (Yang et al. 2025, \"Variational Learning Induces Adaptive Label Smoothing\", Eq. 15). "
            + adaptivity_text(summary.get("adaptivity"))
            + " To find wrong labels, rank by the posterior-predictive confidence in the given label instead."
            + (f" {numbers}" if numbers else "")
            + ("\n\nHow well each score ranks the training labels known to be wrong (`detection` of "
               "`label_noise_summary.json`):\n\n" + _json_block(detection) if detection is not None else "")
            + "\n\n<details>\n<summary>label_noise_summary.json</summary>\n\n" + _json_block(summary) + "\n\n</details>"
        )
    else:
        label_noise_text = "No per-example label noise was exported for this model."
    present = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    manifest = read_manifest(output_dir) if present else None
    if manifest is not None:  # the card describes what a push uploads: this run's files, not strays beside them
        present = [f for f in present if f in manifest["files"]]
    pictures = [f for f in present if f.endswith(".png")]
    files = {f: _FILE_DESCRIPTIONS[f] + (" (the posterior mean)" if is_ivon and f in _WEIGHT_FILES else "")
             for f in present if f in _FILE_DESCRIPTIONS}
    files.update({p: "picture" for p in pictures})

    auto_map = getattr(getattr(model, "config", None), "auto_map", None) or {}
    return ModelCard.from_template(
        card_data,
        template_str=MODEL_CARD_TEMPLATE.read_text(encoding="utf-8"),
        model_name=model_name,
        repo_id=repo_id,
        task_name=task,
        auto_class=auto_class,
        method=method,
        method_text=method_text(record, "model.safetensors" if adapter is None else "adapter_model.safetensors"),
        prediction=prediction,
        remote_code=auto_class in auto_map,
        posterior_text=posterior_text(record),
        base_model_text=_base_model_text(base_model, model, adapter),
        adapter_text=_adapter_text(adapter, is_ivon),
        dataset_text=", ".join(f"[`{name}`](https://huggingface.co/datasets/{name})" if on_hub
                               else f"`{name}` (local data)"
                               for name, on_hub in shown) if shown else "not recorded",
        license=license,
        labels_text=", ".join(names) if names else "see config.json",
        corruption_text=corruption_text,
        transition_table=transition_table,
        hyperparameters={(USER_NAMES.get(k, k) if record.learns_posterior else k): v
                         for k, v in record.hyperparameters.items()},
        choice_text=f"Settings: {record.method_config_choice}." if record.method_config_choice else None,
        metrics_text=metrics_text,
        metrics_table=metrics_table,
        better_text=better_text,
        temperature_text=temperature,
        label_noise_text=label_noise_text,
        pictures=pictures,
        files=files,
        version=version("varsmooth"),
    )
