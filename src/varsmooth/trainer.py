"""`VariationalTrainer`: `transformers.Trainer` that trains with IVON and predicts by Bayesian model averaging.

What differs from the stock Trainer, and why (each item avoids a pitfall of a naive IVON subclass):

* optimizer: `VariationalIVON` over the trainable parameters only, with IVON's own weight decay (the prior
  precision) instead of the Trainer's two decay groups;
* `training_step`: every MC sample of every micro-batch runs forward *and* backward inside one
  weight-sampling context, with the gradients zeroed first and the micro-batch *mean* loss (no division by
  the accumulation count: IVON averages its samples itself); gradient-norm clipping happens inside the
  sample, since IVON has consumed the gradients before the Trainer would clip; under DDP the gradient
  all-reduce is off and IVON all-reduces its averages in `step()`: IVON's Hessian estimate ε⊙g is unbiased only
  when g was computed at the same ε, and DDP's all-reduce would average g over the other ranks' draws;
* `prediction_step`: BMA over `eval_mc_samples` posterior samples, plus the posterior-mean prediction;
* `_save`: writes the posterior (σ per parameter) next to the weights, in checkpoints and final saves, removes
  the varsmooth files of earlier runs it did not write, and writes the folder's manifest last (`varsmooth.files`);
* `_save_checkpoint`: a `checkpoint-N` appears (by one rename) only once complete (`varsmooth.files`);
* resuming without optimizer state restores IVON's Hessian and step from the checkpoint's posterior
  (`varsmooth.posterior.resume`).

The trainer's other jobs live beside it: the model card and Hub pushes in `varsmooth.hub` (`VariationalHubMixin`),
`label_noise()` in `varsmooth.label_noise` (`LabelNoiseMixin`), the training set's `NoiseReport` in
`varsmooth.corruption`, and the Hessian diagnostics in `varsmooth.posterior.diagnostics` (a callback it adds).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalPrediction, PredictionOutput
from transformers.training_args import ParallelMode

from .adapters import is_peft_model, save_classifier_config
from .calibration import TemperatureScaling, TemperatureScalingCallback, describe_prediction, fit_on_batches
from .corruption import realized_noise_report
from .ensemble import DeepEnsemble
from .files import (METHOD_STATE_FILE, STAGING_PREFIX, FolderSave, atomic_path, check_manifest, clear_leftover_stagings,
                    has_optimizer_state, publish_checkpoint, rotate_checkpoints)
from .finite import NonFiniteGuard, non_finite_step_error
from .methods import (EXAMPLE_INDEX_KEY, ExampleIndexDataset, MethodContext, OptimizerContext, TrainingMethod, get_method_class,
                      learns_posterior)
from .hub import VariationalHubMixin
from .label_noise import LabelNoiseCallback, LabelNoiseMixin
from .metrics import classification_metrics, reliability_diagram
from .posterior import (POSTERIOR_FILE, DiagonalGaussianPosterior, VariationalClassifierOutput, VariationalIVON,
                        mc_dropout_predictive, predictive_distribution, unwrap_ivon)
from .posterior.diagnostics import HessianDiagnosticsCallback, hessian_summary
from .posterior.gaussian import TEMPERATURE_KEY, non_finite_tensors
from .posterior.resume import load_ivon_state
from .posterior.temperature import (SELECTION_SAMPLES, PosteriorTemperatureCallback, check_transition_matrix,
                                    select_temperature, temperature_logs)
from .training_args import VariationalTrainingArguments
from .utils import length_order

__all__ = ["VariationalTrainer"]

logger = logging.getLogger(__name__)


class VariationalTrainer(VariationalHubMixin, LabelNoiseMixin, Trainer):
    """A `Trainer` for single-label classifiers that trains with `args.method` (IVON by default).

    Models may be any module returning logits in a `ModelOutput` or tuple (HF `AutoModelFor*Classification`,
    timm through `example_utils.models.create_image_classifier` in the examples, ...); the loss is computed here from the logits.

    Private `Trainer` hooks it overrides, and what would not work without each:

    * `_save`: the only step every save (final, checkpoint, FSDP's gathered state dict) takes on the writing process:
      non-finite weights are refused and the posterior, temperature, noise report and manifest written there;
    * `_save_checkpoint`: a checkpoint (with the method's state) appears by one rename once complete, then is pushed
      and rotated (`varsmooth.files`); without it a kill can leave a half checkpoint that resume picks up;
    * `_get_output_dir`: the stock `_save_checkpoint` writes where it says, so this sends it into the staging folder;
    * `_load_from_checkpoint`: checks the checkpoint against its manifest before any weight is read; without it a
      truncated file fails inside safetensors or torch.load instead of being named;
    * `_load_optimizer_and_scheduler`: the stock one skips the optimizer without a scheduler.pt, restarting IVON's
      Hessian and step silently (here they come from optimizer.pt or the posterior); also loads the method's state;
    * `_load_best_model`: the stock one reloads only the weights; the saved posterior would pair them with the last
      step's σ;
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

    def __init__(self, model: Any = None, args: VariationalTrainingArguments | None = None, *pargs: Any, **kwargs: Any) -> None:
        if args is None:
            args = VariationalTrainingArguments(output_dir="trainer_output")
        if not isinstance(args, VariationalTrainingArguments):
            raise TypeError(
                f"VariationalTrainer needs VariationalTrainingArguments, got {type(args).__name__}. "
                "Build them with VariationalTrainingArguments(...) (same fields as TrainingArguments plus IVON's)."
            )
        if args.label_smoothing_factor:
            raise ValueError(
                "label_smoothing_factor is not used by VariationalTrainer: choose method='ls' with "
                "method_config={'smoothing': ...} instead, so that the method is recorded and compared fairly."
            )
        _refuse_undistributed_process_group(args)
        user_metrics = kwargs.pop("compute_metrics", None)
        self._noise_report = kwargs.pop("noise_report", None)
        eval_noise_transition = kwargs.pop("eval_noise_transition", None)
        posterior = kwargs.pop("posterior", None)
        if args.batch_eval_metrics and user_metrics is not None and "compute_result" not in inspect.signature(user_metrics).parameters:
            raise ValueError(  # the stock Trainer's check, which would only see the wrapper below
                "With batch_eval_metrics=True, compute_metrics must take a boolean `compute_result` argument (True on the "
                "last batch: return the metrics of the whole evaluation then)."
            )
        super().__init__(model, args, *pargs, compute_metrics=self._compute_metrics, **kwargs)
        self.user_compute_metrics = user_metrics
        train_size = _length(self.train_dataset)
        if train_size == 0:
            raise ValueError("train_dataset has no examples: nothing to train on. Pass the training split with its "
                             "examples (check the select/filter/split that built it), or train_dataset=None to only evaluate.")
        for role, dataset in (("train_dataset", self.train_dataset), ("eval_dataset", self.eval_dataset)):
            _refuse_string_labels(role, dataset)
        self.method: TrainingMethod = get_method_class(args.method)(args.method_config, num_train_examples=train_size)
        fsdp = getattr(self.accelerator.state, "fsdp_plugin", None)  # set up by `accelerate launch`, not by the arguments
        self.method.check_parallelism(getattr(fsdp, "fsdp_version", 1) if fsdp is not None else None, self.is_deepspeed_enabled)
        if self.compute_loss_func is not None and type(self.method).loss is not TrainingMethod.loss:
            raise ValueError(
                f"compute_loss_func would replace the training loss of method={args.method!r}, which is the method "
                "itself. Use it with method='ivon', 'ivon_fixed_hessian', 'erm' or 'sam' (cross-entropy by default), "
                "or drop compute_loss_func."
            )
        if posterior is not None and not learns_posterior(self.method):
            raise ValueError(f"posterior= is for IVON methods (BMA over the posterior); method={args.method!r} predicts at the weights.")
        self._saved_posterior = posterior if posterior is not None else self._posterior_beside_model()
        if self.model is not None:  # extra heads must exist before the optimizer is built
            self.method.attach(self.model)
        for callback in self.callback_handler.callbacks:  # those passed at construction
            self._connect(callback)
        for callback in self.method.callbacks():  # `add_callback` binds these
            self.add_callback(callback)
        # τ of every prediction; chosen on the eval dataset when training ends, before other train-end callbacks
        self.posterior_temperature = 1.0 if args.posterior_temperature is None else args.posterior_temperature
        self.posterior_temperature_report: dict[str, Any] | None = None
        #: T[i, j] = P(observed j | true i) of the eval dataset's labels, when known (e.g. the noise the example
        #: injected): τ is then chosen by the forward-corrected validation NLL (`posterior.temperature`)
        self.eval_noise_transition = None if eval_noise_transition is None else check_transition_matrix(eval_noise_transition)
        #: per-bin confidence/accuracy/count of the last evaluation (`varsmooth.metrics.reliability_diagram`)
        self.reliability_diagram: dict[str, np.ndarray] | None = None
        self.callback_handler.callbacks.insert(0, PosteriorTemperatureCallback(
            select=self.select_posterior_temperature, reset=self._reset_posterior_temperature, save=self.save_model))
        # post-hoc temperature of every prediction (None: uncalibrated); fitted right after τ, which it calibrates
        self.temperature_scaling: TemperatureScaling | None = None
        self.callback_handler.callbacks.insert(1, TemperatureScalingCallback(
            fit=self.fit_temperature_scaling, reset=lambda: setattr(self, "temperature_scaling", None),
            has_eval_dataset=lambda: self.eval_dataset is not None))
        # before the reporting callbacks, which then report the Hessian summary it adds to the training logs
        self.callback_handler.callbacks.insert(2, HessianDiagnosticsCallback())
        self._ivon_param_names: list[str] | None = None
        self._run_files: dict[str, set[str]] = {}  # folder -> files this trainer wrote there outside `_save`
        self._staging_dir: str | None = None
        self._finite_guard = NonFiniteGuard()
        self._gathered_posterior: DiagonalGaussianPosterior | None = None  # σ gathered by save_model under FSDP
        if learns_posterior(self.method) and self.optimizer is not None and not isinstance(self.optimizer, VariationalIVON):
            raise ValueError(
                f"method={args.method!r} trains with IVON, which the trainer builds itself; got a "
                f"{type(self.optimizer).__name__} in `optimizers`. Drop `optimizers=` (or pass a varsmooth.VariationalIVON)."
            )

    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        """`Trainer.add_callback`, connecting a `LabelNoiseCallback` to this trainer's posterior and batches."""
        super().add_callback(callback)
        self._connect(self.callback_handler.callbacks[-1])

    def _connect(self, callback: TrainerCallback) -> None:
        if isinstance(callback, LabelNoiseCallback):
            callback.connect(measure=self.label_noise, posterior=self.posterior, record_output=self.record_output,
                             train_dataset=lambda: self.train_dataset)

    # -- optimizer ---------------------------------------------------------------------------------
    @property
    def ivon(self) -> VariationalIVON | None:
        """The IVON optimizer behind accelerate's wrapper, or None before training / for non-IVON methods."""
        return unwrap_ivon(self.optimizer) if learns_posterior(self.method) else None

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The method's optimizer (IVON for IVON methods, `TrainingMethod.create_optimizer`), else the Trainer's own."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        if self.optimizer is None:
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            # train() knows the run's length before it builds the optimizer; FSDP2 averages the gradients of the
            # sharded parameters itself, and all ranks draw one sample (IVON's sync off)
            run = OptimizerContext(total_steps=self.state.max_steps or None, seed=self.args.seed,
                                   rank=self.args.process_index, fused=self.args.ivon_fused,
                                   sync=self.args.world_size > 1 and not self.is_fsdp_enabled)
            self.optimizer = self.method.create_optimizer(params, run)
            if self.optimizer is None:
                return super().create_optimizer(model)
            self._ivon_param_names = [names[id(p)] for p in params]
        elif self.ivon is not None and self._ivon_param_names is None:  # an IVON passed in `optimizers`
            self._ivon_param_names = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        return self.optimizer

    def posterior(self) -> DiagonalGaussianPosterior:
        """The current q = N(m, diag σ²): IVON's once it trains; before that the posterior passed as `posterior=` or
        saved beside the model (`posterior.safetensors` in its `name_or_path` folder); else a point mass."""
        opt = self.ivon
        model = self.accelerator.unwrap_model(self.model)
        if opt is None:
            return self._saved_posterior if self._saved_posterior is not None else DiagonalGaussianPosterior.point_mass(model)
        meta = {**self.method.hyperparameters(), "eval_seed": self.args.eval_seed, "step": opt.current_step,
                TEMPERATURE_KEY: self.posterior_temperature}
        if self.posterior_temperature_report is not None:
            meta["posterior_temperature_selection"] = self.posterior_temperature_report
        return DiagonalGaussianPosterior.from_ivon(model, opt, self._ivon_param_names, meta)

    def _posterior_beside_model(self) -> DiagonalGaussianPosterior | None:
        """The posterior an IVON run saved next to the weights this trainer's model was loaded from, if any."""
        folder = getattr(self.model, "name_or_path", None) or ""
        if not learns_posterior(self.method) or not os.path.isfile(os.path.join(folder, POSTERIOR_FILE)):
            return None
        try:
            posterior = DiagonalGaussianPosterior.load(self.model, folder)
        except ValueError as error:  # e.g. a new classification head: the saved σ belongs to another network
            logger.warning("Not using %s from %s: %s", POSTERIOR_FILE, folder, error)
            return None
        logger.info("Loaded the posterior saved with the model (%s): evaluation before training predicts by BMA with it.",
                    os.path.join(folder, POSTERIOR_FILE))
        return posterior

    def select_posterior_temperature(self, eval_dataset: Any = None) -> dict[str, Any] | None:
        """Choose the posterior temperature τ by validation NLL and predict with it from now on (done by `train()`
        when `args.posterior_temperature` is None); returns the NLL at each τ tried, or None without validation data.
        See `varsmooth.posterior.temperature`."""
        if self.ivon is None or self.args.eval_mc_samples <= 0:  # no posterior, or a prediction at the mean already
            return None
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if eval_dataset is None:  # not the training set: every example was fitted, it cannot tell which generalizes
            logger.info("No eval_dataset: predicting with the learned posterior (posterior temperature 1). Pass an "
                        "eval_dataset (a validation split) to choose the temperature by validation NLL, or set "
                        "posterior_temperature.")
            return None
        report = select_temperature(self.model, self.posterior(), lambda: self.validation_batches(eval_dataset),
                                    min(self.args.eval_mc_samples, SELECTION_SAMPLES), self.args.eval_seed,
                                    gather=self.accelerator.gather_for_metrics, transition=self.eval_noise_transition)
        self.posterior_temperature, self.posterior_temperature_report = report["temperature"], report
        self.log(temperature_logs(report))
        return report

    def _reset_posterior_temperature(self) -> None:
        """A new train() starts again from the learned posterior (or the fixed τ)."""
        self.posterior_temperature = 1.0 if self.args.posterior_temperature is None else self.args.posterior_temperature
        self.posterior_temperature_report = None

    def validation_batches(self, eval_dataset: Any) -> Iterator[dict[str, Any]]:
        """The prepared batches of `eval_dataset` (a dataset or a dict of them, pooled), batched as evaluate() batches
        them; tokenized sentences by length (each batch pads to its longest, and the scores on them are means over rows)."""
        named = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
        for dataset in named.values():
            order = length_order(dataset)
            loader = (self.get_eval_dataloader(dataset) if order is None else
                      self._get_dataloader(dataset, "Validation", self.args.eval_batch_size, sampler_fn=lambda _, order=order: order))
            for batch in loader:
                yield self._prepare_inputs(batch)

    def fit_temperature_scaling(self, eval_dataset: Any = None) -> TemperatureScaling:
        """Fit the post-hoc temperature T on `eval_dataset` (default: the eval datasets) by NLL and predict with it from
        now on; done when training ends with `args.temperature_scaling`. `trainer.temperature_scaling = None` goes back
        to the uncalibrated prediction. See `varsmooth.calibration`. Every process must call this."""
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        self.model.eval()
        posterior = self.posterior()
        scaling = fit_on_batches(functools.partial(self.predictive, self.model, posterior=posterior, calibrated=False),
                                 None if eval_dataset is None else self.validation_batches(eval_dataset),
                                 self.prediction_settings(posterior), self.accelerator.gather_for_metrics,
                                 self.accelerator.unwrap_model(self.model))
        self.temperature_scaling = scaling
        self.log({"temperature_scaling": scaling.temperature, "eval_nll_uncalibrated": scaling.nll_uncalibrated,
                  "eval_nll_calibrated": scaling.nll_calibrated})
        return scaling

    def predictive(self, model: torch.nn.Module, inputs: dict[str, Any], posterior: DiagonalGaussianPosterior | None = None,
                   calibrated: bool = True) -> VariationalClassifierOutput:
        """The prediction `evaluate()`/`predict()` score on one prepared batch: a `DeepEnsemble` model's pooled
        prediction, MC dropout (`args.mc_dropout_samples`), or BMA over `posterior` (default: `self.posterior()`; a
        point mass predicts at the weights); then the temperature scaling, if fitted and `calibrated`."""
        if isinstance(self.accelerator.unwrap_model(model), DeepEnsemble):
            out = model(**inputs)
        elif self.args.mc_dropout_samples:
            out = mc_dropout_predictive(model, inputs, self.args.mc_dropout_samples, self.args.eval_seed)
        else:
            posterior = self.posterior() if posterior is None else posterior
            out = predictive_distribution(model, posterior, inputs, self.args.eval_mc_samples, self.args.eval_seed)
        return self.temperature_scaling.calibrate(out) if calibrated and self.temperature_scaling is not None else out

    def prediction_settings(self, posterior: DiagonalGaussianPosterior | None = None) -> dict[str, Any]:
        """What `predictive` predicts (recorded with a fitted temperature, compared when the model is loaded)."""
        network = self.accelerator.unwrap_model(self.model)
        if isinstance(network, DeepEnsemble):
            return network.prediction_settings
        posterior = self.posterior() if posterior is None else posterior
        return describe_prediction(posterior, self.args.eval_mc_samples, self.args.mc_dropout_samples)

    # -- training ----------------------------------------------------------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """The method's mean loss on this micro-batch (`TrainingMethod.compute_loss`); `num_items_in_batch` is ignored
        on purpose (IVON averages).

        A `compute_loss_func` given to the trainer replaces the cross-entropy: it is called as the stock Trainer calls
        it, `compute_loss_func(outputs, labels, num_items_in_batch=None)`, where None asks for the mean over this
        micro-batch (the loss IVON needs per posterior sample; the Trainer divides it by the accumulation steps for
        other methods).
        """
        loss, outputs = self.method.compute_loss(model, inputs, self.method_context(model))
        return (loss, outputs) if return_outputs else loss

    def method_context(self, model: torch.nn.Module, **kwargs: Any) -> MethodContext:
        """What `self.method` may know of the run at this micro-batch (it never sees the trainer itself)."""
        return MethodContext(step=self.state.global_step, epoch=float(self.state.epoch or 0.0), is_training=model.training,
                             accelerator=self.accelerator, loss_func=self.compute_loss_func, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if type(self.method).training_step is TrainingMethod.training_step:
            loss = super().training_step(model, inputs, num_items_in_batch)
            # the gradients are complete (accumulated, all-reduced) only on the step's last micro-batch
            self._note_finite(loss, [p for p in model.parameters() if p.requires_grad] if self.accelerator.sync_gradients else None)
        else:  # the method schedules its own passes: IVON's posterior samples, SAM's two
            model.train()
            if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimizers (as the stock step)
                self.optimizer.train()
            ddp = self.args.world_size > 1 and not self.is_fsdp_enabled
            context = self.method_context(
                model, num_items_in_batch=num_items_in_batch, gradient_accumulation_steps=self.current_gradient_accumulation_steps,
                loss_context=self.compute_loss_context_manager, optimizer=unwrap_ivon(self.optimizer) or self.optimizer,
                sharded=self.is_fsdp_enabled, **({"no_sync": self.accelerator.no_sync} if ddp else {}),
                max_grad_norm=self.args.max_grad_norm or 0.0, gradients_complete=self.accelerator.sync_gradients,
                note_finite=self._note_finite, **({"loss_override": self.compute_loss} if self._overrides_compute_loss() else {}))
            loss = self.method.training_step(model, self._prepare_inputs(inputs), context)
        self._stop_if_non_finite()
        return loss

    def _overrides_compute_loss(self) -> bool:
        return type(self).compute_loss is not VariationalTrainer.compute_loss

    def _note_finite(self, loss: torch.Tensor, params: list[torch.Tensor] | None) -> None:
        # with fp16's gradient scaler, inf gradients are expected: the scaler skips those steps itself
        self._finite_guard.note(loss, params, self.model.buffers(), check_gradients=self.accelerator.scaler is None)

    def _stop_if_non_finite(self) -> None:
        """On the last micro-batch of an optimizer step, before the step: raise if a loss, gradient or buffer of the
        step was NaN or inf (`varsmooth.finite`); the update is then not applied."""
        verdict = self._finite_guard.verdict(self.args.device, self.args.world_size > 1) if self.accelerator.sync_gradients else None
        if verdict is None or all(verdict):
            return
        if self.ivon is not None:
            self.ivon._reset_samples()  # the step's samples are dropped: IVON stays at the last finite step
        bad = [] if verdict[2] else non_finite_tensors(self.accelerator.unwrap_model(self.model).named_buffers())
        raise non_finite_step_error(verdict, self.state.global_step + 1, self.args.method, self.ivon is not None, bad)

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> Any:
        if is_training and self.method.needs_example_index:  # per-example method state, keyed by row position
            dataset = ExampleIndexDataset(dataset)
        return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)

    def _set_signature_columns_if_needed(self) -> None:
        network = self.accelerator.unwrap_model(self.model)
        if self._signature_columns is None and isinstance(network, DeepEnsemble):  # forward(**inputs): ask a member
            member = network.members[0].model
            member = member.get_base_model() if is_peft_model(member) else member
            self._signature_columns = [*inspect.signature(member.forward).parameters, "label", "label_ids", *self.label_names]
        super()._set_signature_columns_if_needed()
        if self.method.needs_example_index and EXAMPLE_INDEX_KEY not in self._signature_columns:
            self._signature_columns.append(EXAMPLE_INDEX_KEY)  # or the column removal would drop the index

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if learns_posterior(self.method):  # already clipped inside each sample; clipping now would not reach IVON
            return self.method.last_grad_norm
        return super()._clip_grad_norm(model)

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        # a `with_transform` dataset reads its raw columns (e.g. "image") when an item is fetched: removing them
        # would break the transform, and its output is already what the model takes
        if isinstance(dataset, datasets.Dataset) and dataset.format.get("type") == "custom":
            return dataset
        return super()._remove_unused_columns(dataset, description)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # every file against the checkpoint's manifest before any is read: a truncated model.safetensors or
        # optimizer.pt is named, instead of failing inside safetensors or torch.load
        check_manifest(resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        # the stock version reloads only the weights: the Hessian must come from the same checkpoint, or the
        # saved and evaluated posterior would pair the best mean with the last step's variances
        if self.state.best_model_checkpoint:
            check_manifest(self.state.best_model_checkpoint)
        super()._load_best_model()
        if self.ivon is not None and self.state.best_model_checkpoint:
            self._load_ivon_state(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        # the stock Trainer loads the optimizer only together with the scheduler, and silently starts afresh without
        # them: IVON would restart its Hessian and step count
        if checkpoint is not None and self.ivon is not None and not (
                has_optimizer_state(checkpoint) and os.path.isfile(os.path.join(checkpoint, "scheduler.pt"))):
            if self._load_ivon_state(checkpoint) == POSTERIOR_FILE:
                logger.warning("%s has no optimizer state (save_only_model=True?): IVON's Hessian and step count were "
                               "restored from its %s; the gradient momentum restarts at zero and the learning-rate "
                               "schedule from its start.", checkpoint, POSTERIOR_FILE)
            else:
                logger.warning("%s has no scheduler.pt: IVON's state was restored, the learning-rate schedule restarts.", checkpoint)
        if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, METHOD_STATE_FILE)):
            state = torch.load(os.path.join(checkpoint, METHOD_STATE_FILE), map_location="cpu", weights_only=True)
            self.method.load_state_dict(state)

    def _load_ivon_state(self, checkpoint: str) -> str:
        """IVON's state from `checkpoint` (without optimizer.pt, from the posterior saved there for the weights just
        loaded from it); returns the file it came from (`varsmooth.posterior.resume`)."""
        return load_ivon_state(self.ivon, self.accelerator.unwrap_model(self.model), checkpoint, self._ivon_param_names,
                               self.state.global_step)

    # -- prediction --------------------------------------------------------------------------------
    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None) -> tuple:
        """Returns (NLL of the BMA prediction, (log P̂, posterior-mean logits), labels)."""
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        # a point-mass posterior (no IVON state, none loaded) predicts at the weights
        out = self.predictive(model, inputs, self._eval_posterior)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.nll_loss(out.logits, labels)
        if prediction_loss_only:
            return loss, None, None
        return loss, (out.logits, out.mean_logits), labels

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # the posterior is built once per evaluation, from the IVON state of this moment
        self._eval_posterior = self.posterior()
        self._metric_batches: list[tuple[np.ndarray, ...]] = []
        if self._bma_without_posterior():
            logger.warning(
                "eval_mc_samples=%d asks for Bayesian model averaging, but there is no posterior: this trainer has not "
                "trained and got none (pass posterior=, or load the model from the folder holding its %s). "
                "Predicting at the weights; the metrics are reported as mean_* (e.g. eval_mean_accuracy).",
                self.args.eval_mc_samples, POSTERIOR_FILE,
            )
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            del self._eval_posterior

    def _bma_without_posterior(self) -> bool:
        return learns_posterior(self.method) and self.args.eval_mc_samples > 0 and self._eval_posterior.is_point_mass

    def _compute_metrics(self, eval_pred: EvalPrediction, compute_result: bool | None = None) -> dict[str, float]:
        """Metrics of the BMA prediction (and mean_* of the posterior mean), then the user's `compute_metrics`, which
        gets log P̂ as predictions, with inputs and losses passed through as the stock Trainer does.

        With `batch_eval_metrics` the Trainer calls this once per batch (`compute_result` True on the last): the user's
        function sees every call; varsmooth's metrics keep the batches' probabilities (N·K numbers) until the last.
        """
        log_probs, mean_logits = eval_pred.predictions
        user_pred = EvalPrediction(predictions=log_probs, label_ids=eval_pred.label_ids, inputs=eval_pred.inputs,
                                   losses=eval_pred.losses)
        user_kwargs = {} if compute_result is None else {"compute_result": compute_result}
        user_metrics = self.user_compute_metrics(user_pred, **user_kwargs) if self.user_compute_metrics is not None else None
        if compute_result is None:
            log_probs, mean_logits, labels = (np.asarray(a) for a in (log_probs, mean_logits, eval_pred.label_ids))
        else:
            self._metric_batches.append(tuple(_numpy(a) for a in (log_probs, mean_logits, eval_pred.label_ids)))
            if not compute_result:
                return {}
            log_probs, mean_logits, labels = (np.concatenate(parts) for parts in zip(*self._metric_batches))
            self._metric_batches = []
        mean_probs = torch.as_tensor(mean_logits).float().softmax(-1).numpy()
        # the bins of the prediction just scored, for the card's reliability diagram (`write_reliability_diagram`)
        self.reliability_diagram = reliability_diagram(mean_probs if self._bma_without_posterior() else np.exp(log_probs), labels)
        if self._bma_without_posterior():  # no posterior: name the metrics after the prediction they measure
            metrics = {f"mean_{k}": v for k, v in classification_metrics(mean_probs, labels).items()}
        else:
            metrics = classification_metrics(np.exp(log_probs), labels)
            if learns_posterior(self.method) and self.args.eval_mc_samples > 0:
                metrics.update({f"mean_{k}": v for k, v in classification_metrics(mean_probs, labels).items()})
        if learns_posterior(self.method) and not isinstance(self.accelerator.unwrap_model(self.model), DeepEnsemble):
            # what was computed: 0 samples averaged = a prediction at the posterior mean
            posterior = self._eval_posterior
            averaged = 0 if posterior.is_point_mass or posterior.temperature == 0 else self.args.eval_mc_samples
            metrics.update(posterior_temperature=posterior.temperature, posterior_samples_averaged=averaged)
        metrics.update(user_metrics or {})
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test") -> PredictionOutput:
        """As `Trainer.predict`; `predictions` are log P̂ (the log of the posterior-averaged probabilities; at τ = 0 those
        of the posterior mean)."""
        output = super().predict(test_dataset, ignore_keys, metric_key_prefix)
        predictions = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        return PredictionOutput(predictions=predictions, label_ids=output.label_ids, metrics=output.metrics)

    # -- saving ------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # under FSDP σ and the weights are sharded: every process gathers them here, since the stock save_model
        # may leave the writing (`_save`) to the main process alone
        self._gathered_posterior = self.posterior().gathered() if self.is_fsdp_enabled and self.ivon is not None else None
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._gathered_posterior = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            network = self.accelerator.unwrap_model(self.model)
            bad = non_finite_tensors(state_dict.items() if state_dict is not None else
                                     [*network.named_parameters(), *network.named_buffers()])
            if bad:
                raise FloatingPointError(
                    f"Not saving to {output_dir}: the weights {bad[:5]}{' ...' if len(bad) > 5 else ''} are not finite "
                    "(NaN or inf); nothing was written. Resume from the last checkpoint (or load the last save) instead."
                )
        folder = FolderSave(output_dir).begin() if self.args.should_save else None
        super()._save(output_dir, state_dict)
        if self.args.should_save and is_peft_model(self.accelerator.unwrap_model(self.model)):
            save_classifier_config(self.accelerator.unwrap_model(self.model), output_dir)
        if self.ivon is not None and self.args.should_save:
            (self._gathered_posterior or self.posterior()).save(output_dir)
        if self.temperature_scaling is not None and self.args.should_save:
            self.temperature_scaling.save(output_dir, self.accelerator.unwrap_model(self.model))
        report = self.train_noise_report() if self.args.should_save else None
        if report is not None:
            report.save(output_dir)
        if folder is not None:
            stale = folder.finish(also=self._run_files.get(os.path.abspath(output_dir), ()), method=self.method.name,
                                  global_step=self.state.global_step, seed=self.args.seed)
            if stale:
                logger.warning("Removed files of an earlier run from %s that this run did not write: %s", output_dir, stale)

    def record_output(self, path: str) -> None:
        """Note a file this run wrote next to its saves (label noise, pictures): the next save keeps it and lists it
        in the folder's manifest, so that it is uploaded; files of earlier runs are removed instead."""
        folder, name = os.path.split(os.path.abspath(path))
        self._run_files.setdefault(folder, set()).add(name)

    def _get_output_dir(self, trial: Any) -> str:
        # while a checkpoint is being written, the stock `_save_checkpoint` writes into the staging folder
        return self._staging_dir if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The stock checkpoint and the method's state, written into `.partial-checkpoint-N/` and renamed to
        `checkpoint-N` when complete: a kill leaves either the whole checkpoint or none (`varsmooth.files`)."""
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, final = os.path.join(run_dir, STAGING_PREFIX + name), os.path.join(run_dir, name)
        if self.args.should_save:
            clear_leftover_stagings(run_dir)
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        written = os.path.join(staging, name)
        if not self.args.save_only_model:  # beside the optimizer state, as the stock checkpoint keeps it
            state = self.method.state_dict()  # on every process: a collective for some methods (OLS)
            if state and self.args.should_save:
                with atomic_path(os.path.join(written, METHOD_STATE_FILE)) as tmp:
                    torch.save(state, tmp)
        self.accelerator.wait_for_everyone()  # every rank's files (rng states) are in
        if not self.args.should_save:
            return
        if self.state.best_model_checkpoint == written:  # the stock code recorded the staging path
            self.state.best_model_checkpoint = final
            self.state.save_to_json(os.path.join(written, "trainer_state.json"))
        publish_checkpoint(staging, final)
        if self.args.push_to_hub:  # the stock push was skipped while the checkpoint was incomplete
            self._push_from_checkpoint(final)
        rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def train_noise_report(self) -> Any:
        """The label corruption of the training set: the report given at construction, else the realized one
        recomputed from a `clean_label` column (None when the labels are the dataset's own)."""
        return self._noise_report if self._noise_report is not None else realized_noise_report(self.train_dataset)

    def hessian_summary(self) -> dict[str, float]:
        """Mean/median of IVON's Hessian h and of the posterior std σ (`varsmooth.posterior.diagnostics`)."""
        return hessian_summary(self.ivon)


def _refuse_undistributed_process_group(args: VariationalTrainingArguments) -> None:
    """Stop a multi-process launch that the Trainer does not run as one DDP job (e.g. `accelerate launch --multi_gpu`
    or `torchrun` on a machine without GPUs and without `use_cpu`): each process would train its own model from its
    own initial weights and all of them would write the same output_dir."""
    mode = args.parallel_mode  # sets up the devices, and with them the process group of a launch
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world_size = torch.distributed.get_world_size()
    if world_size > 1 and mode != ParallelMode.DISTRIBUTED:
        raise RuntimeError(
            f"This process is one of {world_size} in a torch.distributed process group, but the Trainer is not in "
            f"distributed mode (parallel_mode={mode.value}): every process would train its own model and all would "
            "write the same output_dir. On a machine without GPUs pass --use_cpu true (use_cpu=True), which makes the "
            "launch one DDP job over CPU processes (gloo); on GPUs launch one process per visible GPU "
            "(accelerate launch --multi_gpu --num_processes N, or torchrun --nproc_per_node N)."
        )




def _numpy(array: Any) -> np.ndarray:
    return array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)


def _refuse_string_labels(role: str, dataset: Any) -> None:
    """A label column of strings fails deep in the collator ("too many dimensions 'str'"); say so up front. Datasets
    with a transform (`with_transform`) are skipped: the transform may turn the raw strings into class ids."""
    if not isinstance(dataset, datasets.Dataset) or dataset.format.get("type") == "custom":
        return
    for column in ("label", "labels", "label_ids"):
        feature = dataset.features.get(column)
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            raise ValueError(
                f"The {column!r} column of {role} holds strings (e.g. {dataset[0][column]!r}), but the trainer needs "
                f"class ids. Encode it first: {role} = {role}.class_encode_column({column!r}) (its "
                f"features[{column!r}].names then give the model's id2label)."
            )


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None
