"""What varsmooth writes into a model folder, and the manifest that makes a folder whole or detectably changed.

A save (`VariationalTrainer._save`, `VariationalModel.save_pretrained`, `with FolderSave(folder) as save`) writes its
files beside the earlier save, into a staging folder inside the model folder (`SAVING_PREFIX`, on the same filesystem),
together with the new manifest: every file of this save with its size and SHA-256. Then it commits: it writes a
journal into the staging folder (whole or not at all) listing the moves, moves each staged file into place by one
rename, removes the files of the earlier save that it did not write again, moves the manifest into place last and
deletes the staging folder, journal included. A failed write (a full disk) before the journal discards the staging
folder at once, and a kill leaves it for whoever next touches the folder (a save, a load, `check_manifest`,
`shareable_files`: `recover`) to discard: the earlier save stays as it was. A kill after the journal leaves the moves
to that next one, who completes them from the staged files first. So a folder that held a complete save always loads as
the earlier save or the new one. The temporary file of a killed `atomic_path` write (an export) is deleted by the next
write, save or load in its folder. A staging folder or temporary file that a live process is still writing is locked
by it (`flock`) and left alone; on a filesystem without locks, only a save (which owns the folder) discards unfinished
work.

Only a file that the earlier manifest lists, and that still has the recorded hash, is ever removed; any other file in
the folder (yours, or one you edited since) is kept. A folder without manifest was written by something else. A file
whose size or hash differs from its manifest entry was truncated, edited or replaced, and loading refuses it before
reading any weights; so is a manifest that marks a save in progress (`SAVE_IN_PROGRESS_KEY`, written by the in-place
saves of earlier varsmooth versions). The manifest is also the exact list of files `push_to_hub` uploads. Checkpoints:
`varsmooth.trainer.checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, so whether a leftover's writer still runs cannot be told
    fcntl = None

__all__ = ["CHECKPOINT_PREFIX", "DELETING_PREFIX", "JOURNAL_FILE", "MANIFEST_FILE", "METHOD_STATE_FILE",
           "OWNED_PATTERNS", "PRIVATE_FILES", "SAVE_IN_PROGRESS_KEY", "SAVING_PREFIX", "STAGING_PREFIX", "TEMP_PREFIX",
           "FolderSave", "add_to_manifest", "atomic_path", "check_manifest", "clear_leftovers", "file_sha256",
           "is_leftover", "ordinary_file_mode", "read_manifest", "recover", "shareable_files", "write_manifest",
           "written_by_varsmooth"]

#: the manifest of a model folder: every file of its last save with its size and SHA-256 (the module docstring says how)
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
#: a save writes its files into a folder of this name (and mkdtemp's 8 characters) inside the model folder
SAVING_PREFIX = ".saving-"
#: in a save's staging folder: the moves that complete the save; once it exists the save is committed
JOURNAL_FILE = "journal.json"
#: the name of a checkpoint folder before its step (`transformers.trainer_utils.PREFIX_CHECKPOINT_DIR`, which
#: test_files checks it equals: the posterior's files must not import transformers)
CHECKPOINT_PREFIX = "checkpoint"
#: a checkpoint is written under this prefix and renamed to `checkpoint-N` when complete; `get_last_checkpoint`
#: and checkpoint rotation match only names that start with `checkpoint-`
STAGING_PREFIX = ".partial-"
#: an old checkpoint is renamed under this prefix, then deleted
DELETING_PREFIX = ".deleting-"
#: what `atomic_path` (mkstemp's 8 random characters), a save being written, a checkpoint being written and one
#: being deleted are named
_TEMP = re.compile(rf"^{re.escape(TEMP_PREFIX)}[a-z0-9_]{{8}}.+$")
_SAVING = re.compile(rf"^{re.escape(SAVING_PREFIX)}[a-z0-9_]{{8}}$")
_CHECKPOINT_LEFTOVER = re.compile(rf"^({re.escape(STAGING_PREFIX)}|{re.escape(DELETING_PREFIX)})"
                                  rf"{re.escape(CHECKPOINT_PREFIX)}-\d+$")
#: set in a manifest by the in-place saves of earlier varsmooth versions from the start of a save to its end: a
#: folder whose manifest still has it holds an incomplete save
SAVE_IN_PROGRESS_KEY = "save_in_progress"


def ordinary_file_mode() -> int:
    """The permissions `open(path, "w")` gives a new file under the process's umask (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _lock(fd: int, wait: bool = False) -> bool | None:
    """Lock `fd` exclusively (`flock`): True when locked, False when another process holds it, None when the
    filesystem cannot tell (no `fcntl`; NFS refuses it on a directory, Lustre without `-o flock` on anything)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


@contextlib.contextmanager
def _abandoned(path: str, wait: bool = False) -> Iterator[bool | None]:
    """Whether the process that wrote leftover `path` (an `atomic_path` file, a save's staging folder) is gone: it
    held the lock while writing, and the kernel released it with the process. The lock is held here until the block
    ends, so that the leftover is not taken over again meanwhile. `wait`: until its writer finishes. None: cannot
    tell (no locks, see `_lock`), also when it is not ours to open."""
    if fcntl is None:
        yield None
        return
    try:
        fd = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDWR)
    except FileNotFoundError:
        yield False  # gone: its writer finished (or another process removed it)
        return
    except OSError:
        yield None
        return
    try:
        locked = _lock(fd, wait)
        # its writer may have finished and removed it before releasing the lock
        yield locked and os.path.lexists(path) and os.path.samestat(os.fstat(fd), os.lstat(path))
    finally:
        os.close(fd)


def _held(fd: int) -> int | None:
    """`fd` of a file or folder just made, locked, to be held open while it is written; None (and closed) where there
    are no locks: nothing to hold open then (Windows could not rename an open file). Waits while a `recover` that
    found it holds it (see `FolderSave.__enter__`)."""
    if _lock(fd, wait=True) is None:
        os.close(fd)
        return None
    return fd


def _release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path in the same folder; on success it replaces `path` in one rename.

    A crash while writing leaves the previous file (or none), never half a file; its temporary file is locked while it
    is written, so that the next write into the folder deletes it once its writer is gone (`recover`).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _clear_temp_files(folder, saving=False)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=os.path.basename(path))
    lock = _held(fd)
    try:
        yield tmp
        # mkstemp creates the file private (0600); give it the permissions an ordinary write would have
        os.chmod(tmp, ordinary_file_mode())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)  # still there only when the write failed
        _release(lock)


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
    """Refuse a folder whose files differ from its manifest (a file truncated, edited or replaced after the save, a
    save of an earlier varsmooth version that did not finish), naming every such file; `names`: check only these (those
    the manifest lists). A save killed in `folder` is completed or discarded first (`recover`). A folder without
    manifest passes: it was not written by a varsmooth save. Cheap checks (presence, size) come first."""
    folder = os.fspath(folder)
    recover(folder)
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
            "(an earlier varsmooth version, which saved in place, was killed or failed while writing, e.g. between the "
            "weights and the posterior), so its files may mix that save with an earlier one. Save the model again "
            "(trainer.save_model()), or resume from the last complete checkpoint."
        )


def shareable_files(folder: str | os.PathLike, training_state: bool = False) -> list[str]:
    """The files of `folder`'s manifest that may be uploaded (all but the private ones); a checkpoint's training state
    (optimizer, scheduler, RNG states: its manifest's `training_state`) only with `training_state=True`. A save
    killed in `folder` is completed or discarded first (`recover`)."""
    recover(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{os.fspath(folder)} has no {MANIFEST_FILE}: save the model first (trainer.save_model()).")
    _refuse_incomplete_save(os.fspath(folder), manifest)
    skip = PRIVATE_FILES | (set() if training_state else set(manifest.get("training_state", ())))
    return sorted(name for name in manifest["files"] if name not in skip)


class FolderSave:
    """One save into `folder`, written beside the earlier one and swapped in (see the module docstring)::

        with FolderSave(folder) as save:
            model.save_pretrained(save.path)  # every file of the save, into the staging folder
            save.finish(method="ivon")

    Leaving the block without `finish` (an error) discards the staging folder: `folder` is as it was. On a full disk
    the error says so (an `OSError` with `errno.ENOSPC`)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = os.fspath(folder)
        self.path = ""  #: the staging folder the save writes into, from entering the block on
        self.previous: dict[str, Any] | None = None  #: the earlier save's manifest
        self._lock: int | None = None  # on the staging folder, held until it is committed or discarded
        self._committed = False

    def __enter__(self) -> "FolderSave":
        os.makedirs(self.folder, exist_ok=True)
        clear_leftovers(self.folder)  # a killed save that had committed is completed first: it is the earlier save
        try:
            self.previous = read_manifest(self.folder)
        except ValueError:  # unreadable: nothing is known to be varsmooth's, so nothing is removed
            self.previous = None
        while not self.path:
            path = tempfile.mkdtemp(prefix=SAVING_PREFIX, dir=self.folder)
            lock = None if fcntl is None else _held(os.open(path, os.O_RDONLY))
            # a load that listed the folder between mkdtemp and the lock may have taken it for a killed save's and
            # removed it: then make another
            if lock is None or (os.path.isdir(path) and os.path.samestat(os.fstat(lock), os.stat(path))):
                self.path, self._lock = path, lock
            else:
                _release(lock)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if self._committed:  # finished, or to be completed by the next to touch the folder
            _release(self._lock)
            return
        shutil.rmtree(self.path, ignore_errors=True)
        _release(self._lock)
        if error is not None and _disk_full(error):
            kept = "its earlier save is as it was" if self.previous is not None else "no save was written into it"
            raise OSError(errno.ENOSPC, f"The disk is full (no space left on device) while saving to {self.folder}: "
                                        f"nothing was changed there, {kept}. Free some space (or save elsewhere) and "
                                        f"save again.") from error

    def finish(self, also: Iterable[str] = (), **info: Any) -> list[str]:
        """Commit the files written into `path`: move them into the folder, remove the earlier save's files that this
        save did not write, and put the manifest (with `info`) in place last; returns the names removed. `also`:
        files this run wrote into the folder itself before the save (e.g. the label noise), listed in the manifest
        too."""
        staged = sorted(os.path.relpath(os.path.join(root, name), self.path)
                        for root, _, names in os.walk(self.path) for name in names)
        mode = ordinary_file_mode()  # transformers writes model.safetensors private (0600), the rest by the umask
        for name in staged:
            os.chmod(os.path.join(self.path, name), mode)
        # the manifest lists the folder's own files; a subfolder a writer made (a peft adapter's) moves in unlisted
        entries = {name: _entry(os.path.join(self.path, name)) for name in staged if os.sep not in name}
        entries.update({name: _entry(os.path.join(self.folder, name)) for name in also
                        if name not in entries and os.path.isfile(os.path.join(self.folder, name))})
        earlier = (self.previous or {}).get("files", {})
        stale = {name: entry for name, entry in earlier.items()
                 if name not in entries and name != MANIFEST_FILE and os.sep not in name}
        write_manifest(self.path, sorted(entries), entries=entries, **info)
        # whole or absent: a save killed before this line is discarded by the next one to touch the folder, one killed
        # after it completed
        with atomic_path(os.path.join(self.path, JOURNAL_FILE)) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({"moves": staged, "stale": stale}, f, indent=2)
        self._committed = True
        return _complete(self.folder, self.path)


def _disk_full(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, says the disk (or the user's quota) is full; safetensors' and
    other libraries' errors carry the system's message only."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))):
            return True
        error = error.__cause__ or error.__context__
    return False


def _complete(folder: str, staging: str) -> list[str]:
    """Carry out the journal of the committed save staged in `staging` (after a kill, the steps not yet done; every
    step is safe to repeat): move the staged files into `folder`, remove the earlier save's files that the save did not
    write (those unchanged since), move the manifest in last and delete the staging folder. Returns the names
    removed."""
    with open(os.path.join(staging, JOURNAL_FILE), encoding="utf-8") as f:
        journal = json.load(f)
    for name in journal["moves"]:
        target = os.path.join(folder, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # moved before a kill
            os.replace(os.path.join(staging, name), target)
    removed = sorted(name for name, entry in journal["stale"].items() if _matches(os.path.join(folder, name), entry))
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    with contextlib.suppress(FileNotFoundError):
        os.replace(os.path.join(staging, MANIFEST_FILE), os.path.join(folder, MANIFEST_FILE))
    shutil.rmtree(staging, ignore_errors=True)
    return removed


def _entry(path: str) -> dict[str, Any]:
    return {"size": os.path.getsize(path), "sha256": file_sha256(path)}


def write_manifest(folder: str, names: Iterable[str], entries: dict[str, dict[str, Any]] | None = None,
                   **info: Any) -> None:
    """Write `folder`'s manifest listing `names` (hashed now; those in `entries` keep the entry given)."""
    entries = entries or {}
    files = {name: entries.get(name) or _entry(os.path.join(folder, name)) for name in names}
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
    """Whether `name` is what a killed save, export or checkpoint leaves: a temporary file of `atomic_path`, a save's
    staging folder (`SAVING_PREFIX`), a checkpoint being written (`STAGING_PREFIX`) or deleted (`DELETING_PREFIX`).
    Never a user's file or `checkpoint-N`."""
    return any(pattern.match(name) for pattern in (_TEMP, _SAVING, _CHECKPOINT_LEFTOVER))


def recover(folder: str | os.PathLike, saving: bool = False) -> list[str]:
    """Finish what killed processes left in `folder`: a save killed after its journal was written is completed from
    its staged files, one killed before is discarded (the earlier save stays), the temporary files of killed writes
    are deleted; returns their names. What a live process is still writing (it holds the lock) is left alone, and a
    committed save waited for. Where the filesystem cannot tell (no locks), only a save (`saving=True`: it owns the
    folder) discards unfinished work."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    done = []
    for name in sorted(name for name in os.listdir(folder) if _SAVING.match(name)):
        staging = os.path.join(folder, name)
        journal = os.path.join(staging, JOURNAL_FILE)
        with _abandoned(staging, wait=os.path.isfile(journal)) as abandoned:
            committed = os.path.isfile(journal)  # again: its writer may have committed and finished meanwhile
            if abandoned or (abandoned is None and (committed or saving)):  # completing twice is harmless
                if committed:
                    with contextlib.suppress(FileNotFoundError):  # completed by its writer meanwhile
                        _complete(folder, staging)
                else:
                    shutil.rmtree(staging, ignore_errors=True)
                done.append(name)
    return done + _clear_temp_files(folder, saving)


def _clear_temp_files(folder: str, saving: bool) -> list[str]:
    """Delete the temporary files that killed `atomic_path` writes left in `folder` (see `recover`)."""
    found = []
    for name in sorted(name for name in os.listdir(folder) if _TEMP.match(name)):
        path = os.path.join(folder, name)
        with _abandoned(path) as abandoned:
            if abandoned or (abandoned is None and saving):
                _remove(path)
                found.append(name)
    return found


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def clear_leftovers(folder: str | os.PathLike) -> list[str]:
    """Delete what a killed run left in `folder` (`is_leftover`), completing a save killed after it committed
    (`recover`); returns the names. Call it only while no checkpoint is being written into `folder`."""
    folder = os.fspath(folder)
    found = recover(folder, saving=True)
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if _CHECKPOINT_LEFTOVER.match(name):
                _remove(os.path.join(folder, name))
                found.append(name)
    return sorted(found)
