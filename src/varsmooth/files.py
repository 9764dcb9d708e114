"""What varsmooth writes into a model folder, and the manifest that makes a folder whole or detectably changed.

A save (`VariationalTrainer._save`, `VariationalModel.save_pretrained`) first marks the folder's manifest as a save in
progress (`SAVE_IN_PROGRESS_KEY`, keeping the earlier save's entries), then writes its files, then removes the files
of the earlier save that it did not write again, and writes the manifest last: every file of this save with its size
and SHA-256. Only a file that the earlier manifest lists, and that still has the recorded hash, is ever removed; any
other file in the folder (yours, or one you edited since) is kept. A folder whose manifest still marks a save in
progress was interrupted mid-save (killed between the weights and the posterior, say): loading refuses it as an
incomplete save; a folder without manifest was written by something else. A file whose size or hash differs from its
manifest entry was truncated, edited or replaced, and loading refuses it before reading any weights. The manifest is
also the exact list of files `push_to_hub` uploads. Checkpoints: `varsmooth.trainer.checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["CHECKPOINT_PREFIX", "DELETING_PREFIX", "MANIFEST_FILE", "METHOD_STATE_FILE", "OWNED_PATTERNS",
           "PRIVATE_FILES", "SAVE_IN_PROGRESS_KEY", "STAGING_PREFIX", "TEMP_PREFIX", "FolderSave", "add_to_manifest",
           "atomic_path", "check_manifest", "clear_leftovers", "file_sha256", "is_leftover", "ordinary_file_mode",
           "read_manifest", "shareable_files", "write_manifest", "written_by_varsmooth"]

MANIFEST_FILE = "varsmooth_manifest.json"
#: names of files only varsmooth writes: a push deletes those of earlier pushes from the Hub repo
OWNED_PATTERNS = ("posterior.safetensors", "noise_report.json", "label_noise*.parquet", "label_noise*_summary.json",
                  "label_noise*.png", "temperature_scaling.json", "ensemble_config.json", MANIFEST_FILE)
#: written by a save but never shared: the Trainer's pickled arguments may hold paths and tokens
PRIVATE_FILES = frozenset({"training_args.bin", MANIFEST_FILE})
#: checkpoint file with the training method's own state (OLS soft labels, ALASCA EMAs, ...)
METHOD_STATE_FILE = "method_state.pt"
#: `atomic_path` writes under this prefix, then renames
TEMP_PREFIX = ".tmp-"
#: the name of a checkpoint folder before its step (`transformers.trainer_utils.PREFIX_CHECKPOINT_DIR`, which
#: test_files checks it equals: the posterior's files must not import transformers)
CHECKPOINT_PREFIX = "checkpoint"
#: a checkpoint is written under this prefix and renamed to `checkpoint-N` when complete; `get_last_checkpoint`
#: and checkpoint rotation match only names that start with `checkpoint-`
STAGING_PREFIX = ".partial-"
#: an old checkpoint is renamed under this prefix, then deleted
DELETING_PREFIX = ".deleting-"
#: what `atomic_path` (mkstemp's 8 random characters), a checkpoint being written and one being deleted are named
_LEFTOVER = re.compile(rf"^({re.escape(TEMP_PREFIX)}[a-z0-9_]{{8}}.+|"
                       rf"({re.escape(STAGING_PREFIX)}|{re.escape(DELETING_PREFIX)})"
                       rf"{re.escape(CHECKPOINT_PREFIX)}-\d+)$")
#: set in a manifest from the start of a save to its end: a folder whose manifest still has it holds an incomplete save
SAVE_IN_PROGRESS_KEY = "save_in_progress"

_Stat = tuple[int, int, int]


def _stats(folder: str) -> dict[str, _Stat]:
    if not os.path.isdir(folder):
        return {}
    out = {}
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            out[entry.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def ordinary_file_mode() -> int:
    """The permissions `open(path, "w")` gives a new file under the process's umask (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path in the same folder; on success it replaces `path` in one rename.

    A crash while writing leaves the previous file (or none), never half a file.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=os.path.basename(path))
    os.close(fd)
    try:
        yield tmp
        # mkstemp creates the file private (0600); give it the permissions an ordinary write would have
        os.chmod(tmp, ordinary_file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (~0.4 s per GB on one CPU core)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of `folder`, or None when it has none."""
    path = os.path.join(os.fspath(folder), MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' mapping")
    except ValueError as error:
        raise ValueError(f"{path} is not a valid varsmooth manifest ({error}). Save the model again.") from None
    return manifest


def _matches(path: str, entry: dict[str, Any]) -> bool:
    """Whether the file at `path` is the one a manifest entry recorded (size, then SHA-256 when recorded)."""
    if not os.path.isfile(path) or os.path.getsize(path) != entry.get("size"):
        return False
    return "sha256" not in entry or file_sha256(path) == entry["sha256"]  # manifests of varsmooth < 0.2: size only


def check_manifest(folder: str | os.PathLike, names: Iterable[str] | None = None) -> None:
    """Refuse a folder whose files differ from its manifest (a save that did not finish, a file truncated, edited or
    replaced afterwards), naming every such file; `names`: check only these (those the manifest lists). A folder
    without manifest passes: it was not written by a varsmooth save. Cheap checks (presence, size) come first."""
    folder = os.fspath(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return
    _refuse_incomplete_save(folder, manifest)
    entries = manifest["files"]
    wanted = sorted(entries) if names is None else sorted(set(names) & set(entries))
    missing = [name for name in wanted if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ValueError(f"{folder} lacks {missing}, which its {MANIFEST_FILE} lists: the folder is incomplete. Save "
                         "the model again (trainer.save_model()) or copy the whole folder.")
    resized = {name: (os.path.getsize(os.path.join(folder, name)), entries[name]["size"]) for name in wanted
               if os.path.getsize(os.path.join(folder, name)) != entries[name]["size"]}
    if resized:
        sizes = ", ".join(f"{name} has {got} bytes, recorded {want}" for name, (got, want) in resized.items())
        raise ValueError(f"Files of {folder} differ in size from its {MANIFEST_FILE} ({sizes}): they were truncated or "
                         "replaced after the save. Save the model again (trainer.save_model()) or copy the whole "
                         "folder.")
    edited = [name for name in wanted if not _matches(os.path.join(folder, name), entries[name])]
    if edited:
        raise ValueError(f"Files of {folder} differ from the ones its save wrote (their SHA-256 is not the one "
                         f"{MANIFEST_FILE} records): {edited}. They were edited or replaced after the save, and would "
                         "load as another model than the one trained. Save the model again (trainer.save_model()), or "
                         "copy the whole folder from where it was saved.")


def _refuse_incomplete_save(folder: str, manifest: dict[str, Any]) -> None:
    if manifest.get(SAVE_IN_PROGRESS_KEY):
        raise ValueError(
            f"{folder} holds an incomplete save: its {MANIFEST_FILE} says a save into it started and never finished "
            "(the process was killed or failed while writing, e.g. between the weights and the posterior), so its "
            "files may mix that save with an earlier one. Save the model again (trainer.save_model()), or resume from "
            "the last complete checkpoint."
        )


def shareable_files(folder: str | os.PathLike, training_state: bool = False) -> list[str]:
    """The files of `folder`'s manifest that may be uploaded (all but the private ones); a checkpoint's training state
    (optimizer, scheduler, RNG states: its manifest's `training_state`) only with `training_state=True`."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{os.fspath(folder)} has no {MANIFEST_FILE}: save the model first (trainer.save_model()).")
    _refuse_incomplete_save(os.fspath(folder), manifest)
    skip = PRIVATE_FILES | (set() if training_state else set(manifest.get("training_state", ())))
    return sorted(name for name in manifest["files"] if name not in skip)


class FolderSave:
    """One save into `folder`: `begin()` before writing, `finish(also=...)` after (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = os.fspath(folder)
        self.previous: dict[str, Any] | None = None
        self._before: dict[str, _Stat] = {}

    def begin(self) -> "FolderSave":
        try:
            self.previous = read_manifest(self.folder)
        except ValueError:  # unreadable: nothing is known to be varsmooth's, so nothing is removed
            self.previous = None
        clear_leftovers(self.folder)
        # from here until finish() the folder is detectably incomplete; the earlier entries stay, so that the save
        # after an interrupted one still knows which files were varsmooth's
        os.makedirs(self.folder, exist_ok=True)
        with atomic_path(os.path.join(self.folder, MANIFEST_FILE)) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({**(self.previous or {"format": 2, "files": {}}), SAVE_IN_PROGRESS_KEY: True}, f, indent=2)
        self._before = _stats(self.folder)
        return self

    def finish(self, also: Iterable[str] = (), **info: Any) -> list[str]:
        """Remove the earlier save's files that this save did not write, write the manifest; returns the names
        removed. `also`: files this run wrote into the folder before the save (e.g. the label noise)."""
        after = _stats(self.folder)
        written = {name for name, stat in after.items() if self._before.get(name) != stat}
        written |= {name for name in also if name in after}
        written.discard(MANIFEST_FILE)
        earlier = (self.previous or {}).get("files", {})
        # only a file the earlier manifest lists, unchanged since (same hash): one edited since (e.g. your card) is
        # yours
        stale = sorted(name for name, entry in earlier.items() if name not in written and name != MANIFEST_FILE
                       and os.sep not in name and _matches(os.path.join(self.folder, name), entry))
        for name in stale:
            os.remove(os.path.join(self.folder, name))
        mode = ordinary_file_mode()  # transformers writes model.safetensors private (0600), the rest by the umask
        for name in written:
            os.chmod(os.path.join(self.folder, name), mode)
        write_manifest(self.folder, sorted(written), **info)
        return stale


def write_manifest(folder: str, names: Iterable[str], entries: dict[str, dict[str, Any]] | None = None,
                   **info: Any) -> None:
    """Write `folder`'s manifest listing `names` (hashed now; those in `entries` keep the entry given)."""
    entries = entries or {}
    files = {name: entries.get(name) or {"size": os.path.getsize(os.path.join(folder, name)),
                                         "sha256": file_sha256(os.path.join(folder, name))} for name in names}
    with atomic_path(os.path.join(folder, MANIFEST_FILE)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": 2, **info, "files": files}, f, indent=2)


def add_to_manifest(folder: str | os.PathLike, names: Iterable[str], **info: Any) -> None:
    """Record files written into a finished folder after its save (the model card), and `info`; the other entries
    stay as recorded, so that a file edited since its save is still detected."""
    folder = os.fspath(folder)
    manifest = read_manifest(folder)
    if manifest is None or manifest.get(SAVE_IN_PROGRESS_KEY):  # nothing to add to: the save did not finish
        return
    names = set(names)
    info = {**{k: v for k, v in manifest.items() if k not in ("format", "files")}, **info}
    kept = {name: entry for name, entry in manifest["files"].items() if name not in names}
    write_manifest(folder, sorted(set(kept) | names), entries=kept, **info)


def written_by_varsmooth(folder: str | os.PathLike, name: str) -> bool:
    """Whether `folder/name` is, byte for byte, a file a varsmooth save recorded in the manifest."""
    entry = ((read_manifest(folder) or {}).get("files", {})).get(name)
    return entry is not None and _matches(os.path.join(os.fspath(folder), name), entry)


def is_leftover(name: str) -> bool:
    """Whether `name` is what a killed save, export or checkpoint leaves: a temporary file of `atomic_path`, a
    checkpoint being written (`STAGING_PREFIX`) or deleted (`DELETING_PREFIX`). Never a user's file or
    `checkpoint-N`."""
    return bool(_LEFTOVER.match(name))


def clear_leftovers(folder: str | os.PathLike) -> list[str]:
    """Delete what a killed run left in `folder` (`is_leftover`); returns the names deleted. Call it only while no
    save into `folder` is under way."""
    folder = os.fspath(folder)
    found = sorted(name for name in os.listdir(folder) if is_leftover(name)) if os.path.isdir(folder) else []
    for name in found:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return found
