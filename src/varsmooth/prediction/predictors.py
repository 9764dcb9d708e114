"""What a trained classifier predicts, one `Predictor` per kind of prediction, chosen in one place (`make_predictor`).

* `PosteriorPredictor`: Bayesian model averaging over draws of IVON's posterior scaled by the posterior temperature τ,
  each draw with its own BatchNorm statistics; at τ = 0 (or with no draws) the prediction at the posterior mean. It
  owns what such a prediction is made of (σ, τ, the draws and their statistics) and saves and loads them together.
* `MCDropoutPredictor`: the average over dropout masks (`varsmooth.prediction.mc_dropout`).
* `EnsemblePredictor`: the average of a deep ensemble's members' predictions (`varsmooth.prediction.ensemble`).

A point prediction (a network trained without a posterior) is a `PosteriorPredictor` over a point mass
(`DiagonalGaussianPosterior.point_mass`): it draws nothing and predicts at the weights.

The trainer, `VariationalModel`, `DeepEnsemble` and the pipelines predict through `Predictor.predict`, record what
they predict (with a fitted temperature scaling, `describe`) and report uncertainty (`uncertainty`) through it; no
other module asks which kind a prediction is. A fitted temperature scaling rescales a prediction afterwards
(`TemperatureScaling.calibrate`); it is not a kind of its own.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..outputs import LABEL_KEYS, VariationalClassifierOutput, entropy as entropy_of
from ..posterior.gaussian import DiagonalGaussianPosterior
from ..temperature_scaling import TemperatureScaling
from .batchnorm import (
    DrawBuffers,
    batchnorm_layers,
    draw_batchnorm_statistics,
    draw_buffer_tensors,
    draw_buffers_from_tensors,
)
from .bma import predictive_distribution, predicts_at_the_mean
from .mc_dropout import mc_dropout_predictive
from .temperature import TEMPERATURE_KEY, PosteriorTemperature

__all__ = ["EnsemblePredictor", "MCDropoutPredictor", "PosteriorPredictor", "Predictor", "as_posterior_predictor",
           "make_predictor", "measuring_temperature"]

#: the posterior file's metadata entries that a saved prediction holds beside σ's own: its draws (number and seed)
#: and what their buffers are (`PosteriorPredictor.save`)
SAMPLES_KEY, SEED_KEY, DRAWS_KEY = "eval_mc_samples", "eval_seed", "draw_buffers"
PREDICTION_KEYS = (TEMPERATURE_KEY, "posterior_temperature_selection", SAMPLES_KEY, SEED_KEY, DRAWS_KEY)
#: the draws of a prediction when neither the caller nor the saved model names them
DEFAULT_SAMPLES = 32


def measuring_temperature(temperature: float) -> float:
    """τ of the posterior draws that measure the uncertainty of a prediction at `temperature`: its own draws', or at
    τ = 0, which draws nothing (a mutual information of 0 would read as "certain"), the learned posterior's (τ = 1)."""
    return temperature or 1.0


class Predictor(ABC):
    """One kind of prediction of a classifier: `predict(model, inputs)` for one batch, uncalibrated."""

    @abstractmethod
    def predict(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> VariationalClassifierOutput:
        """The prediction on one batch: `logits` = log P̂ and what was measured with it (entropy, mutual
        information)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What `predict` computes, as recorded with a fitted temperature scaling and compared when a model is
        loaded."""

    def evaluation_entries(self) -> dict[str, float]:
        """What `evaluate()` reports of the prediction beside its scores (e.g. the posterior temperature)."""
        return {}

    @property
    def uncertainty_temperature(self) -> float | None:
        """The posterior temperature of the draws `uncertainty` averages (None: they are not posterior draws)."""
        return None

    def uncertainty(self, model: torch.nn.Module, inputs: Mapping[str, Any],
                    prediction: VariationalClassifierOutput | None = None) -> VariationalClassifierOutput:
        """The uncalibrated prediction whose entropy H[P̂], expected entropy and mutual information are reported as
        one measurement: all three from the same draws, so the mutual information never exceeds the entropy.
        `prediction`: `predict(model, inputs)` when already computed."""
        return self.predict(model, inputs) if prediction is None else prediction


class PosteriorPredictor(Predictor):
    """BMA over `num_samples` draws of `posterior` (the antithetic draws of `seed`, `bma.draw_seeds`), σ scaled by the
    posterior temperature τ; at τ = 0, with no draws or a point mass, the prediction at the posterior mean.

    The one holder of what such a prediction is made of: σ (`posterior`), τ (`temperature`, with how it was set) and
    `draw_buffers`, each draw's BatchNorm statistics (`varsmooth.prediction.batchnorm`; None: the model's own), which
    belong to the draws of `draws_temperature`. It is built once τ is known (`with_draw_statistics` computes the
    statistics) and never changes: another τ or other draws are another predictor (`drawing`). `save` writes all of
    it beside σ; `load` reads it back.
    """

    def __init__(self, posterior: DiagonalGaussianPosterior, num_samples: int, seed: int = 0,
                 temperature: PosteriorTemperature | None = None, draw_buffers: DrawBuffers | None = None) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0 = predict at the posterior mean), got {num_samples}.")
        if draw_buffers is not None and len(draw_buffers) < num_samples:
            raise ValueError(f"{len(draw_buffers)} draws' buffers cannot serve a prediction of {num_samples} draws.")
        self.posterior, self.num_samples, self.seed = posterior, int(num_samples), int(seed)
        self.posterior_temperature = PosteriorTemperature() if temperature is None else temperature
        self.draw_buffers = draw_buffers

    @property
    def temperature(self) -> float:
        """τ: draws are θ = m + τ·σ⊙e (0: the posterior mean, 1: the learned posterior)."""
        return self.posterior_temperature.value

    @property
    def draws_temperature(self) -> float:
        """The τ of the draws `draw_buffers` belong to: the prediction's own, or at τ = 0 (which draws nothing) those
        that measure its uncertainty (`measuring_temperature`)."""
        return measuring_temperature(self.temperature)

    @property
    def draws_nothing(self) -> bool:
        """Whether the prediction is the one at the posterior mean (τ = 0, no draws, or a point mass)."""
        return predicts_at_the_mean(self.posterior, self.num_samples, self.temperature)

    @property
    def samples_averaged(self) -> int:
        """The draws each prediction averages (0 at the posterior mean)."""
        return 0 if self.draws_nothing else self.num_samples

    def _buffers(self, temperature: float) -> DrawBuffers | None:
        """The statistics of the draws at `temperature`, when they are the ones held."""
        held = self.draw_buffers is not None and temperature == self.draws_temperature
        return self.draw_buffers[:self.num_samples] if held else None

    def lacks_draw_statistics(self, model: torch.nn.Module) -> bool:
        """Whether `model`'s draws would normalise with the posterior mean's BatchNorm statistics rather than their
        own: a BatchNorm network whose draws have none computed."""
        return (self.draw_buffers is None and not self.posterior.is_point_mass and self.num_samples > 0
                and bool(batchnorm_layers(model)))

    def with_draw_statistics(self, model: torch.nn.Module, batches: Sequence[Mapping[str, Any]],
                             progress: bool = False) -> PosteriorPredictor:
        """This prediction with each draw's BatchNorm statistics computed from `batches` (training data, read once
        per draw); itself when there is nothing to compute (`lacks_draw_statistics`). Every process must call it."""
        if not self.lacks_draw_statistics(model):
            return self
        buffers = draw_batchnorm_statistics(model, self.posterior, lambda: iter(batches), self.num_samples, self.seed,
                                            progress=progress, temperature=self.draws_temperature)
        return PosteriorPredictor(self.posterior, self.num_samples, self.seed, self.posterior_temperature, buffers)

    def drawing(self, num_samples: int | None = None, seed: int | None = None,
                temperature: PosteriorTemperature | None = None) -> PosteriorPredictor:
        """The prediction of the same posterior with other draws (by default this one's): `num_samples` draws of
        `seed` at `temperature`. The draws' statistics carry over when they are those draws (the first S draws of a
        seed are the same for every S)."""
        num_samples = self.num_samples if num_samples is None else num_samples
        seed = self.seed if seed is None else seed
        temperature = self.posterior_temperature if temperature is None else temperature
        if (num_samples, seed, temperature) == (self.num_samples, self.seed, self.posterior_temperature):
            return self
        same = (self.draw_buffers is not None and seed == self.seed and num_samples <= len(self.draw_buffers)
                and measuring_temperature(temperature.value) == self.draws_temperature)
        return PosteriorPredictor(self.posterior, num_samples, seed, temperature,
                                  self.draw_buffers[:num_samples] if same else None)

    def predict(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> VariationalClassifierOutput:
        return predictive_distribution(model, self.posterior, inputs, self.num_samples, self.seed,
                                       self._buffers(self.temperature), self.temperature)

    def describe(self) -> dict[str, Any]:
        if self.draws_nothing:
            return {"kind": "weights"}
        return {"kind": "bma", "num_samples": self.num_samples, "posterior_temperature": self.temperature}

    def evaluation_entries(self) -> dict[str, float]:
        return {"posterior_temperature": self.temperature, "posterior_samples_averaged": self.samples_averaged}

    @property
    def uncertainty_temperature(self) -> float | None:
        return None if self.posterior.is_point_mass or self.num_samples == 0 else self.draws_temperature

    def uncertainty(self, model: torch.nn.Module, inputs: Mapping[str, Any],
                    prediction: VariationalClassifierOutput | None = None) -> VariationalClassifierOutput:
        """The prediction's own draws; at τ = 0 the BMA of the learned posterior with the same draws, entropy
        included (`measuring_temperature`)."""
        measured_at = self.uncertainty_temperature
        if measured_at is not None and measured_at != self.temperature:
            return predictive_distribution(model, self.posterior, inputs, self.num_samples, self.seed,
                                           self._buffers(measured_at), measured_at)
        return super().uncertainty(model, inputs, prediction)

    def gathered(self) -> PosteriorPredictor:
        """This prediction with whole σ, for one process to `save` alone (`DiagonalGaussianPosterior.gathered`: under
        FSDP2 every process must call it)."""
        return PosteriorPredictor(self.posterior.gathered(), self.num_samples, self.seed, self.posterior_temperature,
                                  self.draw_buffers)

    def save(self, path: str | os.PathLike) -> str:
        """Write σ with all the prediction is made of (τ and how it was set, the draws, their statistics) into
        `path` (a folder: its `posterior.safetensors`), whole or not at all."""
        metadata = {**self.posterior_temperature.metadata(), SAMPLES_KEY: self.num_samples, SEED_KEY: self.seed}
        if self.draw_buffers is not None:
            metadata[DRAWS_KEY] = {"seed": self.seed, "temperature": self.draws_temperature,
                                   "num_draws": len(self.draw_buffers)}
        return self.posterior.save(path, metadata,
                                   None if self.draw_buffers is None else draw_buffer_tensors(self.draw_buffers))

    @classmethod
    def load(cls, model: torch.nn.Module, path: str | os.PathLike, num_samples: int | None = None,
             seed: int | None = None, temperature: float | None = None) -> PosteriorPredictor:
        """The prediction `save` wrote into `path` for `model` (whose weights must be the ones σ was saved with): its
        draws, seed and τ unless `num_samples`, `seed` or `temperature` are given (a τ given is fixed), its draws'
        statistics when they are the draws asked for. See `DiagonalGaussianPosterior.read` for what is refused."""
        posterior, extra = DiagonalGaussianPosterior.read(model, path)
        saved = {key: posterior.metadata.pop(key) for key in PREDICTION_KEYS if key in posterior.metadata}
        description = saved.get(DRAWS_KEY)
        if bool(extra) != (description is not None) or (description is not None and (
                not isinstance(description, dict) or not description.get("num_draws"))):
            raise ValueError(f"{path} holds posterior draws' buffers without their description, or the reverse: the "
                             "file was edited. Save the model again (trainer.save_model()).")
        samples, saved_seed = int(saved.get(SAMPLES_KEY, DEFAULT_SAMPLES)), int(saved.get(SEED_KEY, 0))
        tau, buffers = PosteriorTemperature.from_metadata(saved), None
        if description is not None:
            drawn = draw_buffers_from_tensors(extra, int(description["num_draws"]), model, os.fspath(path))
            prepared_for = (int(description["seed"]), float(description["temperature"]))
            if prepared_for == (saved_seed, measuring_temperature(tau.value)) and len(drawn) >= samples:
                buffers = drawn
        saved_prediction = cls(posterior, samples, saved_seed, tau, buffers)
        return saved_prediction.drawing(num_samples, seed,
                                        None if temperature is None else
                                        PosteriorTemperature.from_argument(temperature))


class MCDropoutPredictor(Predictor):
    """The average over `num_samples` dropout masks of `seed`
    (`varsmooth.prediction.mc_dropout.mc_dropout_predictive`)."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if num_samples <= 0:
            raise ValueError(f"MC dropout needs num_samples >= 1, got {num_samples}.")
        self.num_samples, self.seed = int(num_samples), int(seed)

    def predict(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> VariationalClassifierOutput:
        return mc_dropout_predictive(model, inputs, self.num_samples, self.seed)

    def describe(self) -> dict[str, Any]:
        return {"kind": "mc_dropout", "num_samples": self.num_samples}


class EnsemblePredictor(Predictor):
    """The average of the probabilities of `members` (Lakshminarayanan et al. 2017, Eq. 7, uniform weights), each
    member a module predicting its own distribution (a `VariationalModel`) with a `predictor` of its own.

    `predict` pools the members' predictions whatever `model` it is given: the members are the ensemble's networks.
    """

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        self.members = members

    def predict(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> VariationalClassifierOutput:
        inputs = {k: v for k, v in inputs.items() if k not in LABEL_KEYS}
        outputs = [member(**inputs) for member in self.members]
        shapes = {tuple(out.probs.shape) for out in outputs}
        if len(shapes) > 1:
            raise ValueError(f"The ensemble members predict outputs of different shapes {sorted(shapes)}: they do not "
                             "classify into the same classes. Ensemble models with the same number of classes.")
        probs = torch.stack([out.probs for out in outputs]).mean(0)
        # each member's mean entropy of its single models is H[P̂_n] − MI_n (0 for a member without draws)
        single_entropy = torch.stack([out.entropy if out.mutual_information is None
                                      else out.entropy - out.mutual_information
                                      for out in outputs]).mean(0)
        total_entropy = entropy_of(probs)
        mean_probs = torch.stack([out.mean_probs for out in outputs]).mean(0)
        return VariationalClassifierOutput(
            logits=probs.clamp_min(1e-30).log(), probs=probs, mean_logits=mean_probs.clamp_min(1e-30).log(),
            mean_probs=mean_probs, entropy=total_entropy,
            mutual_information=(total_entropy - single_entropy).clamp_min(0.0),
        )

    def describe(self) -> dict[str, Any]:
        return {"kind": "ensemble", "members": len(self.members),
                "member_predictions": [member.predictor.describe() for member in self.members]}


class _SelfCalibrated(Predictor):
    """A model's own prediction followed by the temperature it applies itself (an ensemble loaded with its fitted
    temperature): a trainer evaluating that model predicts as the model does."""

    def __init__(self, inner: Predictor, scaling: TemperatureScaling) -> None:
        self.inner, self.scaling = inner, scaling

    def predict(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> VariationalClassifierOutput:
        return self.scaling.calibrate(self.inner.predict(model, inputs))

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


def as_posterior_predictor(posterior: DiagonalGaussianPosterior | PosteriorPredictor, num_samples: int | None = None,
                           seed: int | None = None, temperature: float | None = None) -> PosteriorPredictor:
    """`posterior` as a prediction: a `PosteriorPredictor` with the draws and τ given replacing its own, or σ alone
    predicted with them (by default `DEFAULT_SAMPLES` draws of seed 0 at τ = 1)."""
    fixed = None if temperature is None else PosteriorTemperature.from_argument(temperature)
    if isinstance(posterior, PosteriorPredictor):
        return posterior.drawing(num_samples, seed, fixed)
    return PosteriorPredictor(posterior, DEFAULT_SAMPLES if num_samples is None else num_samples,
                              0 if seed is None else seed, PosteriorTemperature() if fixed is None else fixed)


def make_predictor(network: torch.nn.Module, bma: PosteriorPredictor, mc_dropout_samples: int = 0) -> Predictor:
    """The prediction `network` makes: its own when it is an ensemble (a module whose `predictor` pools members,
    calibrated by its own temperature if it has one), MC dropout with `mc_dropout_samples > 0` (the masks of `bma`'s
    seed), else `bma` (over a point mass: at the weights)."""
    own = getattr(network, "predictor", None)
    if isinstance(own, EnsemblePredictor):
        scaling = getattr(network, "temperature_scaling", None)
        return own if scaling is None else _SelfCalibrated(own, scaling)
    if mc_dropout_samples > 0:
        return MCDropoutPredictor(mc_dropout_samples, bma.seed)
    return bma


class PredictiveModel(torch.nn.Module):
    """A module that predicts with its `predictor` over its `network`, then rescales the prediction by its fitted
    `temperature_scaling`, if any (`VariationalModel`, `DeepEnsemble`)."""

    temperature_scaling: TemperatureScaling | None

    @property
    def predictor(self) -> Predictor:
        raise NotImplementedError

    @property
    def network(self) -> torch.nn.Module:
        """The module `predictor` predicts with."""
        return self

    def _calibrated(self, out: VariationalClassifierOutput) -> VariationalClassifierOutput:
        return out if self.temperature_scaling is None else self.temperature_scaling.calibrate(out)

    def forward(self, **inputs: Any) -> VariationalClassifierOutput:
        return self._calibrated(self.predictor.predict(self.network, inputs))

    def predict_with_uncertainty(self,
                                 **inputs: Any) -> tuple[VariationalClassifierOutput, VariationalClassifierOutput]:
        """(`forward(**inputs)`, the uncalibrated prediction whose entropy and mutual information measure the
        uncertainty, `Predictor.uncertainty`), computing the draws they share once."""
        predictor = self.predictor
        prediction = predictor.predict(self.network, inputs)
        return self._calibrated(prediction), predictor.uncertainty(self.network, inputs, prediction)
