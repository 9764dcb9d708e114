"""Small helpers shared across the package."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

# the file guarantees live in `varsmooth.files`; `atomic_path` and `ordinary_file_mode` stay importable from here
from .files import atomic_path, is_leftover, ordinary_file_mode, refuse_finished_run, refuse_other_run

__all__ = ["atomic_path", "checkpoint_to_resume", "deprecated_alias", "evaluate_validation_and_test", "ordinary_file_mode"]


def deprecated_alias(old: str, new: str, target: Callable[..., Any]) -> Callable[..., Any]:
    """`target` under its name of the previous release, `old`: each call warns (FutureWarning) that `new` replaces it.
    Kept for one release, so that code written against the old name keeps working while it moves."""

    @functools.wraps(target)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new}.", FutureWarning, stacklevel=2)
        return target(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old.rsplit(".", 1)[-1]
    return alias


def checkpoint_to_resume(args: Any) -> str | None:
    """The checkpoint an example script resumes from, as in Hugging Face's example scripts.

    `args.resume_from_checkpoint` when given, else the last `checkpoint-N` in `args.output_dir`. A non-empty
    `output_dir` without checkpoints is refused unless `args.overwrite_output_dir`, so that a run never mixes its
    files with an earlier run's; `overwrite_output_dir` also starts from scratch when there are checkpoints. A
    checkpoint of another `--seed` or `--method` is refused (resuming it would continue that run under this one's name,
    on a data split drawn with this seed), and so is the last checkpoint of a run that has already finished (the stock
    Trainer would train one step more): `varsmooth.files`' checks, which `VariationalTrainer.train` makes too,
    made here before the data and model are built.
    """
    from transformers.trainer_utils import get_last_checkpoint


    if args.resume_from_checkpoint is not None:
        if not os.path.isdir(args.resume_from_checkpoint):
            raise FileNotFoundError(f"--resume_from_checkpoint {args.resume_from_checkpoint!r} is not a folder: pass a "
                                    f"checkpoint-N folder written by an earlier run.")
        refuse_other_run(args, args.resume_from_checkpoint)
        return args.resume_from_checkpoint
    if not os.path.isdir(args.output_dir) or getattr(args, "overwrite_output_dir", False):
        return None
    last = get_last_checkpoint(args.output_dir)
    # what a killed run left under a temporary name is no earlier run's file: the next save deletes it
    if last is None and [name for name in os.listdir(args.output_dir) if not is_leftover(name)]:
        raise ValueError(f"Output directory ({args.output_dir}) already exists and is not empty. Use "
                         "--overwrite_output_dir to train into it anyway, or choose another --output_dir.")
    if last is not None:
        refuse_other_run(args, last)
        refuse_finished_run(args, last)
    return last


def evaluate_validation_and_test(trainer: Any, test_dataset: Any = None) -> dict[str, float]:
    """The example scripts' final scores: `eval_*` on the trainer's validation split (where the posterior temperature
    and any other choice were made) and, when the dataset has one, `test_*` on its test split, scored once and never
    chosen on. Both are logged and saved (`eval_results.json`, `test_results.json`) as in HF's examples."""
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    if test_dataset is not None:
        test_metrics = trainer.evaluate(test_dataset, metric_key_prefix="test")
        trainer.log_metrics("test", test_metrics)
        trainer.save_metrics("test", test_metrics)
        metrics = {**metrics, **test_metrics}
    return metrics


def length_order(dataset: Any, column: str = "input_ids") -> list[int] | None:
    """The rows of a tokenized `dataset` from shortest to longest `column` (stable), or None when it has no such column
    (images, a transform): batches in this order pad each sequence to about its own length. Label-noise export and
    the choice of τ run S forward passes over a split, and batches of sentences in dataset order padded to their
    longest (the collator's rule) cost about twice as much."""
    names = getattr(dataset, "column_names", None) or ()
    if column not in names or (getattr(dataset, "format", None) or {}).get("type") == "custom":
        return None
    lengths = [len(ids) for ids in dataset.with_format(None)[column]]
    return sorted(range(len(lengths)), key=lengths.__getitem__)

