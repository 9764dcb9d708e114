"""What `VariationalTrainer` refuses before it starts, each with the fix named: arguments it cannot honour, datasets
that would fail deep in a collator, and inputs that do not fit the training method."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import datasets
import torch
from transformers.training_args import ParallelMode

from .methods import TrainingMethod, learns_posterior
from .posterior.optimizer import VariationalIVON
from .training_args import VariationalTrainingArguments

__all__ = ["check_arguments", "check_compute_metrics", "check_datasets", "check_method_inputs"]


def check_arguments(args: VariationalTrainingArguments | None) -> VariationalTrainingArguments:
    """`args`, or the defaults for None; refuses other arguments, `label_smoothing_factor` (a method of its own here)
    and a multi-process launch the Trainer would not run as one DDP job."""
    if args is None:
        return VariationalTrainingArguments(output_dir="trainer_output")
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
    return args


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


def check_compute_metrics(args: VariationalTrainingArguments, compute_metrics: Callable[..., Any] | None) -> None:
    """The stock Trainer's check of `batch_eval_metrics`, which would only see varsmooth's wrapper of the function."""
    if args.batch_eval_metrics and compute_metrics is not None and "compute_result" not in inspect.signature(compute_metrics).parameters:
        raise ValueError(
            "With batch_eval_metrics=True, compute_metrics must take a boolean `compute_result` argument (True on the "
            "last batch: return the metrics of the whole evaluation then)."
        )


def check_datasets(train_dataset: Any, eval_dataset: Any) -> int | None:
    """The number of training examples (None: unknown, e.g. an IterableDataset); refuses an empty training set and
    label columns of strings."""
    try:
        train_size = len(train_dataset) if train_dataset is not None else None
    except TypeError:
        train_size = None
    if train_size == 0:
        raise ValueError("train_dataset has no examples: nothing to train on. Pass the training split with its "
                         "examples (check the select/filter/split that built it), or train_dataset=None to only evaluate.")
    for role, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        _refuse_string_labels(role, dataset)
    return train_size


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


def check_method_inputs(method: TrainingMethod, compute_loss_func: Any, posterior: Any, optimizer: Any) -> None:
    """Refuse a `compute_loss_func` that would replace a method's own loss, a `posterior=` for a method without one,
    and an optimizer other than IVON for an IVON method."""
    if compute_loss_func is not None and type(method).loss is not TrainingMethod.loss:
        raise ValueError(
            f"compute_loss_func would replace the training loss of method={method.name!r}, which is the method "
            "itself. Use it with method='ivon', 'ivon_fixed_hessian', 'erm' or 'sam' (cross-entropy by default), "
            "or drop compute_loss_func."
        )
    if posterior is not None and not learns_posterior(method):
        raise ValueError(f"posterior= is for IVON methods (BMA over the posterior); method={method.name!r} predicts at the weights.")
    if learns_posterior(method) and optimizer is not None and not isinstance(optimizer, VariationalIVON):
        raise ValueError(
            f"method={method.name!r} trains with IVON, which the trainer builds itself; got a "
            f"{type(optimizer).__name__} in `optimizers`. Drop `optimizers=` (or pass a varsmooth.VariationalIVON)."
        )
