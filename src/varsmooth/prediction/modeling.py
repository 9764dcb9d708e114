"""`VariationalModel`: a trained classifier together with its posterior, predicting by Bayesian model averaging."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from ..adapters import has_adapter, is_peft_model, load_adapter_model, save_classifier_config
from ..files import FolderSave, check_manifest, is_leftover, recover
from ..posterior import POSTERIOR_FILE, DiagonalGaussianPosterior
from ..posterior.gaussian import non_finite_tensors
from ..temperature_scaling import TEMPERATURE_SCALING_FILE, TemperatureScaling
from .mc_dropout import OUTPUT_DROPOUT_KEY, add_output_dropout
from .predictors import PosteriorPredictor, PredictiveModel, Predictor, as_posterior_predictor, make_predictor

#: marker file of a saved folder that another class loads -> that class's `from_pretrained` (a `DeepEnsemble` folder
#: registers itself here: the ensemble is made of `VariationalModel`s, so this module cannot import it)
FOLDER_LOADERS: dict[str, Callable[..., torch.nn.Module]] = {}

__all__ = ["AUTO_CLASSES", "FOLDER_LOADERS", "VariationalModel", "check_finite_weights", "classification_task",
           "load_posterior_predictor", "load_temperature_scaling", "predictive_model"]

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
    if (any("ImageClassification" in name for name in names)
            or type(config) in AutoModelForImageClassification._model_mapping):
        return "image-classification"
    return "text-classification"


def _auto_class(config: Any) -> type:
    return AUTO_CLASSES[classification_task(config)]


def refuse_missing_folder(path: str) -> None:
    """Name a local path that is no folder as such, rather than as a Hub repo id it cannot be: an absolute path, one
    starting with `.` or `~`, one of more than two components (a Hub id is `owner/name`), or a file."""
    if os.path.isdir(path):
        return
    if os.path.isfile(path):
        raise NotADirectoryError(f"{path!r} is a file: pass the folder a model was saved in (save_model / "
                                 "save_pretrained), or a Hub repo id (`owner/name`).")
    if os.path.isabs(path) or path.startswith((".", "~")) or len(path.replace(os.sep, "/").split("/")) > 2:
        where = "" if os.path.isabs(path) else f" under {os.getcwd()!r}"
        raise FileNotFoundError(f"No folder {path!r}{where}: check the path the model was saved to. A Hub repo id is "
                                "`owner/name`.")


class VariationalModel(PredictiveModel):
    """A classifier whose forward averages softmax probabilities over `num_samples` posterior draws.

    `forward(**inputs)` returns a `VariationalClassifierOutput` whose `logits` are log P̂, so argmax/softmax
    code written for ordinary logits gets the BMA prediction; `num_samples=0` predicts at the posterior mean.
    For the same `seed` the draws are those of `VariationalTrainer.evaluate()` (common random numbers), scaled by
    the posterior temperature τ chosen in training (saved with the posterior). `posterior` is σ alone (then
    `num_samples` default 32, `seed` 0, `temperature` τ = 1) or a whole `PosteriorPredictor` (σ, τ, the draws and their
    BatchNorm statistics, as `from_pretrained` loads it), whose settings the arguments given replace.

    `mc_dropout_samples > 0` predicts by MC dropout instead (`varsmooth.prediction.mc_dropout`), for models trained
    without a posterior. A `temperature_scaling` (`varsmooth.temperature_scaling.TemperatureScaling`) rescales the final
    prediction: `logits`, `probs` and `entropy` are then the calibrated ones.
    """

    def __init__(self, model: torch.nn.Module, posterior: DiagonalGaussianPosterior | PosteriorPredictor,
                 num_samples: int | None = None, seed: int | None = None,
                 temperature_scaling: TemperatureScaling | None = None, mc_dropout_samples: int = 0,
                 temperature: float | None = None) -> None:
        super().__init__()
        if mc_dropout_samples < 0:
            raise ValueError(f"mc_dropout_samples must be >= 0 (0 = no MC dropout), got {mc_dropout_samples}.")
        self.model = model
        self.posterior_predictor = as_posterior_predictor(posterior, num_samples, seed, temperature)
        if mc_dropout_samples and not self.posterior.is_point_mass:
            raise ValueError("mc_dropout_samples is for models without a posterior: this one predicts by Bayesian "
                             "model averaging over its posterior (num_samples). Set mc_dropout_samples=0.")
        self.temperature_scaling = temperature_scaling
        self.mc_dropout_samples = mc_dropout_samples
        self._predictor = make_predictor(model, self.posterior_predictor, mc_dropout_samples)
        warn_without_draw_buffers(model, self.posterior_predictor)

    @property
    def posterior(self) -> DiagonalGaussianPosterior:
        """q = N(m, diag σ²) over `model`'s weights (a point mass for a model without one)."""
        return self.posterior_predictor.posterior

    @property
    def num_samples(self) -> int:
        return self.posterior_predictor.num_samples

    @property
    def seed(self) -> int:
        return self.posterior_predictor.seed

    @property
    def predictor(self) -> Predictor:
        """What `forward` predicts with (`varsmooth.prediction.predictors`)."""
        return self._predictor

    @property
    def network(self) -> torch.nn.Module:
        return self.model

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
        temperature_scaling: bool = True,
        mc_dropout_samples: int = 0,
        model_class: type | None = None,
        revision: str | None = None,
        token: str | None = None,
        **model_kwargs: Any,
    ) -> torch.nn.Module:
        """Load weights (the posterior mean) and `posterior.safetensors` from a folder or a Hub repo.

        A folder or repo with a peft adapter (`adapter_config.json`) loads as its base model
        (`base_model_name_or_path`) + the adapter, and the posterior over the adapter weights; BMA then averages over
        adapter samples; a base whose weights differ from those the adapter was trained on is refused. `model_kwargs`
        go to the base model's `from_pretrained` (e.g. `dtype=torch.bfloat16`).

        Without a posterior file the model predicts at the mean, with a warning. Defaults for `num_samples`, `seed`
        and the posterior `temperature` are those the model was evaluated with during training (`temperature=1`: the
        learned posterior, 0: the posterior mean). A local folder must match its manifest (sizes and SHA-256, checked
        before any weight is read), the weights must be finite, and the posterior must belong to them (see
        `DiagonalGaussianPosterior.load`).

        The temperature fitted by temperature scaling (`temperature_scaling.json`) is applied when the folder has one
        (`temperature_scaling=False`: the uncalibrated prediction); a file fitted for other weights is refused.
        `mc_dropout_samples > 0` predicts by MC dropout. A deep-ensemble folder (`ensemble_config.json`, written by
        `varsmooth.DeepEnsemble.save_pretrained`) loads as a `DeepEnsemble`, its members with these settings.
        """
        path = os.fspath(pretrained_model_name_or_path)
        refuse_missing_folder(path)
        if os.path.isdir(path):  # before the folder's kind is told by its files: a killed save may still hold them
            recover(path)
            if not [name for name in os.listdir(path) if not is_leftover(name)]:
                raise ValueError(f"{path} holds no saved model: it is empty (a save into it that did not finish leaves "
                                 "nothing behind). Save the model again, or check the path.")
        for marker, load in FOLDER_LOADERS.items():
            if os.path.isfile(os.path.join(path, marker)):
                return load(path, num_samples=num_samples, seed=seed, temperature=temperature,
                            temperature_scaling=temperature_scaling, mc_dropout_samples=mc_dropout_samples,
                            model_class=model_class, **model_kwargs)
        if os.path.isdir(path):  # before any weight is read: a truncated or edited file is named, not half-loaded
            check_manifest(path)
        if has_adapter(path, revision, token):
            model = load_adapter_model(path, model_class, _auto_class, revision, token, **model_kwargs)
        else:
            if model_class is None:
                model_class = _auto_class(AutoConfig.from_pretrained(path, revision=revision, token=token))
            model = model_class.from_pretrained(path, revision=revision, token=token, **model_kwargs)
        if getattr(model.config, OUTPUT_DROPOUT_KEY, None) is not None:  # trained with `add_output_dropout`
            add_output_dropout(model, getattr(model.config, OUTPUT_DROPOUT_KEY))
        model.eval()
        return predictive_model(model, path, num_samples=num_samples, seed=seed, temperature=temperature,
                                temperature_scaling=temperature_scaling, mc_dropout_samples=mc_dropout_samples,
                                revision=revision, token=token, manifest_checked=True)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        adapter = is_peft_model(self.model)
        if not isinstance(self.model, PreTrainedModel) and not adapter:
            raise TypeError("save_pretrained needs a transformers PreTrainedModel or a peft model, got "
                            f"{type(self.model).__name__}.")
        check_finite_weights(self.model, os.fspath(save_directory), saving=True)
        with FolderSave(save_directory) as save:
            self.model.save_pretrained(save.path, **kwargs)
            if adapter:
                save_classifier_config(self.model, save.path)
            if not self.posterior.is_point_mass:
                self.posterior_predictor.save(save.path)
            if self.temperature_scaling is not None:
                self.temperature_scaling.save(save.path, self.model)
            save.finish()


def check_finite_weights(model: torch.nn.Module, where: str, saving: bool = False) -> None:
    """Refuse a network with NaN or ±inf weights (parameters or buffers), loaded from or about to be saved to `where`:
    it would predict NaN scores without a word."""
    bad = non_finite_tensors([*model.named_parameters(), *model.named_buffers()])
    if not bad:
        return
    names = f"{bad[:5]}{' ...' if len(bad) > 5 else ''}"
    if saving:
        raise FloatingPointError(f"Not saving to {where}: the weights {names} are not finite (NaN or inf); nothing "
                                 "was written. Save a model with finite weights (e.g. loaded from an earlier save).")
    raise ValueError(f"The weights loaded from {where} are not finite (NaN or inf) in {names}: the model was saved "
                     "after training diverged, or the file was edited. Load an earlier checkpoint, or train again.")


def warn_without_draw_buffers(model: torch.nn.Module, predictor: PosteriorPredictor) -> None:
    """Warn when BMA with `predictor` would normalise every draw of a BatchNorm network with the statistics of the
    posterior mean: none of their own are held for those draws (another τ, seed or more draws than training
    prepared), and such draws are far worse networks than the ones training fitted
    (`varsmooth.prediction.batchnorm`)."""
    if predictor.draws_nothing or not predictor.lacks_draw_statistics(model):
        return
    warnings.warn(
        f"The {predictor.num_samples} posterior draws of seed {predictor.seed} at temperature "
        f"{predictor.temperature:g} have no BatchNorm statistics of their own: each draw normalises with the posterior "
        "mean's, which makes it a worse network than training fitted. Predict with the draws training prepared (the "
        "defaults of from_pretrained), or compute theirs from training data (VariationalTrainer.prepare_predictor).",
        UserWarning, stacklevel=3,
    )


def predictive_model(model: torch.nn.Module, path: str | os.PathLike, *, num_samples: int | None = None,
                     seed: int | None = None, temperature: float | None = None, temperature_scaling: bool = True,
                     mc_dropout_samples: int = 0, revision: str | None = None, token: str | None = None,
                     manifest_checked: bool = False) -> VariationalModel:
    """`model`, loaded from `path` (a folder or Hub repo), with what was saved beside it: the one loader of a saved
    prediction, for `VariationalModel.from_pretrained` and the pipelines. A local folder must match its manifest
    (unless `manifest_checked`), the weights must be finite, the posterior must belong to them
    (`PosteriorPredictor.load`; a point mass with a warning when there is none) and a fitted temperature scaling
    (applied unless `temperature_scaling=False`) to this prediction."""
    where = os.fspath(path)
    if os.path.isdir(where) and not manifest_checked:
        check_manifest(where)
    check_finite_weights(model, where)
    predictor = load_posterior_predictor(model, where, num_samples, seed, temperature, revision, token)
    loaded = VariationalModel(model, predictor, mc_dropout_samples=mc_dropout_samples)
    if temperature_scaling:
        loaded.temperature_scaling = load_temperature_scaling(model, where, revision=revision, token=token)
        if loaded.temperature_scaling is not None:
            loaded.temperature_scaling.check_prediction(loaded.predictor.describe(), where)
    return loaded


def load_posterior_predictor(model: torch.nn.Module, path: str | os.PathLike, num_samples: int | None = None,
                             seed: int | None = None, temperature: float | None = None, revision: str | None = None,
                             token: str | None = None) -> PosteriorPredictor:
    """The prediction saved next to `model`'s weights (folder or Hub repo, `PosteriorPredictor.load`); over a point
    mass, with a warning, if there is none."""
    posterior_path = _resolve_file(os.fspath(path), POSTERIOR_FILE, revision, token)
    if posterior_path is None:
        warnings.warn(
            f"No {POSTERIOR_FILE} in {os.fspath(path)!r}: the model was not trained with IVON (or the file was not "
            "uploaded). Predicting at the posterior mean (a point estimate).", UserWarning, stacklevel=3,
        )
        return as_posterior_predictor(DiagonalGaussianPosterior.point_mass(model), num_samples, seed, temperature)
    return PosteriorPredictor.load(model, posterior_path, num_samples, seed, temperature)


def load_temperature_scaling(model: torch.nn.Module, path: str | os.PathLike, revision: str | None = None,
                             token: str | None = None) -> TemperatureScaling | None:
    """The temperature fitted for `model`'s weights and saved next to them (folder or Hub repo), or None if none."""
    found = _resolve_file(os.fspath(path), TEMPERATURE_SCALING_FILE, revision, token)
    return None if found is None else TemperatureScaling.load(found, model)


def _resolve_file(path: str, name: str, revision: str | None, token: str | None) -> str | None:
    if os.path.isdir(path):
        candidate = os.path.join(path, name)
        return candidate if os.path.isfile(candidate) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(path, name, revision=revision, token=token)
    except EntryNotFoundError:
        return None
