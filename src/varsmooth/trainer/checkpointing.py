"""`CheckpointingMixin`: the saves and resumes of `VariationalTrainer`. A save writes the posterior (σ per parameter),
the fitted temperature, the training set's noise report and the folder's manifest beside the weights, and refuses
non-finite weights; a checkpoint appears by one rename once complete (`varsmooth.files`); a resume checks the
checkpoint's files first, refuses to continue another run under this one's name (`files.refuse_other_run`,
`files.refuse_finished_run`; the method its own, e.g. IVON settings other than the checkpoint's) and has the method
restore the state that belongs with the weights (IVON's Hessian and step: `TrainingMethod.reconcile_resume`). A
step after training that fails (an `on_train_end` callback) never loses the trained run: it is saved before the error
is raised."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..adapters import is_peft_model, save_classifier_config
from ..files import METHOD_STATE_FILE, STAGING_PREFIX, FolderSave, atomic_path, check_manifest, clear_leftovers
from ..posterior import POSTERIOR_FILE
from ..posterior.gaussian import non_finite_tensors
from ..prediction.predictors import PosteriorPredictor
from .checkpoint_files import (
    has_optimizer_state,
    publish_checkpoint,
    refuse_finished_run,
    refuse_other_run,
    rotate_checkpoints,
)

__all__ = ["CheckpointingMixin"]

logger = logging.getLogger(__name__)

class CheckpointingMixin:
    """For `VariationalTrainer` (a `transformers.Trainer` with `_saved_prediction()`, a training `method`, an optional
    `temperature_scaling` and `train_noise_report()`). Private `Trainer` hooks it overrides, and what would not work
    without each:

    * `_save`: the only step every save (final, checkpoint, FSDP's gathered state dict) takes on the writing process:
      non-finite weights are refused and the posterior, temperature, noise report and manifest written there;
    * `_save_checkpoint`: a checkpoint (with the method's state) appears by one rename once complete, then is pushed
      and rotated (`varsmooth.files`); without it a kill can leave a half checkpoint that resume picks up;
    * `_get_output_dir`: the stock `_save_checkpoint` writes where it says, so this sends it into the staging folder;
    * `_load_from_checkpoint`: checks the checkpoint against its manifest before any weight is read; without it a
      truncated file fails inside safetensors or torch.load instead of being named;
    * `_load_optimizer_and_scheduler`: the stock one skips the optimizer without a scheduler.pt, restarting IVON's
      Hessian and step silently (the method restores them); also loads the method's state;
    * `_load_best_model`: the stock one reloads only the weights; the saved posterior would pair them with the last
      step's σ.
    """

    def _init_checkpointing(self) -> None:
        self._run_files: dict[str, set[str]] = {}  # folder -> files this trainer wrote there outside `_save`
        self._staging_dir: str | None = None
        self._gathered_prediction: PosteriorPredictor | None = None  # σ gathered by save_model under FSDP
        self._training_ended = False  # set by `after_training`: a failure after it must not lose the run

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`. What a killed run left in `output_dir` under temporary names is deleted first; when a step
        after training fails (an `on_train_end` callback: the choice of τ, temperature scaling, the label-noise
        export, yours), the trained model is saved to `output_dir` before the error is raised."""
        if self.args.should_save:
            clear_leftovers(self.args.output_dir)
        self._training_ended = False
        try:
            return super().train(*args, **kwargs)
        except Exception as error:
            if not self._training_ended:
                raise
            self.save_model()
            saved = ("The trained model and its posterior were"
                     if os.path.isfile(os.path.join(self.args.output_dir, POSTERIOR_FILE)) else "The trained model was")
            raise RuntimeError(
                f"Training finished (step {self.state.global_step}), but a step after it failed "
                f"({type(error).__name__}: {error}). {saved} saved to {self.args.output_dir}, "
                "predicting with what was chosen before the failure. Fix what the error names and redo only that step "
                "on this trainer (trainer.select_posterior_temperature(eval_dataset), "
                "trainer.fit_temperature_scaling(eval_dataset), trainer.label_noise(dataset)): there is no need to "
                "train again."
            ) from error

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # under FSDP σ and the weights are sharded: every process gathers them here, since the stock save_model
        # may leave the writing (`_save`) to the main process alone
        saved = self._saved_prediction() if self.is_fsdp_enabled else None
        self._gathered_prediction = saved.gathered() if saved is not None else None
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._gathered_prediction = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            network = self.accelerator.unwrap_model(self.model)
            bad = non_finite_tensors(state_dict.items() if state_dict is not None else
                                     [*network.named_parameters(), *network.named_buffers()])
            if bad:
                raise FloatingPointError(
                    f"Not saving to {output_dir}: the weights {bad[:5]}{' ...' if len(bad) > 5 else ''} are not finite "
                    "(NaN or inf); nothing was written. Resume from the last checkpoint (or load the last save) "
                    "instead."
                )
        if not self.args.should_save:  # here only to join the gathers of a model sharded at load; writes nothing
            super()._save(output_dir, state_dict)
            return
        with FolderSave(output_dir) as folder:
            super()._save(folder.path, state_dict)
            network = self.accelerator.unwrap_model(self.model)
            if is_peft_model(network):
                save_classifier_config(network, folder.path)
            prediction = self._gathered_prediction or self._saved_prediction()
            if prediction is not None:
                prediction.save(folder.path)
            if self.temperature_scaling is not None:
                self.temperature_scaling.save(folder.path, network)
            report = self.train_noise_report()
            if report is not None:
                report.save(folder.path)
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
            clear_leftovers(run_dir)
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

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # every file against the checkpoint's manifest before any is read: a truncated model.safetensors or
        # optimizer.pt is named, instead of failing inside safetensors or torch.load
        check_manifest(resume_from_checkpoint)
        refuse_other_run(self.args, resume_from_checkpoint)
        refuse_finished_run(self.args, resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        # the stock version reloads only the weights: the Hessian must come from the same checkpoint, or the
        # saved and evaluated posterior would pair the best mean with the last step's variances
        if self.state.best_model_checkpoint:
            check_manifest(self.state.best_model_checkpoint)
        super()._load_best_model()
        if self.state.best_model_checkpoint:
            self.method.restore_state(self.optimizer, self.accelerator.unwrap_model(self.model),
                                      self.state.best_model_checkpoint, self.state.global_step)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        before = self.method.settings_before_resume(self.optimizer) if checkpoint is not None else None
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        # the stock Trainer loads the optimizer only together with the scheduler, and silently starts afresh without
        # them: the method restores what it needs then
        loaded = has_optimizer_state(checkpoint) and os.path.isfile(os.path.join(checkpoint, "scheduler.pt"))
        self.method.reconcile_resume(self.optimizer, before, checkpoint, loaded,
                                     self.accelerator.unwrap_model(self.model), self.state.global_step)
        if os.path.isfile(os.path.join(checkpoint, METHOD_STATE_FILE)):
            state = torch.load(os.path.join(checkpoint, METHOD_STATE_FILE), map_location="cpu", weights_only=True)
            self.method.load_state_dict(state)
