"""The checkpoints of a run, written and removed whole. A checkpoint is written under a staging name and appears as
`checkpoint-N` by one rename once complete (`publish_checkpoint`); an old one disappears by one rename before it is
deleted (`rotate_checkpoints`), and only the checkpoints varsmooth wrote are ever rotated. A kill leaves either a whole
checkpoint or none under a name `get_last_checkpoint` matches; what it leaves under a temporary name (`is_leftover`) the
next run deletes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from ..files import DELETING_PREFIX, MANIFEST_FILE, add_to_manifest, read_manifest

__all__ = ["has_optimizer_state", "publish_checkpoint", "refuse_finished_run", "refuse_other_run", "rotate_checkpoints"]

#: a checkpoint folder as the run names it (`get_last_checkpoint`'s pattern): not `checkpoint-0-backup`
_CHECKPOINT = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-\d+$")


def publish_checkpoint(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make the checkpoint written as `staging/<final's name>` (a model save with its manifest, then the training
    state) visible as `final`, by one rename. The manifest first lists the training-state files too (optimizer,
    scheduler, RNG and trainer states, as `training_state`), so that resuming refuses a truncated optimizer.pt by
    name; a checkpoint of the same step from an earlier run is replaced whole."""
    staging, final = os.fspath(staging), os.fspath(final)
    written = os.path.join(staging, os.path.basename(final))
    listed = set((read_manifest(written) or {}).get("files", ())) | {MANIFEST_FILE}
    state = sorted(entry.name for entry in os.scandir(written) if entry.is_file() and entry.name not in listed)
    add_to_manifest(written, state, training_state=state)
    if os.path.isdir(final):
        _remove_checkpoint(final)
    os.replace(written, final)
    shutil.rmtree(staging, ignore_errors=True)


def rotate_checkpoints(run_dir: str | os.PathLike, limit: int | None, best_checkpoint: str | None) -> None:
    """`transformers.trainer_utils.rotate_checkpoints`, but each old checkpoint disappears by one rename before it is
    deleted: a kill inside `rmtree` would leave a visible half-deleted checkpoint that resume picks up. Keeps the
    newest `limit` checkpoints (`save_total_limit`; None or ≤ 0 keeps all), and always the newest and `best_checkpoint`;
    only the checkpoints a varsmooth run wrote count and are removed (`_written_as_checkpoint`)."""
    if limit is None or limit <= 0:
        return
    checkpoints = [c for c in sort_checkpoints(os.fspath(run_dir), use_mtime=True) if _written_as_checkpoint(c)]
    protected = {checkpoints[-1]} if checkpoints else set()  # the newest, to resume from
    if best_checkpoint is not None:
        protected.add(str(Path(best_checkpoint)))
    remaining = len(checkpoints)
    for checkpoint in checkpoints:
        if remaining <= max(limit, len(protected)):
            break
        if checkpoint not in protected:
            _remove_checkpoint(checkpoint)
            remaining -= 1


def _written_as_checkpoint(path: str) -> bool:
    """Whether `path` is a checkpoint a varsmooth run wrote: named `checkpoint-N` exactly, with the manifest
    `publish_checkpoint` completes (it lists the training state). A user's `checkpoint-0-backup/`, or a copy of a
    checkpoint under another name, is no checkpoint of the run and is never rotated away."""
    if not _CHECKPOINT.match(os.path.basename(path)):
        return False
    try:
        manifest = read_manifest(path)
    except ValueError:
        return False
    return manifest is not None and "training_state" in manifest


def refuse_other_run(args: Any, checkpoint: str) -> None:
    """Refuse to resume `checkpoint` under another `seed` or `method` than the one its manifest records (written by
    VariationalTrainer's saves): the run would continue under this one's name."""
    manifest = read_manifest(checkpoint) or {}
    seed, method = manifest.get("seed"), manifest.get("method")
    if seed is not None and seed != args.seed:
        raise ValueError(
            f"{checkpoint} was trained with --seed {seed}, but this run has --seed {args.seed}: resuming would "
            f"continue the seed-{seed} run under seed {args.seed}'s name, with the data split drawn again. Pass --seed "
            f"{seed} to resume it, or start the seed-{args.seed} run in another --output_dir (or with "
            "--overwrite_output_dir)."
        )
    if method is not None and method != args.method:
        raise ValueError(
            f"{checkpoint} was trained with --method {method}, but this run has --method {args.method}: resuming would "
            f"continue the {method} run's weights under the {args.method} method's name. Pass --method {method} to "
            f"resume it, or start the {args.method} run in another --output_dir (or with --overwrite_output_dir)."
        )


def refuse_finished_run(args: Any, checkpoint: str) -> None:
    """Refuse to resume the checkpoint of a run that has reached the end this run's `max_steps` or `num_train_epochs`
    asks for: the stock Trainer would train one step more."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            state = json.load(f)
        step, max_steps, epochs = int(state["global_step"]), int(state["max_steps"]), float(state["num_train_epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a state the stock Trainer wrote: it resumes (or refuses) as usual
    longer = args.max_steps > step if args.max_steps > 0 else (args.num_train_epochs > epochs or step < max_steps)
    if not longer:
        target = (f"--max_steps {args.max_steps}" if args.max_steps > 0
                  else f"--num_train_epochs {args.num_train_epochs:g}")
        raise ValueError(
            f"The run in {args.output_dir} has finished: its last checkpoint {checkpoint} is at step {step}, the end "
            f"of {target}; resuming would train one step more. Its trained model is in {checkpoint} (and in "
            f"{args.output_dir} once saved). To train on from it, raise --max_steps or --num_train_epochs; to train a "
            "new run, choose another --output_dir or pass --overwrite_output_dir (or train() without "
            "resume_from_checkpoint)."
        )


def has_optimizer_state(checkpoint: str | os.PathLike) -> bool:
    """Whether the stock Trainer finds optimizer state in `checkpoint`: optimizer.pt, or FSDP's optimizer.bin or
    sharded optimizer folder."""
    checkpoint = os.fspath(checkpoint)
    if any(os.path.isfile(os.path.join(checkpoint, name)) for name in ("optimizer.pt", "optimizer.bin")):
        return True
    return any(name.startswith("optimizer") and os.path.isdir(os.path.join(checkpoint, name))
               for name in os.listdir(checkpoint))


def _remove_checkpoint(path: str) -> None:
    """Hide the checkpoint under a staging name first (one rename), then delete it (a later save clears leftovers)."""
    hidden = os.path.join(os.path.dirname(path), DELETING_PREFIX + os.path.basename(path))
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)
