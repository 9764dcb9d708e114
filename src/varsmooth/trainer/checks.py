"""What `VariationalTrainer` refuses before it starts, each with the fix named: arguments it cannot honour, IVON
settings given to a method without IVON, datasets that would fail deep in a collator or train on something else than
their labels, and inputs that do not fit the training method. Everything that can be checked before the first step is
checked there: a run must not be lost to a bad label found after training."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import datasets
import numpy as np
import torch
from transformers import TrainingArguments
from transformers.training_args import ParallelMode

from ..methods import EXAMPLE_INDEX_KEY, TrainingMethod
from ..outputs import IGNORE_INDEX, LABEL_KEYS
from .arguments import VariationalTrainingArguments

__all__ = ["check_arguments", "check_compute_metrics", "check_datasets", "check_input_columns", "check_label_names",
           "check_labels", "check_method_inputs", "check_single_label_model", "named_datasets",
           "name_inputs_the_model_cannot_take"]

logger = logging.getLogger(__name__)


def check_arguments(args: VariationalTrainingArguments | None) -> VariationalTrainingArguments:
    """`args`, or the defaults for None; refuses other arguments and a multi-process launch the Trainer would not run as
    one DDP job."""
    if args is None:
        return VariationalTrainingArguments(output_dir="trainer_output")
    if not isinstance(args, VariationalTrainingArguments):
        raise TypeError(
            f"VariationalTrainer needs VariationalTrainingArguments, got {type(args).__name__}. "
            "Build them with VariationalTrainingArguments(...) (same fields as TrainingArguments plus IVON's)."
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
    if (args.batch_eval_metrics and compute_metrics is not None
            and "compute_result" not in inspect.signature(compute_metrics).parameters):
        raise ValueError(
            "With batch_eval_metrics=True, compute_metrics must take a boolean `compute_result` argument (True on the "
            "last batch: return the metrics of the whole evaluation then)."
        )


def check_datasets(train_dataset: Any, eval_dataset: Any, num_labels: int | None = None) -> int | None:
    """The number of training examples (None: unknown, e.g. an IterableDataset); refuses an empty training set and
    label columns the training or evaluation would fail on or misread (`check_labels`; `num_labels`: the model's
    number of classes, None when unknown)."""
    try:
        train_size = len(train_dataset) if train_dataset is not None else None
    except TypeError:
        train_size = None
    if train_size == 0:
        raise ValueError("train_dataset has no examples: nothing to train on. Pass the training split with its "
                         "examples (check the select/filter/split that built it), or train_dataset=None to only "
                         "evaluate.")
    for role, dataset in named_datasets(train_dataset, eval_dataset):
        check_labels(role, dataset, num_labels, training=role == "train_dataset")
    return train_size


def named_datasets(train_dataset: Any, eval_dataset: Any) -> list[tuple[str, Any]]:
    """(name for messages, dataset) of the training set and of each eval dataset (a dict of them too)."""
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    return [("train_dataset", train_dataset),
            *((("eval_dataset" if name is None else f"eval_dataset[{name!r}]"), dataset) for name, dataset in named)]


def check_labels(role: str, dataset: Any, num_labels: int | None, training: bool = False) -> None:
    """Refuse a label column the trainer would fail on after training (an evaluation, the choice of τ, a label-noise
    export) or silently misread while training: strings, floats, values outside [0, num_labels) other than the ignore
    index −100, or, for training, only −100. `role` names the dataset in the message. Datasets with a transform
    (`with_transform`) are skipped: the transform may turn the raw column into class ids."""
    _refuse_string_labels(role, dataset)
    if not isinstance(dataset, datasets.Dataset) or dataset.format.get("type") == "custom":
        return
    column = next((c for c in LABEL_KEYS if c in dataset.column_names), None)
    if column is None or len(dataset) == 0:
        return
    values = np.asarray(dataset.with_format("numpy")[column])
    if values.ndim != 1 or values.dtype == object:  # one class id per row is all this checks
        return
    code = role if role.isidentifier() or role.startswith("eval_dataset[") else "dataset"  # for the fix's code
    if np.issubdtype(values.dtype, np.floating):
        raise ValueError(
            f"The {column!r} column of {role} holds floats (e.g. {values[0]!r}), but the trainer needs integer class "
            f"ids (the cross-entropy would fail or read them as class probabilities). Cast it: {code} = "
            f"{code}.cast_column({column!r}, datasets.Value('int64')), or encode it as a datasets.ClassLabel."
        )
    if not np.issubdtype(values.dtype, np.integer):
        return
    outside = (values < 0) & (values != IGNORE_INDEX)
    if num_labels is not None:
        outside |= values >= num_labels
    if outside.any():
        rows = np.flatnonzero(outside)
        classes = (f"the model's {num_labels} classes [0, {num_labels})" if num_labels is not None
                   else "the class ids (>= 0)")
        raise ValueError(
            f"The {column!r} column of {role} holds {values[rows[0]]} (row {rows[0]}; {len(rows)} rows in all, values "
            f"{sorted(set(values[rows[:20]].tolist()))}), outside {classes}; only {IGNORE_INDEX} may mark a row to "
            f"ignore. Map the labels to 0..{num_labels - 1 if num_labels else 'K-1'} (or drop those rows: "
            f"{code}.filter(...)), or build the model with "
            "num_labels= the number of classes (e.g. from_pretrained(..., num_labels=K))."
        )
    if training and (values == IGNORE_INDEX).all():
        raise ValueError(
            f"Every row of {role} has {column!r} = {IGNORE_INDEX} (ignored by the loss): training would run on a loss "
            "of 0 and learn nothing. Give the training rows their class ids (check the map that built the column)."
        )


def check_input_columns(role: str, dataset: Any, forward_columns: list[str], remove_unused_columns: bool) -> None:
    """Refuse a dataset none of whose columns is an input of the model's forward (`forward_columns`, the Trainer's
    signature columns): with `remove_unused_columns` the Trainer would drop them all but the label and call the model
    without inputs. Datasets with a transform are skipped (the transform makes the inputs)."""
    if not remove_unused_columns or not isinstance(dataset, datasets.Dataset) or dataset.format.get("type") == "custom":
        return
    not_inputs = {*LABEL_KEYS, EXAMPLE_INDEX_KEY}
    if set(dataset.column_names) & (set(forward_columns) - not_inputs):
        return
    inputs = [c for c in forward_columns if c not in not_inputs and c not in ("kwargs", "args", "return_dict")]
    candidates = [c for c in dataset.column_names if c not in not_inputs]
    rename = (f" e.g. {role} = {role}.rename_column({candidates[0]!r}, {inputs[0]!r})" if candidates and inputs else "")
    raise ValueError(
        f"No column of {role} ({dataset.column_names}) is an input of the model's forward ({inputs}): with "
        f"remove_unused_columns=True the Trainer would drop {candidates or 'them'} and call the model without inputs. "
        f"Rename the input column to the name forward() takes,{rename}."
    )


@contextlib.contextmanager
def name_inputs_the_model_cannot_take(inputs: Mapping[str, Any], model: Any, first_step: bool) -> Iterator[None]:
    """Around the micro-batches of the first step, before any update: an error of the model on its inputs (a shape,
    a channel count, a keyword forward() does not take) is raised again with the batch's columns and shapes and the
    fix, which torch's message names neither. Later steps, whose inputs the first one proved, pass through."""
    if not first_step:
        yield
        return
    try:
        yield
    except (RuntimeError, TypeError, IndexError, ValueError) as error:
        # torch's OutOfMemoryError is no input's fault, and varsmooth's own errors already name theirs
        if type(error) not in (RuntimeError, TypeError, IndexError, ValueError) or _raised_by_varsmooth(error):
            raise
        columns = ", ".join(f"{name} {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
                            if isinstance(value, torch.Tensor) else f"{name} ({type(value).__name__})"
                            for name, value in inputs.items())
        raise type(error)(
            f"{type(model).__name__} cannot take the first training batch ({type(error).__name__}: {error}). The batch "
            f"holds: {columns}. Give the model the inputs its forward() takes, with the shapes it was built for (e.g. "
            "images with its number of channels, at its image size; token ids within its vocabulary), by fixing the "
            "dataset's columns or the data_collator, or build the model for these inputs."
        ) from error


def _raised_by_varsmooth(error: BaseException) -> bool:
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and os.path.dirname(os.path.abspath(__file__)) in os.path.abspath(
        traceback.tb_frame.f_code.co_filename)


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
    and an optimizer in `optimizers` the method cannot train with (`TrainingMethod.check_optimizer`)."""
    if compute_loss_func is not None and type(method).loss is not TrainingMethod.loss:
        raise ValueError(
            f"compute_loss_func would replace the training loss of method={method.name!r}, which is the method "
            "itself. Use it with method='ivon', 'ivon_fixed_hessian', 'erm' or 'sam' (cross-entropy by default), "
            "or drop compute_loss_func."
        )
    if posterior is not None and not method.learns_posterior:
        raise ValueError(f"posterior= is for IVON methods (BMA over the posterior); method={method.name!r} predicts at "
                         "the weights.")
    if optimizer is not None:
        method.check_optimizer(optimizer)


def check_label_names(args: TrainingArguments) -> None:
    """One label column: the trainer reads the labels of every batch under `label_names[0]` (default "labels")."""
    if args.label_names is not None and len(args.label_names) != 1:
        raise ValueError(
            f"label_names={args.label_names!r}: VariationalTrainer trains single-label classifiers, whose labels are "
            "one column of class ids. Pass label_names=['<that column>'] (or leave it unset for 'label'/'labels')."
        )


def check_single_label_model(model: Any) -> None:
    """Refuse a model configured for multi-label classification or regression (HF's `problem_type`, or `num_labels=1`):
    the methods, the BMA and the label-noise export are defined for one class per example."""
    config = getattr(model, "config", None)
    problem = getattr(config, "problem_type", None)
    if (problem in ("multi_label_classification", "regression")
            or (problem is None and getattr(config, "num_labels", None) == 1)):
        kind = problem or "regression (num_labels=1)"
        raise ValueError(
            f"The model is configured for {kind}, which VariationalTrainer does not train: its methods, Bayesian model "
            "averaging and label-noise export are defined for single-label classification (one class id per example, "
            "softmax over num_labels >= 2). Use transformers.Trainer for this model, or configure it with "
            "problem_type='single_label_classification' and num_labels >= 2."
        )
