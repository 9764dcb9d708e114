"""How `VariationalTrainer` predicts (`PredictionMixin`): the posterior it learned or was given, and the one
prediction built from it once τ is known (`varsmooth.prediction.PosteriorPredictor`), which `evaluate()`, `predict()`,
saves and the label-noise export all use."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..outputs import VariationalClassifierOutput
from ..posterior import POSTERIOR_FILE, DiagonalGaussianPosterior
from ..prediction.modeling import warn_without_draw_buffers
from ..prediction.predictors import PosteriorPredictor, Predictor, make_predictor
from ..prediction.temperature import PosteriorTemperature

__all__ = ["PredictionMixin"]

logger = logging.getLogger(__name__)


class PredictionMixin:
    """For `VariationalTrainer`: its posterior and prediction, from its method, optimizer, model and arguments; the
    prediction built when training ends is `_predictor` (`AfterTrainingMixin.prepare_predictor`)."""

    _predictor: PosteriorPredictor | None

    def posterior(self) -> DiagonalGaussianPosterior:
        """The current q = N(m, diag σ²): IVON's once it trains; before that the one of the prediction passed as
        `posterior=` or saved beside the model (`posterior.safetensors` in its `name_or_path` folder); else a point
        mass."""
        learned = self._learned_posterior()
        if learned is not None:
            return learned
        return (self._predictor.posterior if self._predictor is not None
                else DiagonalGaussianPosterior.point_mass(self.accelerator.unwrap_model(self.model)))

    def _learned_posterior(self) -> DiagonalGaussianPosterior | None:
        """The posterior the method has learned in this trainer's optimizer (`TrainingMethod.posterior`); None: none
        learned."""
        return self.method.posterior(self.accelerator.unwrap_model(self.model), self.optimizer, {})

    def posterior_predictor(self) -> PosteriorPredictor:
        """What Bayesian model averaging predicts with: the prediction built when training ended (`prepare_predictor`:
        τ chosen, each draw's BatchNorm statistics) or loaded with the model, with the draws the arguments ask for now
        (`eval_mc_samples`, `eval_seed`); while training, the posterior of this moment at the τ of the arguments (1
        unless `posterior_temperature` fixes it), its draws normalising with the model's statistics."""
        if self._predictor is not None:
            predictor = self._predictor.drawing(self.args.eval_mc_samples, self.args.eval_seed)
            warn_without_draw_buffers(self.accelerator.unwrap_model(self.model), predictor)
            return predictor
        return PosteriorPredictor(self.posterior(), self.args.eval_mc_samples, self.args.eval_seed,
                                  PosteriorTemperature.from_argument(self.args.posterior_temperature))

    @property
    def posterior_temperature(self) -> PosteriorTemperature:
        """τ of the predictions (`posterior_predictor()`'s) and how it was set; `prepare_predictor(τ)` changes it."""
        return self.posterior_predictor().posterior_temperature

    def _saved_prediction(self) -> PosteriorPredictor | None:
        """What a save writes beside the weights: the prediction (σ, τ, the draws and their statistics) of the posterior
        learned or loaded; None for a point mass (a method without one)."""
        predictor = self.posterior_predictor()
        return None if predictor.posterior.is_point_mass else predictor

    def _predictor_beside_model(self) -> PosteriorPredictor | None:
        """The prediction an IVON run saved next to the weights this trainer's model was loaded from, if any, with
        this trainer's draws (`eval_mc_samples`, `eval_seed`) and, when `posterior_temperature` is set, its τ."""
        folder = getattr(self.model, "name_or_path", None) or ""
        if not self.method.learns_posterior or not os.path.isfile(os.path.join(folder, POSTERIOR_FILE)):
            return None
        try:
            predictor = PosteriorPredictor.load(self.model, folder, self.args.eval_mc_samples, self.args.eval_seed,
                                                self.args.posterior_temperature)
        except ValueError as error:  # e.g. a new classification head: the saved σ belongs to another network
            logger.warning("Not using %s from %s: %s", POSTERIOR_FILE, folder, error)
            return None
        logger.info("Loaded the posterior saved with the model (%s): evaluation before training predicts by BMA with "
                    "it.", os.path.join(folder, POSTERIOR_FILE))
        return predictor

    def predictor(self) -> Predictor:
        """What `evaluate()`/`predict()` predict with (`varsmooth.prediction.predictors.make_predictor`): a
        `DeepEnsemble` model's pooled prediction, MC dropout (`args.mc_dropout_samples`), or BMA
        (`posterior_predictor()`; over a point mass, at the weights)."""
        return make_predictor(self.accelerator.unwrap_model(self.model), self.posterior_predictor(),
                              self.args.mc_dropout_samples)

    def predictive(self, model: torch.nn.Module, inputs: dict[str, Any], predictor: Predictor | None = None,
                   calibrated: bool = True) -> VariationalClassifierOutput:
        """The prediction `evaluate()`/`predict()` score on one prepared batch: `predictor`'s (default:
        `self.predictor()`), then the temperature scaling, if fitted and `calibrated`."""
        out = (self.predictor() if predictor is None else predictor).predict(model, inputs)
        return self.temperature_scaling.calibrate(out) if calibrated and self.temperature_scaling is not None else out
