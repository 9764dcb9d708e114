"""`VariationalModel`: a trained classifier together with its posterior, predicting by Bayesian model averaging."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForSequenceClassification, PreTrainedModel

from .adapters import has_adapter, is_peft_model, load_adapter_model, save_classifier_config
from .files import FolderSave, check_manifest
from .posterior import POSTERIOR_FILE, DiagonalGaussianPosterior, VariationalClassifierOutput, predictive_distribution

__all__ = ["AUTO_CLASSES", "VariationalModel", "classification_task", "load_posterior", "prediction_settings"]

#: the Auto class that loads a classifier of each task varsmooth serves
AUTO_CLASSES = {"image-classification": AutoModelForImageClassification,
                "text-classification": AutoModelForSequenceClassification}


def classification_task(model_or_config: Any) -> str:
    """The pipeline task of a classifier or of its configuration: `image-classification` when the model's class name,
    the architectures its configuration records (set by `save_pretrained`) or, for a configuration never saved, the
    configuration's class say so; else `text-classification`."""
    is_model = isinstance(model_or_config, torch.nn.Module)
    config = getattr(model_or_config, "config", None) if is_model else model_or_config
    names = [*([type(model_or_config).__name__] if is_model else []), *(getattr(config, "architectures", None) or [])]
    if any("ImageClassification" in name for name in names) or type(config) in AutoModelForImageClassification._model_mapping:
        return "image-classification"
    return "text-classification"


def _auto_class(config: Any) -> type:
    return AUTO_CLASSES[classification_task(config)]


class VariationalModel(torch.nn.Module):
    """A classifier whose forward averages softmax probabilities over `num_samples` posterior draws.

    `forward(**inputs)` returns a `VariationalClassifierOutput` whose `logits` are log P̂, so argmax/softmax
    code written for ordinary logits gets the BMA prediction; `num_samples=0` predicts at the posterior mean.
    For the same `seed` the draws are those of `VariationalTrainer.evaluate()` (common random numbers), scaled by
    the posterior temperature `posterior.temperature` chosen in training (saved with the posterior).
    """

    def __init__(self, model: torch.nn.Module, posterior: DiagonalGaussianPosterior, num_samples: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.model = model
        self.posterior = posterior
        self.num_samples, self.seed = prediction_settings(posterior, num_samples, seed)

    @property
    def config(self) -> Any:
        return getattr(self.model, "config", None)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        num_samples: int | None = None,
        seed: int | None = None,
        temperature: float | None = None,
        model_class: type | None = None,
        revision: str | None = None,
        token: str | None = None,
        **model_kwargs: Any,
    ) -> "VariationalModel":
        """Load weights (the posterior mean) and `posterior.safetensors` from a folder or a Hub repo.

        A folder or repo with a peft adapter (`adapter_config.json`) loads as its base model
        (`base_model_name_or_path`) + the adapter, and the posterior over the adapter weights; BMA then averages over
        adapter samples. `model_kwargs` go to the base model's `from_pretrained` (e.g. `dtype=torch.bfloat16`).

        Without a posterior file the model predicts at the mean, with a warning. Defaults for `num_samples`, `seed`
        and the posterior `temperature` are those the model was evaluated with during training (`temperature=1`: the
        learned posterior, 0: the posterior mean). A local folder must match its manifest, and the posterior must
        belong to the weights (see `DiagonalGaussianPosterior.load`).
        """
        path = os.fspath(pretrained_model_name_or_path)
        if has_adapter(path, revision, token):
            model = load_adapter_model(path, model_class, _auto_class, revision, token, **model_kwargs)
        else:
            if model_class is None:
                model_class = _auto_class(AutoConfig.from_pretrained(path, revision=revision, token=token))
            model = model_class.from_pretrained(path, revision=revision, token=token, **model_kwargs)
        model.eval()
        posterior = load_posterior(model, path, revision=revision, token=token)
        if temperature is not None:
            posterior.temperature = temperature
        num_samples, seed = prediction_settings(posterior, num_samples, seed)
        return cls(model, posterior, num_samples=num_samples, seed=seed)

    def forward(self, **inputs: Any) -> VariationalClassifierOutput:
        return predictive_distribution(self.model, self.posterior, inputs, self.num_samples, self.seed)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        adapter = is_peft_model(self.model)
        if not isinstance(self.model, PreTrainedModel) and not adapter:
            raise TypeError(f"save_pretrained needs a transformers PreTrainedModel or a peft model, got {type(self.model).__name__}.")
        save = FolderSave(save_directory).begin()
        self.model.save_pretrained(save_directory, **kwargs)
        if adapter:
            save_classifier_config(self.model, os.fspath(save_directory))
        if not self.posterior.is_point_mass:
            self.posterior.metadata = {**self.posterior.metadata, "eval_mc_samples": self.num_samples, "eval_seed": self.seed}
            self.posterior.save(save_directory)
        save.finish()


def prediction_settings(posterior: DiagonalGaussianPosterior, num_samples: int | None = None,
                        seed: int | None = None) -> tuple[int, int]:
    """The posterior samples and seed of predictions: those given, else those the model was evaluated with in training
    (saved with the posterior), else 32 samples and seed 0."""
    meta = posterior.metadata
    num_samples = int(meta.get("eval_mc_samples", 32)) if num_samples is None else num_samples
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 (0 = predict at the posterior mean), got {num_samples}.")
    return num_samples, int(meta.get("eval_seed", 0)) if seed is None else seed


def load_posterior(model: torch.nn.Module, path: str | os.PathLike, revision: str | None = None, token: str | None = None) -> DiagonalGaussianPosterior:
    """The posterior saved next to `model`'s weights (folder or Hub repo); a point mass, with a warning, if none."""
    if os.path.isdir(path):
        check_manifest(path)
    posterior_path = _resolve_posterior(os.fspath(path), revision, token)
    if posterior_path is None:
        warnings.warn(
            f"No {POSTERIOR_FILE} in {os.fspath(path)!r}: the model was not trained with IVON (or the file was not "
            "uploaded). Predicting at the posterior mean (a point estimate).", UserWarning, stacklevel=3,
        )
        return DiagonalGaussianPosterior.point_mass(model)
    return DiagonalGaussianPosterior.load(model, posterior_path)


def _resolve_posterior(path: str, revision: str | None, token: str | None) -> str | None:
    if os.path.isdir(path):
        candidate = os.path.join(path, POSTERIOR_FILE)
        return candidate if os.path.isfile(candidate) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(path, POSTERIOR_FILE, revision=revision, token=token)
    except EntryNotFoundError:
        return None
