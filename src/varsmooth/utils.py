"""Small helpers shared across the package."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["atomic_path", "checkpoint_to_resume", "evaluate_validation_and_test"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path in the same folder; on success it replaces `path` in one rename.

    A crash while writing leaves the previous file (or none), never half a file.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        yield tmp
        # mkstemp creates the file private (0600); give it the permissions an ordinary write would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def checkpoint_to_resume(args: Any) -> str | None:
    """The checkpoint an example script resumes from, as in Hugging Face's example scripts.

    `args.resume_from_checkpoint` when given, else the last `checkpoint-N` in `args.output_dir`. A non-empty
    `output_dir` without checkpoints is refused unless `args.overwrite_output_dir`, so that a run never mixes its
    files with an earlier run's; `overwrite_output_dir` also starts from scratch when there are checkpoints.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if args.resume_from_checkpoint is not None:
        if not os.path.isdir(args.resume_from_checkpoint):
            raise FileNotFoundError(f"--resume_from_checkpoint {args.resume_from_checkpoint!r} is not a folder: pass a "
                                    f"checkpoint-N folder written by an earlier run.")
        return args.resume_from_checkpoint
    if not os.path.isdir(args.output_dir) or getattr(args, "overwrite_output_dir", False):
        return None
    last = get_last_checkpoint(args.output_dir)
    if last is None and os.listdir(args.output_dir):
        raise ValueError(f"Output directory ({args.output_dir}) already exists and is not empty. Use "
                         "--overwrite_output_dir to train into it anyway, or choose another --output_dir.")
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
