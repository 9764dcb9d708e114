"""`VariationalTrainer`: `transformers.Trainer` that trains with a registered method (IVON by default) and predicts by
Bayesian model averaging over the posterior IVON learns.

The trainer holds one value for the layers below it, the prediction it makes (`posterior_predictor()`: the posterior,
its temperature τ and its draws, built once when training ends), and hands values down, never itself: a method gets its
config and a `MethodContext` (`varsmooth.methods`; IVON's Monte-Carlo step is `IVONMethod.training_step`), callbacks
get handles, τ and the temperature scaling are chosen by functions of (model, posterior, batches), and what
`evaluate()`/`predict()` predict with is a `Predictor` chosen from (model, that prediction, arguments) by
`varsmooth.prediction.predictors.make_predictor`. Its other jobs live beside it in this package: its posterior and
the prediction made from it (`prediction`), the checks of its inputs (`checks`), the steps after training, in one
ordered sequence (`after_training`), saves and resumes (`checkpointing`, `checkpoint_files`), the guard against
non-finite steps (`finite`), FSDP2 (`fsdp`), the model card and Hub pushes (`hub`) and hyperparameter search
(`hp_search`); the metrics of `evaluate()`
(`varsmooth.metrics.evaluation_metrics`) and `label_noise()` (`varsmooth.label_noise.LabelNoiseMixin`) come from below.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PredictionOutput

from ..corruption import realized_noise_report
from ..label_noise import LabelNoiseCallback, LabelNoiseMixin
from ..methods import (
    EXAMPLE_INDEX_KEY,
    CallbackContext,
    ExampleIndexDataset,
    MethodContext,
    OptimizerContext,
    TrainingMethod,
    get_method_class,
)
from ..metrics.evaluation_metrics import EvaluationMetrics
from ..model_parts import model_num_labels
from ..posterior import POSTERIOR_FILE, VariationalIVON, unwrap_ivon
from ..posterior.gaussian import non_finite_tensors
from ..prediction.predictors import PosteriorPredictor, as_posterior_predictor, make_predictor
from ..prediction.temperature import check_transition_matrix
from ..temperature_scaling import TemperatureScaling
from ..training_health import StalledLossCallback
from .after_training import AfterTraining, AfterTrainingMixin
from .arguments import VariationalTrainingArguments
from .checkpointing import CheckpointingMixin
from .checks import (
    check_arguments,
    check_compute_metrics,
    check_datasets,
    check_input_columns,
    check_label_names,
    check_labels,
    check_method_inputs,
    check_single_label_model,
    name_inputs_the_model_cannot_take,
    named_datasets,
)
from .finite import NonFiniteGuard, non_finite_step_error
from .fsdp import keep_presharded_model, shardable_by_accelerate
from .hp_search import HyperparameterSearchMixin
from .hub import VariationalHubMixin
from .prediction import PredictionMixin

__all__ = ["VariationalTrainer"]

logger = logging.getLogger(__name__)


class VariationalTrainer(AfterTrainingMixin, PredictionMixin, CheckpointingMixin, VariationalHubMixin, LabelNoiseMixin,
                         HyperparameterSearchMixin, Trainer):
    """A `Trainer` for single-label classifiers that trains with `args.method` (IVON by default).

    Models may be any module returning logits in a `ModelOutput` or tuple (HF `AutoModelFor*Classification`,
    timm through `example_utils.models.create_image_classifier` in the examples, ...); the loss is computed here from
    the logits. Multi-label and regression models are refused. `compute_metrics` and `preprocess_logits_for_metrics` get
    log P̂ as the logits (softmax of them is P̂; `EvaluationMetrics`); `label_names=[name]` names the label column of
    training and evaluation alike; for `compute_loss_func` see `compute_loss`, for `hyperparameter_search`
    `HyperparameterSearchMixin`; the `TrainingArguments` a method cannot honour are refused or warned of as
    `arguments.UNHONOURED_ARGUMENTS` declares. `posterior=` predicts before training with a saved prediction
    (`PosteriorPredictor.load`: σ, τ and each draw's BatchNorm statistics) or with σ alone (a
    `DiagonalGaussianPosterior`, at τ = 1 unless `posterior_temperature` says otherwise).

    Private `Trainer` hooks it overrides, and what would not work without each:

    * the saving and resuming hooks: see `CheckpointingMixin` (`varsmooth.trainer.checkpointing`);
    * `_get_dataloader`: adds each training row's index, which methods with per-example state (ALASCA) key on;
    * `_set_signature_columns_if_needed`: `remove_unused_columns` would drop the example index and the inputs of a
      `DeepEnsemble` (whose forward takes `**inputs`);
    * `_remove_unused_columns`: removing the raw columns of a `with_transform` dataset would break its transform;
    * `_clip_grad_norm`: IVON clips inside each sample; the stock clip after the last sample would rescale gradients
      IVON still reads (ḡ with one sample) and log a clipped norm;
    * `_push_from_checkpoint` (in `VariationalHubMixin`): the stock one copies only the config and weights from the
      checkpoint, so the posterior and processor of a mid-training push would be stale or missing.
    """

    #: `compute_loss` returns the micro-batch mean (it ignores `num_items_in_batch`), so the stock
    #: `training_step` must divide by the accumulation steps even for models that accept loss kwargs
    loss_is_scaled_for_ga = False

    def __init__(self, model: Any = None, args: VariationalTrainingArguments | None = None, *pargs: Any,
                 **kwargs: Any) -> None:
        args = check_arguments(args)
        check_label_names(args)
        user_metrics = kwargs.pop("compute_metrics", None)
        check_compute_metrics(args, user_metrics)
        self._noise_report = kwargs.pop("noise_report", None)
        eval_noise_transition = kwargs.pop("eval_noise_transition", None)
        posterior = kwargs.pop("posterior", None)
        if model is not None:
            check_single_label_model(model)
        user_preprocess = kwargs.pop("preprocess_logits_for_metrics", None)
        self._metrics = EvaluationMetrics(user_metrics, user_preprocess)
        super().__init__(model, args, *pargs, compute_metrics=self._metrics,
                         preprocess_logits_for_metrics=self._metrics.preprocess if user_preprocess else None, **kwargs)
        # what the method decides from the model it trains (IVON's preset, when none was named), said once
        self.args, self.method_config_choice = self.args.for_model(self.model)
        if self.method_config_choice is not None:
            logger.info("%s: %s.", self.args.method, self.method_config_choice)
        # every label the run will read, the evaluation's and the label-noise export's too, is checked now: one found
        # bad after training would cost the run
        self._train_size = check_datasets(self.train_dataset, self.eval_dataset, model_num_labels(self.model))
        for callback in self.callback_handler.callbacks:  # those passed at construction
            self._connect(callback)
        self._method_callbacks: list[TrainerCallback] = []
        self._build_method()
        if self.model is not None:  # the columns the model (and the method) take, known now
            self._set_signature_columns_if_needed()
            for role, dataset in named_datasets(self.train_dataset, self.eval_dataset):
                check_input_columns(role, dataset, self._signature_columns, args.remove_unused_columns)
        check_method_inputs(self.method, self.compute_loss_func, posterior, self.optimizer)
        if self.optimizer is not None:  # passed in `optimizers`
            self.method.use_optimizer(self.optimizer, list(self.model.named_parameters()), new=True)
        # the prediction of every evaluation once τ is known: built when training ends (`prepare_predictor`), or
        # the one saved beside the model (or given as `posterior=`) until this trainer trains
        self._predictor: PosteriorPredictor | None = (
            self._predictor_beside_model() if posterior is None
            else as_posterior_predictor(posterior, self.args.eval_mc_samples, self.args.eval_seed,
                                        self.args.posterior_temperature))
        #: T[i, j] = P(observed j | true i) of the eval dataset's labels, when known (e.g. the noise the example
        #: injected): τ is then chosen by the forward-corrected validation NLL (`varsmooth.prediction.temperature`)
        self.eval_noise_transition = (None if eval_noise_transition is None
                                      else check_transition_matrix(eval_noise_transition))
        # post-hoc temperature of every prediction (None: uncalibrated); fitted right after τ, which it calibrates
        self.temperature_scaling: TemperatureScaling | None = None
        # first, so that every other train-end callback sees what the steps after training chose
        self.callback_handler.callbacks.insert(0, AfterTraining(self.before_training, self.after_training))
        self._init_checkpointing()
        self._finite_guard = NonFiniteGuard()

    def _build_method(self) -> None:
        """`self.method` from `args.method_config`, at construction and again for each hyperparameter-search trial
        (whose settings the arguments then hold): a fresh method, its extra heads attached to the model (they must
        exist before the optimizer is built) and its callbacks in place of the previous method's."""
        for callback in self._method_callbacks:
            self.callback_handler.remove_callback(callback)
        self.method: TrainingMethod = get_method_class(self.args.method)(self.args.method_config,
                                                                         num_train_examples=self._train_size)
        # set up by `accelerate launch`, not by the arguments
        fsdp = getattr(self.accelerator.state, "fsdp_plugin", None)
        self.method.check_parallelism(getattr(fsdp, "fsdp_version", 1) if fsdp is not None else None,
                                      self.is_deepspeed_enabled)
        keep_presharded_model(fsdp, self.model)
        if self.model is not None:
            self.method.attach(self.model)
        run = CallbackContext(measure_label_noise=self.probe_label_noise, seed=self.args.eval_seed,
                              optimizer=lambda: self.optimizer)
        self._method_callbacks = [*self.method.callbacks(run), StalledLossCallback(self.method)]
        for callback in self._method_callbacks:  # `add_callback` binds these
            self.add_callback(callback)

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        # where `Trainer.train` calls `Accelerator.prepare`, whose FSDP2 path fails on HF's ViT, BERT and ResNet
        with shardable_by_accelerate(self.accelerator, self.model):
            return super()._prepare_for_training(*args, **kwargs)

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """`Trainer.call_model_init`, refusing a model this trainer cannot train (multi-label, regression)."""
        model = super().call_model_init(trial)
        check_single_label_model(model)
        return model

    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        """`Trainer.add_callback`, connecting a `LabelNoiseCallback` to this trainer's posterior and batches."""
        super().add_callback(callback)
        self._connect(self.callback_handler.callbacks[-1])

    def _connect(self, callback: TrainerCallback) -> None:
        if isinstance(callback, LabelNoiseCallback):
            check_labels("the dataset of LabelNoiseCallback", callback.dataset, model_num_labels(self.model))
            callback.connect(measure=self.label_noise, predictor=self.posterior_predictor,
                             record_output=self.record_output, train_dataset=lambda: self.train_dataset)

    # -- optimizer ---------------------------------------------------------------------------------
    @property
    def ivon(self) -> VariationalIVON | None:
        """The IVON optimizer behind accelerate's wrapper, or None before training / for non-IVON methods."""
        return unwrap_ivon(self.optimizer)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The method's optimizer (IVON for IVON methods, `TrainingMethod.create_optimizer`), else the Trainer's own."""
        if self.optimizer is not None:
            return self.optimizer
        named = list(self.model.named_parameters())
        names = {id(p): n for n, p in named}
        params = [(names[id(p)], p) for p in (model or self.model).parameters() if p.requires_grad]
        # train() knows the run's length before it builds the optimizer; FSDP2 averages the gradients of the
        # sharded parameters itself, and all ranks draw one sample (IVON's sync off)
        run = OptimizerContext(total_steps=self.state.max_steps or None, seed=self.args.seed,
                               rank=self.args.process_index, learning_rate=self.args.learning_rate,
                               sync=self.args.world_size > 1 and not self.is_fsdp_enabled)
        self.optimizer = self.method.create_optimizer(params, run)
        if self.optimizer is None:
            return super().create_optimizer(model)
        self.method.use_optimizer(self.optimizer, named, new=True)
        return self.optimizer

    # -- training ----------------------------------------------------------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The method's mean loss on this micro-batch (`TrainingMethod.compute_loss`); `num_items_in_batch` is ignored
        on purpose (IVON averages).

        A `compute_loss_func` given to the trainer replaces the cross-entropy: it is called as the stock Trainer calls
        it, `compute_loss_func(outputs, labels, num_items_in_batch)`, with the labelled examples of this micro-batch as
        `num_items_in_batch`, so that HF's `sum / num_items_in_batch` is the mean over this micro-batch (the loss IVON
        needs per posterior sample; the Trainer divides it by the accumulation steps for other methods).
        """
        loss, outputs = self.method.compute_loss(model, inputs, self.method_context(model))
        return (loss, outputs) if return_outputs else loss

    def method_context(self, model: torch.nn.Module, **kwargs: Any) -> MethodContext:
        """What `self.method` may know of the run at this micro-batch (it never sees the trainer itself)."""
        return MethodContext(step=self.state.global_step, epoch=float(self.state.epoch or 0.0),
                             is_training=model.training,
                             accelerator=self.accelerator, loss_func=self.compute_loss_func, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        with name_inputs_the_model_cannot_take(inputs, self.accelerator.unwrap_model(model),
                                               self.state.global_step == 0):
            loss = self._method_training_step(model, inputs, num_items_in_batch)
        self._stop_if_non_finite()
        return loss

    def _method_training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                              num_items_in_batch: Any) -> torch.Tensor:
        if type(self.method).training_step is TrainingMethod.training_step:
            loss = super().training_step(model, inputs, num_items_in_batch)
            # the gradients are complete (accumulated, all-reduced) only on the step's last micro-batch
            self._note_finite(loss,
                              [p for p in model.parameters() if p.requires_grad] if self.accelerator.sync_gradients
                              else None)
            return loss
        # the method schedules its own passes: IVON's posterior samples, SAM's two
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimizers (as the stock step)
            self.optimizer.train()
        ddp = self.args.world_size > 1 and not self.is_fsdp_enabled
        context = self.method_context(
            model, num_items_in_batch=num_items_in_batch,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            loss_context=self.compute_loss_context_manager, optimizer=self.optimizer,
            sharded=self.is_fsdp_enabled, **({"no_sync": self.accelerator.no_sync} if ddp else {}),
            max_grad_norm=self.args.max_grad_norm or 0.0, gradients_complete=self.accelerator.sync_gradients,
            note_finite=self._note_finite,
            **({"loss_override": self.compute_loss} if self._overrides_compute_loss() else {}))
        return self.method.training_step(model, self._prepare_inputs(inputs), context)

    def _overrides_compute_loss(self) -> bool:
        return type(self).compute_loss is not VariationalTrainer.compute_loss

    def _note_finite(self, loss: torch.Tensor, params: list[torch.Tensor] | None) -> None:
        # with fp16's gradient scaler, inf gradients are expected: the scaler skips those steps itself
        self._finite_guard.note(loss, params, self.model.buffers(), check_gradients=self.accelerator.scaler is None)

    def _stop_if_non_finite(self) -> None:
        """On the last micro-batch of an optimizer step, before the step: raise if a loss, gradient or buffer of the
        step was NaN or inf (`varsmooth.trainer.finite`); the update is then not applied."""
        verdict = (self._finite_guard.verdict(self.args.device, self.args.world_size > 1)
                   if self.accelerator.sync_gradients else None)
        if verdict is None or all(verdict):
            return
        self.method.discard_step(self.optimizer)
        bad = [] if verdict[2] else non_finite_tensors(self.accelerator.unwrap_model(self.model).named_buffers())
        raise non_finite_step_error(verdict, self.state.global_step + 1, self.args.method,
                                    self.method.step_settings, bad)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = super()._prepare_inputs(inputs)
        # every loss, metric and selection reads the labels under "labels": `label_names=[name]` renames them
        name = (self.args.label_names or ["labels"])[0]
        if name != "labels" and name in inputs:
            inputs = {**{k: v for k, v in inputs.items() if k != name}, "labels": inputs[name]}
        return inputs

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> Any:
        if is_training and self.method.needs_example_index:  # per-example method state, keyed by row position
            dataset = ExampleIndexDataset(dataset)
        return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)

    def _set_signature_columns_if_needed(self) -> None:
        # a model whose forward takes **inputs (a `DeepEnsemble`) names the inputs its networks take
        input_names = getattr(self.accelerator.unwrap_model(self.model), "input_names", None)
        if self._signature_columns is None and input_names is not None:
            self._signature_columns = [*input_names, "label", "label_ids", *self.label_names]
        super()._set_signature_columns_if_needed()
        if self.method.needs_example_index and EXAMPLE_INDEX_KEY not in self._signature_columns:
            self._signature_columns.append(EXAMPLE_INDEX_KEY)  # or the column removal would drop the index

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self.method.clips_inside_step:
            return self.method.last_grad_norm
        return super()._clip_grad_norm(model)

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        # a `with_transform` dataset reads its raw columns (e.g. "image") when an item is fetched: removing them
        # would break the transform, and its output is already what the model takes
        if isinstance(dataset, datasets.Dataset) and dataset.format.get("type") == "custom":
            return dataset
        return super()._remove_unused_columns(dataset, description)

    # -- prediction --------------------------------------------------------------------------------
    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple:
        """Returns (NLL of the BMA prediction, (log P̂, posterior-mean logits), labels)."""
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        # a point-mass posterior (no IVON state, none loaded) predicts at the weights
        out = self.predictive(model, inputs, self._eval_predictor)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.nll_loss(out.logits, labels)
        if prediction_loss_only:
            return loss, None, None
        return loss, (out.logits, out.mean_logits), labels

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # one prediction for the whole evaluation (while training, of the posterior of this moment)
        posterior_predictor = self.posterior_predictor()
        self._eval_predictor = predictor = make_predictor(self.accelerator.unwrap_model(self.model),
                                                          posterior_predictor, self.args.mc_dropout_samples)
        learns, bma = self.method.learns_posterior, self.args.eval_mc_samples > 0
        at_mean_only = learns and bma and posterior_predictor.posterior.is_point_mass
        if at_mean_only:
            logger.warning(
                "eval_mc_samples=%d asks for Bayesian model averaging, but there is no posterior: this trainer has not "
                "trained and got none (pass posterior=, or load the model from the folder holding its %s). "
                "Predicting at the weights; the metrics are reported as mean_* (e.g. eval_mean_accuracy).",
                self.args.eval_mc_samples, POSTERIOR_FILE,
            )
        # what was computed: 0 samples averaged = a prediction at the posterior mean
        describe = predictor.evaluation_entries() if learns else None
        self._metrics.start(at_mean_only=at_mean_only, with_mean=learns and bma, describe=describe)
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            del self._eval_predictor

    @property
    def reliability_diagram(self) -> dict[str, np.ndarray] | None:
        """Per-bin confidence/accuracy/count of the last evaluation (`varsmooth.metrics.reliability_diagram`)."""
        return self._metrics.reliability_diagram

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """As `Trainer.predict`; `predictions` are log P̂ (the log of the posterior-averaged probabilities; at τ = 0
        those of the posterior mean), or what `preprocess_logits_for_metrics` made of them."""
        output = super().predict(test_dataset, ignore_keys, metric_key_prefix)
        predictions = (self._metrics.user_predictions(output.predictions)
                       if isinstance(output.predictions, (tuple, list))
                       else output.predictions)
        return PredictionOutput(predictions=predictions, label_ids=output.label_ids, metrics=output.metrics)

    def train_noise_report(self) -> Any:
        """The label corruption of the training set: the report given at construction, else the realized one
        recomputed from a `clean_label` column over its ClassLabel's classes, else the model's (None when the labels
        are the dataset's own)."""
        if self._noise_report is not None:
            return self._noise_report
        return realized_noise_report(self.train_dataset, model_num_labels(self.model))

    def hessian_summary(self) -> dict[str, float]:
        """What the method reports of its state beside the loss (`TrainingMethod.training_log`): for IVON, the
        mean/median of its Hessian h and of the posterior std σ (`varsmooth.posterior.diagnostics`)."""
        return self.method.training_log(self.optimizer)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`; a training log (one with a "loss") also shows whether the posterior learns: the Hessian
        summary (`hessian_summary`), in the history and in what the reporting callbacks get."""
        if "loss" in logs:
            logs = {**logs, **self.hessian_summary()}
        super().log(logs, start_time)

