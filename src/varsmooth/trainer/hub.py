"""`VariationalHubMixin`: the model card and the Hub pushes of `VariationalTrainer`.

What goes up is the folder's manifest (`varsmooth.files`): exactly the files the training wrote, less the private ones;
the stock Trainer uploads the whole output_dir and writes a card that reports its `optim` (not IVON).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from transformers.trainer_utils import HubStrategy
from transformers.utils.hub import PushInProgress, hf_api

from ..files import (
    MANIFEST_FILE,
    OWNED_PATTERNS,
    FolderSave,
    add_to_manifest,
    atomic_path,
    check_manifest,
    read_manifest,
    shareable_files,
    written_by_varsmooth,
)
from ..hub.card import build_model_card, write_reliability_diagram
from ..hub.record import (
    POSTERIOR_LOG_KEYS,
    RunRecord,
    as_list,
    last_eval_metrics,
    last_posterior_log,
    training_schedule,
)
from ..prediction.batchnorm import RECOMPUTED_LOG_KEY
from ..training_health import cross_entropy_classes, stalled_training_loss

__all__ = ["VariationalHubMixin"]


class VariationalHubMixin:
    """For `VariationalTrainer` (a `transformers.Trainer` with a training `method`, `record_output` and the save
    bookkeeping of `_save`): replaces `create_model_card`, `push_to_hub` and the intermediate pushes."""

    def create_model_card(self, model_name: str | None = None, replace_model_card: bool = False, **kwargs: Any) -> None:
        """Replaces the stock card (which would report the Trainer's `optim` for IVON runs) with varsmooth's.

        A README.md in output_dir that a varsmooth save did not write (your own card) is kept: this raises unless
        `replace_model_card=True`.
        """
        # on every rank: under FSDP2 the record's Hessian summary gathers the shards
        record = self.run_record(model_name=model_name, **kwargs)
        if not self.is_world_process_zero():
            return
        self._refuse_to_replace_own_card(replace_model_card)
        picture = write_reliability_diagram(self.reliability_diagram, self.args.output_dir,
                                            bma=record.learns_posterior and record.eval_mc_samples > 0
                                            and record.posterior_temperature.value > 0)
        if picture is not None:  # beside the model, in the manifest (uploaded) and so embedded by the card
            self.record_output(picture)
            add_to_manifest(self.args.output_dir, [os.path.basename(picture)])
        path = os.path.join(self.args.output_dir, "README.md")
        card = build_model_card(record, self.accelerator.unwrap_model(self.model), self.args.output_dir)
        with atomic_path(path) as tmp:
            card.save(tmp)
        self.record_output(path)
        add_to_manifest(self.args.output_dir, ["README.md"])

    def run_record(self, *, model_name: str | None = None, dataset: str | list[str] | None = None,
                   dataset_tags: str | list[str] | None = None, license: str | None = None,
                   tags: list[str] | None = None, language: str | None = None, **_: Any) -> RunRecord:
        """The record of this run so far, as the card tells it; the keywords are those of `Trainer.create_model_card`
        (others are ignored, as `push_to_hub` passes all of its keywords on)."""
        args = self.args
        repo_id = args.hub_model_id or model_name or os.path.basename(os.path.abspath(args.output_dir))
        metrics, scored_on = last_eval_metrics(self.state.log_history)
        method_hyperparameters = self.method.hyperparameters()
        return RunRecord(
            method=self.method.name,
            learns_posterior=self.method.learns_posterior,
            method_config_choice=self.method_config_choice,
            hyperparameters={**method_hyperparameters, **training_schedule(args, method_hyperparameters),
                             "per_device_train_batch_size": args.per_device_train_batch_size,
                             "gradient_accumulation_steps": args.gradient_accumulation_steps,
                             "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
                             "seed": args.seed},
            repo_id=repo_id,
            model_name=model_name or repo_id.split("/")[-1],
            metrics=metrics,
            scored_on=scored_on,
            eval_mc_samples=args.eval_mc_samples,
            posterior_temperature=self.posterior_temperature,
            posterior_log=self._posterior_log(),
            stalled_loss=stalled_training_loss(self.state.log_history, cross_entropy_classes(self.method, self.model)),
            noise_report=self.train_noise_report(),
            datasets=as_list(dataset),
            dataset_tags=as_list(dataset_tags) or None,
            license=license,
            tags=tags,
            language=language,
        )

    def _posterior_log(self) -> dict[str, float] | None:
        """IVON's Hessian and σ statistics of the optimizer now (after training: the posterior that was saved), else
        of the last training log, and the examples BatchNorm's statistics were recomputed from at the end of training
        (`varsmooth.prediction.batchnorm`); None for a method without a posterior."""
        summary = self.hessian_summary()  # a method without a posterior logs none
        log = ({"step": self.state.global_step, **{k: summary[k] for k in POSTERIOR_LOG_KEYS if k in summary}}
               if summary else last_posterior_log(self.state.log_history))
        recomputed = next((entry[RECOMPUTED_LOG_KEY] for entry in reversed(self.state.log_history)
                           if RECOMPUTED_LOG_KEY in entry), None)
        return log if log is None or recomputed is None else {**log, RECOMPUTED_LOG_KEY: recomputed}

    def _refuse_to_replace_own_card(self, replace_model_card: bool) -> None:
        path = os.path.join(self.args.output_dir, "README.md")
        if (os.path.isfile(path) and not replace_model_card
                and not written_by_varsmooth(self.args.output_dir, "README.md")):
            raise FileExistsError(
                f"{path} was not written by varsmooth (your own model card?) and would be replaced by the generated "
                "card. Move it away, or pass replace_model_card=True (to push_to_hub or create_model_card) to replace "
                "it."
            )

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """The stock repository creation (called by `Trainer.__init__` with `push_to_hub`), with an error that says what
        failed and how to share the model later instead of the HTTP client's own."""
        try:
            super().init_hf_repo(token=token, private=private)
        except Exception as error:  # the HTTP client's errors differ between huggingface_hub versions
            out = self.args.output_dir
            raise RuntimeError(
                "push_to_hub: could not create the Hub repository "
                f"{self.args.hub_model_id or os.path.basename(os.path.abspath(out))!r} ({type(error).__name__}: "
                f"{error}). Either the Hub is unreachable (no network, or HF_HUB_OFFLINE=1) or the token is missing or "
                f"invalid (`hf auth login` with a write token, or --hub_token). Train without --push_to_hub: {out} "
                "then holds the model and its card, and can be pushed later with exactly the files a push uploads: "
                f"huggingface_hub.upload_folder(repo_id=..., folder_path={out!r}, "
                f"allow_patterns=varsmooth.files.shareable_files({out!r}))."
            ) from error

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None,
                    revision: str | None = None, private: bool | None = None, **kwargs: Any) -> Any:
        """Save, write the card, and upload exactly the files this training wrote (the manifest, less
        `files.PRIVATE_FILES`); varsmooth files of earlier pushes that this run did not write are deleted from the repo.

        A README.md of your own in output_dir makes this refuse, unless `replace_model_card=True`.
        """
        replace_card = kwargs.pop("replace_model_card", False)
        if self.is_world_process_zero():
            self._refuse_to_replace_own_card(replace_card)  # before anything is saved or uploaded
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        model_name = (kwargs.pop("model_name", None)
                      or (self.args.hub_model_id or self.args.output_dir).rstrip("/").split("/")[-1])
        self.create_model_card(model_name=model_name, replace_model_card=replace_card, **kwargs)
        self._finish_current_push()
        return hf_api().upload_folder(
            repo_id=self.hub_model_id, folder_path=self.args.output_dir, commit_message=commit_message, token=token,
            run_as_future=not blocking, allow_patterns=_exact(shareable_files(self.args.output_dir)),
            delete_patterns=list(OWNED_PATTERNS), revision=revision if revision is not None else self.args.hub_revision,
        )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Intermediate pushes: the stock version copies only config and weights from the checkpoint (and uploads
        the rest of output_dir); here the checkpoint's shareable files (its manifest: weights, posterior, processor)
        are copied into output_dir as one save, and exactly those go up. With `hub_strategy="checkpoint"` (or
        `"all_checkpoints"`) the checkpoint itself also goes up, as `last-checkpoint/` (or `checkpoint-N/`), to
        resume from elsewhere: every file of its manifest but `training_args.bin`, with a manifest of exactly those.

        `VariationalTrainer._save_checkpoint` calls this once the checkpoint is complete (manifest, final name)."""
        if self._staging_dir is not None:  # the stock `_save_checkpoint` asks before the checkpoint is complete
            return
        if not self.is_world_process_zero() or self.args.hub_strategy == "end":
            return
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        output_dir = self.args.output_dir
        with FolderSave(output_dir) as folder:
            for name in shareable_files(checkpoint_folder):
                shutil.copyfile(os.path.join(checkpoint_folder, name), os.path.join(folder.path, name))
            folder.finish(also=self._run_files.get(os.path.abspath(output_dir), ()), method=self.method.name,
                          global_step=self.state.global_step)
        message = f"Training in progress, step {self.state.global_step}"
        jobs = [hf_api().upload_folder(
            repo_id=self.hub_model_id, folder_path=output_dir, token=self.args.hub_token, commit_message=message,
            run_as_future=True, allow_patterns=_exact(shareable_files(output_dir)), revision=self.args.hub_revision,
        )]
        if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            path_in_repo = ("last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT
                            else os.path.basename(checkpoint_folder))
            operations = _checkpoint_operations(checkpoint_folder, path_in_repo)
            jobs.append(hf_api().run_as_future(_replace_repo_folder, self.hub_model_id, path_in_repo, operations,
                                               commit_message=message + ", checkpoint", token=self.args.hub_token,
                                               revision=self.args.hub_revision))
        self.push_in_progress = PushInProgress(jobs)


def _checkpoint_operations(checkpoint: str, path_in_repo: str) -> list[CommitOperationAdd]:
    """The upload of a checkpoint under `path_in_repo`: its manifest's files but the private training arguments (the
    Trainer's pickle may hold paths and tokens), and a manifest listing exactly these, so that the downloaded folder
    passes `check_manifest` when resumed from."""
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise ValueError(f"{checkpoint} has no {MANIFEST_FILE}: it was not written by VariationalTrainer.")
    files = {name: manifest["files"][name] for name in shareable_files(checkpoint, training_state=True)}
    check_manifest(checkpoint, files)
    shared = {**manifest, "files": files}
    operations = [CommitOperationAdd(path_in_repo=f"{path_in_repo}/{name}",
                                     path_or_fileobj=os.path.join(checkpoint, name))
                  for name in sorted(files)]
    operations.append(CommitOperationAdd(path_in_repo=f"{path_in_repo}/{MANIFEST_FILE}",
                                         path_or_fileobj=json.dumps(shared, indent=2).encode()))
    return operations


def _replace_repo_folder(repo_id: str, path_in_repo: str, operations: list[CommitOperationAdd], **kwargs: Any) -> Any:
    """One commit that makes `path_in_repo/` of the repo hold exactly `operations`' files (an earlier checkpoint's
    other files there are deleted)."""
    api = hf_api()
    uploaded = {op.path_in_repo for op in operations}
    earlier = [f for f in api.list_repo_files(repo_id, revision=kwargs.get("revision"), token=kwargs.get("token"))
               if f.startswith(path_in_repo + "/") and f not in uploaded]
    return api.create_commit(repo_id, [*operations, *(CommitOperationDelete(path_in_repo=f) for f in earlier)],
                             **kwargs)


def _exact(names: list[str]) -> list[str]:
    """`upload_folder` patterns that match exactly these names (fnmatch would expand `*`, `?` and `[...]`)."""
    return [glob.escape(name) for name in names]
