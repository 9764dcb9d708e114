"""`VariationalTrainer`: `transformers.Trainer` that trains with IVON and predicts by Bayesian model averaging.

What differs from the stock Trainer, and why (research notes ivon.md §0 and hf.md §0 list the pitfalls):

* optimizer: `VariationalIVON` over the trainable parameters only, with IVON's own weight decay (the prior
  precision) instead of the Trainer's two decay groups;
* `training_step`: every MC sample of every micro-batch runs forward *and* backward inside one
  weight-sampling context, with the gradients zeroed first and the micro-batch *mean* loss (no division by
  the accumulation count: IVON averages its samples itself); gradient-norm clipping happens inside the
  sample, since IVON has consumed the gradients before the Trainer would clip; under DDP the gradient
  all-reduce is off and IVON all-reduces its averages in `step()` (scheme (i) of ivon.md §4.2);
* `prediction_step`: BMA over `eval_mc_samples` posterior samples, plus the posterior-mean prediction;
* `_save`: writes the posterior (σ per parameter) next to the weights, in checkpoints and final saves.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_utils import EvalPrediction, PredictionOutput

from .methods import TrainingMethod, get_method_class
from .metrics import classification_metrics
from .posterior import DiagonalGaussianPosterior, VariationalIVON, predictive_distribution, unwrap_ivon
from .posterior.prediction import LABEL_KEYS
from .training_args import VariationalTrainingArguments
from .utils import atomic_path

__all__ = ["VariationalTrainer"]

logger = logging.getLogger(__name__)

#: the Hessian "has hardly moved" when its median relative change from hess_init is below this
HESSIAN_STUCK_TOLERANCE = 0.01
#: checkpoint file with the training method's own state (OLS soft labels, ALASCA EMAs, ...)
METHOD_STATE_FILE = "method_state.pt"


class VariationalTrainer(Trainer):
    """A `Trainer` for single-label classifiers that trains with `args.method` (IVON by default).

    Models may be any module returning logits in a `ModelOutput` or tuple (HF `AutoModelFor*Classification`,
    timm wrapped in `varsmooth.models.TimmClassifier`, ...); the loss is computed here from the logits.
    """

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
                "label_smoothing_factor is not used by VariationalTrainer: choose method='ls' and set its smoothing "
                "instead, so that the method is recorded and compared fairly."
            )
        user_metrics = kwargs.pop("compute_metrics", None)
        super().__init__(model, args, *pargs, compute_metrics=self._compute_metrics, **kwargs)
        self.user_compute_metrics = user_metrics
        train_size = _length(self.train_dataset)
        self.method: TrainingMethod = get_method_class(args.method)(args, num_train_examples=train_size)
        for callback in self.method.callbacks():
            self.add_callback(callback)
        self._ivon_param_names: list[str] | None = None
        self._last_grad_norm: torch.Tensor | None = None
        if self.method.uses_ivon and self.optimizer is not None and not isinstance(self.optimizer, VariationalIVON):
            raise ValueError(
                f"method={args.method!r} trains with IVON, which the trainer builds itself; got a "
                f"{type(self.optimizer).__name__} in `optimizers`. Drop `optimizers=` (or pass a varsmooth.VariationalIVON)."
            )

    # -- optimizer ---------------------------------------------------------------------------------
    @property
    def ivon(self) -> VariationalIVON | None:
        """The IVON optimizer behind accelerate's wrapper, or None before training / for non-IVON methods."""
        return unwrap_ivon(self.optimizer) if self.method.uses_ivon else None

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if not self.method.uses_ivon:
            return super().create_optimizer(model)
        if self.optimizer is None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            low_precision = sorted({str(p.dtype) for p in params if p.dtype not in (torch.float32, torch.float64)})
            if low_precision:
                raise ValueError(
                    f"IVON needs fp32 trainable weights, found {low_precision}: in bf16 β2=0.99999 rounds to 1 and the "
                    "Hessian never updates. Load the model in float32 and use bf16=True for mixed precision."
                )
            self._ivon_param_names = [names[id(p)] for p in params]
            self.optimizer = VariationalIVON(
                params, noise_seed=self.args.seed, rank=self.args.process_index,
                sync=self.args.world_size > 1, **self.method.ivon_settings(),
            )
        elif self._ivon_param_names is None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            self._ivon_param_names = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        return self.optimizer

    def posterior(self) -> DiagonalGaussianPosterior:
        """The current q = N(m, diag σ²); a point mass when there is no IVON state (non-IVON method, untrained)."""
        opt = self.ivon
        model = self.accelerator.unwrap_model(self.model)
        if opt is None:
            return DiagonalGaussianPosterior.zero(model)
        meta = {**self.method.hyperparameters(), "eval_seed": self.args.eval_seed, "step": opt.current_step}
        return DiagonalGaussianPosterior.from_ivon(model, opt, self._ivon_param_names, meta)

    # -- training ----------------------------------------------------------------------------------
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """The method's mean loss on this micro-batch; `num_items_in_batch` is ignored on purpose (IVON averages)."""
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(f"The training batch has no 'labels' (keys: {sorted(inputs)}); name the label column 'label' or 'labels'.")
        outputs = model(**{k: v for k, v in inputs.items() if k not in LABEL_KEYS})
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        loss = self.method.loss(logits, labels, self, inputs)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if not self.method.uses_ivon:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        opt = self.ivon
        params = [p for g in opt.param_groups for p in g["params"]]
        total = torch.zeros((), device=self.args.device)
        for _ in range(self.args.mc_samples):
            # DDP all-reduce off for every sample: IVON(sync=True) averages g and ε⊙g over ranks in step().
            no_sync = self.accelerator.no_sync(model) if self.args.world_size > 1 else contextlib.nullcontext()
            with opt.sampled_params(train=True), no_sync:
                model.zero_grad(set_to_none=True)  # the Trainer zeroes only after step(); each sample needs its own g
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, dict(inputs))
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"Non-finite training loss ({loss.item()}) at step {self.state.global_step}. The mean weights "
                        "were restored. Lower learning_rate, set clip_radius (e.g. 0.05) or max_grad_norm, or check "
                        "the inputs for NaNs."
                    )
                self.accelerator.backward(loss)
                if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                    self._last_grad_norm = torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)
            total += loss.detach()
        # for logging only: the Trainer sums this over micro-batches and divides by the optimizer steps
        return total / self.args.mc_samples / self.current_gradient_accumulation_steps

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if self.method.uses_ivon:  # already clipped inside each sample; clipping now would not reach IVON
            return self._last_grad_norm
        return super()._clip_grad_norm(model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        state = self.method.state_dict()
        if state and self.args.should_save:
            with atomic_path(os.path.join(output_dir, METHOD_STATE_FILE)) as tmp:
                torch.save(state, tmp)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, METHOD_STATE_FILE)):
            state = torch.load(os.path.join(checkpoint, METHOD_STATE_FILE), map_location="cpu", weights_only=True)
            self.method.load_state_dict(state)

    # -- prediction --------------------------------------------------------------------------------
    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None) -> tuple:
        """Returns (NLL of the BMA prediction, (log P̂, posterior-mean logits), labels)."""
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        samples = self.args.eval_mc_samples if self.ivon is not None else 0
        out = predictive_distribution(model, self._eval_posterior, inputs, samples, self.args.eval_seed)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.nll_loss(out.logits, labels)
        if prediction_loss_only:
            return loss, None, None
        return loss, (out.logits, out.mean_logits), labels

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # the posterior is built once per evaluation, from the IVON state of this moment
        self._eval_posterior = self.posterior()
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            del self._eval_posterior

    def _compute_metrics(self, eval_pred: EvalPrediction) -> dict[str, float]:
        log_probs, mean_logits = eval_pred.predictions
        labels = eval_pred.label_ids
        probs = np.exp(log_probs)
        metrics = classification_metrics(probs, labels)
        if self.ivon is not None and self.args.eval_mc_samples > 0:
            mean_probs = torch.as_tensor(mean_logits).float().softmax(-1).numpy()
            metrics.update({f"mean_{k}": v for k, v in classification_metrics(mean_probs, labels).items()})
        if self.user_compute_metrics is not None:
            metrics.update(self.user_compute_metrics(EvalPrediction(predictions=log_probs, label_ids=labels)))
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test") -> PredictionOutput:
        """As `Trainer.predict`; `predictions` are log P̂ (the log of the posterior-averaged probabilities)."""
        output = super().predict(test_dataset, ignore_keys, metric_key_prefix)
        predictions = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        return PredictionOutput(predictions=predictions, label_ids=output.label_ids, metrics=output.metrics)

    # -- saving ------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)
        if self.ivon is not None and self.args.should_save:
            self.posterior().save(output_dir if output_dir is not None else self.args.output_dir)

    # -- diagnostics -------------------------------------------------------------------------------
    def hessian_summary(self) -> dict[str, float]:
        """Mean/median of IVON's Hessian h and of the posterior std σ (seed 000, Alg. 1)."""
        opt = self.ivon
        if opt is None:
            return {}
        hess = opt.hessian().float()
        std = torch.cat([s.flatten() for s in opt.posterior_std()]).float()
        return {"hess_mean": hess.mean().item(), "hess_median": hess.median().item(),
                "posterior_std_mean": std.mean().item(), "posterior_std_median": std.median().item()}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs: show whether the posterior is learning
            logs = {**logs, **self.hessian_summary()}
        super().log(logs, start_time)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output = super().train(*args, **kwargs)
        opt = self.ivon
        if opt is not None and opt.param_groups[0]["beta2"] < 1.0:
            h0 = opt.param_groups[0]["hess_init"]
            moved = (opt.hessian().float() - h0).abs().median().item() / h0
            if moved < HESSIAN_STUCK_TOLERANCE:
                logger.warning(
                    "IVON's Hessian hardly moved during training (median relative change %.2g after %d steps with "
                    "beta2=%s): the posterior std is still set by the prior settings (ess, hess_init), not learned. "
                    "For short runs use a smaller beta2 (its averaging window 1/(1-beta2) should be a fraction of the "
                    "run's steps) together with clip_radius.", moved, opt.current_step, opt.param_groups[0]["beta2"],
                )
        return output


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None
