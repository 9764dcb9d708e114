"""What a trained classifier predicts, one `Predictor` per kind of prediction, chosen in one place (`make_predictor`).

* `PosteriorPredictor`: Bayesian model averaging over draws of IVON's posterior scaled by the posterior temperature τ,
  each draw with its own BatchNorm statistics when the posterior holds them (`posterior.draw_buffers`); at τ = 0 (or
  with no draws) the prediction at the posterior mean.
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

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..outputs import LABEL_KEYS, VariationalClassifierOutput, entropy as entropy_of
from ..posterior.gaussian import DiagonalGaussianPosterior
from ..temperature_scaling import TemperatureScaling
from .bma import predictive_distribution, predicts_at_the_mean
from .mc_dropout import mc_dropout_predictive

__all__ = ["EnsemblePredictor", "MCDropoutPredictor", "PosteriorPredictor", "Predictor", "make_predictor",
           "measuring_temperature"]


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
    """BMA over `num_samples` draws of `posterior` (the antithetic draws of `seed`, `prediction.draw_seeds`), σ scaled
    by the posterior's temperature τ; at τ = 0, with no draws or a point mass, the prediction at the posterior mean.

    τ is the posterior's (`posterior.temperature`: chosen in training, saved and loaded with σ); this class is what
    reads it for a prediction.
    """

    def __init__(self, posterior: DiagonalGaussianPosterior, num_samples: int, seed: int = 0) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0 = predict at the posterior mean), got {num_samples}.")
        self.posterior, self.num_samples, self.seed = posterior, int(num_samples), int(seed)

    @property
    def temperature(self) -> float:
        """τ: draws are θ = m + τ·σ⊙e (0: the posterior mean, 1: the learned posterior)."""
        return self.posterior.temperature

    @property
    def draws_nothing(self) -> bool:
        """Whether the prediction is the one at the posterior mean (τ = 0, no draws, or a point mass)."""
        return predicts_at_the_mean(self.posterior, self.num_samples)

    @property
    def samples_averaged(self) -> int:
        """The draws each prediction averages (0 at the posterior mean)."""
        return 0 if self.draws_nothing else self.num_samples

    def predict(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> VariationalClassifierOutput:
        return predictive_distribution(model, self.posterior, inputs, self.num_samples, self.seed)

    def describe(self) -> dict[str, Any]:
        if self.draws_nothing:
            return {"kind": "weights"}
        return {"kind": "bma", "num_samples": self.num_samples, "posterior_temperature": self.temperature}

    def evaluation_entries(self) -> dict[str, float]:
        return {"posterior_temperature": self.temperature, "posterior_samples_averaged": self.samples_averaged}

    @property
    def uncertainty_temperature(self) -> float | None:
        return (None if self.posterior.is_point_mass or self.num_samples == 0
                else measuring_temperature(self.temperature))

    def uncertainty(self, model: torch.nn.Module, inputs: Mapping[str, Any],
                    prediction: VariationalClassifierOutput | None = None) -> VariationalClassifierOutput:
        """The prediction's own draws; at τ = 0 the BMA of the learned posterior with the same draws, entropy
        included (`measuring_temperature`)."""
        measured_at = self.uncertainty_temperature
        if measured_at is not None and measured_at != self.temperature:
            return predictive_distribution(model, self.posterior.at_temperature(measured_at), inputs, self.num_samples,
                                           self.seed)
        return super().uncertainty(model, inputs, prediction)


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


def make_predictor(network: torch.nn.Module, posterior: DiagonalGaussianPosterior, num_samples: int, seed: int = 0,
                   mc_dropout_samples: int = 0) -> Predictor:
    """The prediction `network` makes: its own when it is an ensemble (a module whose `predictor` pools members,
    calibrated by its own temperature if it has one), MC dropout with `mc_dropout_samples > 0`, else BMA over
    `num_samples` draws of `posterior` (a point mass: at the weights)."""
    own = getattr(network, "predictor", None)
    if isinstance(own, EnsemblePredictor):
        scaling = getattr(network, "temperature_scaling", None)
        return own if scaling is None else _SelfCalibrated(own, scaling)
    if mc_dropout_samples > 0:
        return MCDropoutPredictor(mc_dropout_samples, seed)
    return PosteriorPredictor(posterior, num_samples, seed)


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
