"""What `VariationalTrainer` does once training ends, in this order (`AfterTrainingMixin.after_training`):

1. `recompute_batchnorm_statistics`, with `recompute_batchnorm_statistics`: BatchNorm's running statistics at the
   posterior mean (`varsmooth.prediction.batchnorm`);
2. `select_posterior_temperature`: τ by validation NLL (`varsmooth.prediction.temperature`), unless it is fixed;
3. `prepare_predictor`: the prediction every evaluation, prediction and save uses from then on, built once at that τ,
   each of its draws with BatchNorm statistics of its own (`varsmooth.prediction.PosteriorPredictor`);
4. `fit_temperature_scaling`, with `temperature_scaling=True` (`varsmooth.temperature_scaling`);
5. the method's own step (`TrainingMethod.after_training`: IVON warns when its Hessian hardly moved).

They run from the first `on_train_end` callback (`AfterTraining`), so that every other one (the label-noise export,
reporting, yours) sees the chosen τ and its draws; a failure among them never loses the trained run
(`CheckpointingMixin.train`). Each step is also a public method to call again (after changing τ, on another
validation set). They show progress bars as the evaluation loop does (tqdm, off with `disable_tqdm`, on the main
process only) and log how long they took.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback, TrainerState

from ..methods import EXAMPLE_INDEX_KEY
from ..prediction.batchnorm import (
    RECOMPUTED_LOG_KEY,
    batchnorm_layers,
    draw_batchnorm_statistics,
    head_batches,
    recompute_batchnorm_statistics,
)
from ..prediction.predictors import PosteriorPredictor
from ..prediction.temperature import SELECTION_SAMPLES, PosteriorTemperature, select_temperature, temperature_logs
from ..temperature_scaling import TemperatureScaling, fit_on_batches
from ..utils import length_order

__all__ = ["AfterTraining", "AfterTrainingMixin"]

logger = logging.getLogger(__name__)


class AfterTraining(TrainerCallback):
    """The trainer's one hook into the start and end of `train()`: `start` when training begins, `finish` when it ends,
    before every other `on_train_end` callback (`VariationalTrainer` puts it first)."""

    def __init__(self, start: Callable[[], None], finish: Callable[[TrainerState], None]) -> None:
        self.start, self.finish = start, finish

    def on_train_begin(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        self.start()

    def on_train_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        self.finish(state)


class AfterTrainingMixin:
    """The steps after training of `VariationalTrainer` (this module's docstring), on the trainer's own state: its
    model, posterior (`posterior()`), prediction (`posterior_predictor()`), data and arguments."""

    def before_training(self) -> None:
        """A new `train()` starts from the learned posterior (or the fixed τ), without the previous run's temperature
        scaling; `temperature_scaling=True` needs an eval dataset, checked now rather than after training."""
        self._predictor = None  # while training, each evaluation predicts with the posterior of its moment
        self.temperature_scaling = None
        if self.args.temperature_scaling and self.eval_dataset is None:
            raise ValueError("temperature_scaling=True fits the temperature on the eval dataset, and the trainer has "
                             "none: pass eval_dataset= (a validation split), or set temperature_scaling=False.")

    def after_training(self, state: TrainerState) -> None:
        """The steps after training, in order (this module's docstring). Every process must call this."""
        self._training_ended = True  # from here on, a failure must not lose the trained run
        if self.args.recompute_batchnorm_statistics:
            self.recompute_batchnorm_statistics()
        keeps_best = self.args.load_best_model_at_end and state.best_model_checkpoint
        if self.args.posterior_temperature is None and keeps_best:
            # best_metric was measured at the τ of the evaluations during training: choosing another τ now would
            # make the loaded best model predict other than what made it the best
            logger.info("load_best_model_at_end: keeping τ = 1, at which %s scored best_metric %s; to choose τ on the "
                        "validation NLL, call trainer.select_posterior_temperature() (the metrics then differ from "
                        "best_metric).", state.best_model_checkpoint, state.best_metric)
        chooses = self.args.posterior_temperature is None and not keeps_best
        # choosing τ prepares the prediction at it; without a choice, the prediction at the τ of the arguments
        if not chooses or self.select_posterior_temperature() is None:
            self.prepare_predictor()
        if self.args.temperature_scaling:
            self.fit_temperature_scaling()
        self.method.after_training(self.optimizer)

    def shows_progress(self) -> bool:
        """Whether work outside the Trainer's loops shows progress bars: as the Trainer's own, unless `disable_tqdm`,
        and on the main process only."""
        return not self.args.disable_tqdm and self.is_local_process_zero()

    def recompute_batchnorm_statistics(self) -> int:
        """Recompute BatchNorm's running statistics at the posterior mean from the training data (done by `train()` with
        `args.recompute_batchnorm_statistics`); returns the number of examples used, 0 when there was nothing to do (no
        posterior, no BatchNorm, no training data). See `varsmooth.prediction.batchnorm`. Every process must
        call this."""
        model = self.accelerator.unwrap_model(self.model)
        if self.train_dataset is None or self.posterior().is_point_mass:
            return 0
        batches = ({k: v for k, v in self._prepare_inputs(batch).items() if k != EXAMPLE_INDEX_KEY}
                   for batch in self.get_train_dataloader())
        start = time.perf_counter()
        examples = recompute_batchnorm_statistics(model, batches, progress=self.shows_progress())
        if examples:
            self.log({RECOMPUTED_LOG_KEY: examples})
            logger.info("BatchNorm statistics recomputed at the posterior mean from %d examples in %.1f s.", examples,
                        time.perf_counter() - start)
        return examples

    def select_posterior_temperature(self, eval_dataset: Any = None) -> dict[str, Any] | None:
        """Choose the posterior temperature τ by validation NLL and predict with it from now on (done by `train()`
        when `args.posterior_temperature` is None); returns the NLL at each τ tried, or None without validation data.
        See `varsmooth.prediction.temperature`."""
        if self.args.eval_mc_samples <= 0:  # a prediction at the mean already
            return None
        posterior = self.posterior()
        if posterior.is_point_mass:  # nothing to average
            return None
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if eval_dataset is None:  # not the training set: every example was fitted, it cannot tell which generalizes
            logger.info("No eval_dataset: predicting with the learned posterior (posterior temperature 1). Pass an "
                        "eval_dataset (a validation split) to choose the temperature by validation NLL, or set "
                        "posterior_temperature.")
            return None
        model, samples = self.accelerator.unwrap_model(self.model), min(self.args.eval_mc_samples, SELECTION_SAMPLES)
        batches = self._batchnorm_batches(model)
        draw_buffers = None if batches is None else (
            lambda tau: draw_batchnorm_statistics(model, posterior, lambda: iter(batches), samples, self.args.eval_seed,
                                                  progress=self.shows_progress(), temperature=tau))
        report = select_temperature(self.model, posterior, lambda: self.validation_batches(eval_dataset),
                                    samples, self.args.eval_seed, gather=self.accelerator.gather_for_metrics,
                                    transition=self.eval_noise_transition, draw_buffers=draw_buffers,
                                    progress=self.shows_progress())
        self.log(temperature_logs(report))
        self.prepare_predictor(PosteriorTemperature.chosen(report))
        return report

    def prepare_predictor(self, temperature: PosteriorTemperature | float | None = None) -> PosteriorPredictor:
        """Build the prediction every evaluation, prediction, save and label-noise export uses from now on: the
        current posterior at `temperature` (a number is fixed; default: the τ of the current prediction), with
        `eval_mc_samples` draws of `eval_seed`, each with BatchNorm statistics of its own computed from training data
        (at τ = 0, which draws nothing, those of the learned posterior's draws, which the label-noise export and a
        pipeline's mutual information use). Done by `train()` once τ is known; the one way to change τ after it.
        Every process must call it."""
        if temperature is None:
            temperature = self.posterior_predictor().posterior_temperature
        elif not isinstance(temperature, PosteriorTemperature):
            temperature = PosteriorTemperature.from_argument(temperature)
        # the statistics already computed carry over when they are those of the same draws of the same posterior
        predictor = self.posterior_predictor().drawing(self.args.eval_mc_samples, self.args.eval_seed, temperature)
        model = self.accelerator.unwrap_model(self.model)
        batches = None if predictor.posterior.is_point_mass else self._batchnorm_batches(model)
        if batches is not None and predictor.lacks_draw_statistics(model):
            start = time.perf_counter()
            predictor = predictor.with_draw_statistics(model, batches, progress=self.shows_progress())
            logger.info("BatchNorm statistics of each of the %d posterior draws at τ = %g computed in %.1f s.",
                        predictor.num_samples, predictor.draws_temperature, time.perf_counter() - start)
        self._predictor = predictor
        return predictor

    def _batchnorm_batches(self, model: torch.nn.Module) -> list[dict[str, Any]] | None:
        """The prepared training batches each posterior draw's BatchNorm statistics are computed from (the first
        `DRAW_RECALIBRATION_EXAMPLES` examples); None for a model without BatchNorm or no training data."""
        if not batchnorm_layers(model) or self.train_dataset is None:
            return None
        # in the dataset's order, not shuffled: the same examples and batches for every τ and every call
        return head_batches({k: v for k, v in self._prepare_inputs(batch).items() if k != EXAMPLE_INDEX_KEY}
                            for batch in self.get_eval_dataloader(self.train_dataset))

    def validation_batches(self, eval_dataset: Any) -> Iterator[dict[str, Any]]:
        """The prepared batches of `eval_dataset` (a dataset or a dict of them, pooled), batched as evaluate() batches
        them; tokenized sentences by length (each batch pads to its longest, and the scores on them are means over
        rows)."""
        named = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
        for dataset in named.values():
            order = length_order(dataset)
            loader = (self.get_eval_dataloader(dataset) if order is None else
                      self._get_dataloader(dataset, "Validation", self.args.eval_batch_size,
                                           sampler_fn=lambda _, order=order: order))
            for batch in loader:
                yield self._prepare_inputs(batch)

    def fit_temperature_scaling(self, eval_dataset: Any = None) -> TemperatureScaling:
        """Fit the post-hoc temperature T on `eval_dataset` (default: the eval datasets) by NLL and predict with it from
        now on; done when training ends with `args.temperature_scaling`. `trainer.temperature_scaling = None` goes back
        to the uncalibrated prediction. See `varsmooth.temperature_scaling`. Every process must call this."""
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        self.model.eval()
        predictor = self.predictor()
        scaling = fit_on_batches(functools.partial(self.predictive, self.model, predictor=predictor, calibrated=False),
                                 None if eval_dataset is None else self.validation_batches(eval_dataset),
                                 predictor.describe(), self.accelerator.gather_for_metrics,
                                 self.accelerator.unwrap_model(self.model))
        self.temperature_scaling = scaling
        self.log({"temperature_scaling": scaling.temperature, "eval_nll_uncalibrated": scaling.nll_uncalibrated,
                  "eval_nll_calibrated": scaling.nll_calibrated})
        return scaling
