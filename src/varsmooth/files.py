"""What varsmooth writes into a model folder, and the manifest that makes a folder whole or detectably incomplete.

A save (`VariationalTrainer._save`, `VariationalModel.save_pretrained`) first removes the folder's manifest, then
writes its files, then removes the varsmooth-owned files of earlier runs that it did not write, and writes the
manifest last: every file of this run with its size. A folder whose manifest is missing was interrupted (or written
by something else); a file that differs in size from its manifest entry was truncated or replaced, and loading
refuses it. The manifest is also the exact list of files `push_to_hub` uploads.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable
from typing import Any

from .utils import atomic_path

__all__ = ["MANIFEST_FILE", "OWNED_PATTERNS", "PRIVATE_FILES", "FolderSave", "add_to_manifest", "check_manifest",
           "is_owned", "read_manifest", "shareable_files", "write_manifest", "written_by_varsmooth"]

MANIFEST_FILE = "varsmooth_manifest.json"
#: files only varsmooth writes: a save removes those of earlier runs that it did not write itself
OWNED_PATTERNS = ("posterior.safetensors", "noise_report.json", "label_noise*.parquet", "label_noise*_summary.json",
                  "label_noise*.png", "temperature_scaling.json", "ensemble_config.json", MANIFEST_FILE)
#: written by a save but never shared: the Trainer's pickled arguments may hold paths and tokens
PRIVATE_FILES = frozenset({"training_args.bin", MANIFEST_FILE})

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


def check_manifest(folder: str | os.PathLike) -> None:
    """Refuse a folder whose files differ from its manifest (a save that did not finish, a file truncated or
    replaced afterwards). A folder without manifest passes: it was not written by a varsmooth save."""
    folder = os.fspath(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return
    for name, entry in manifest["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"{path} is missing, but {MANIFEST_FILE} lists it: the folder is incomplete. Save the model "
                             "again (trainer.save_model()) or copy the whole folder.")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise ValueError(f"{path} has {size} bytes but {MANIFEST_FILE} records {entry['size']}: it was truncated or "
                             "replaced after the save. Save the model again (trainer.save_model()).")


def shareable_files(folder: str | os.PathLike) -> list[str]:
    """The files of `folder`'s manifest that may be uploaded (all but the private ones)."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{os.fspath(folder)} has no {MANIFEST_FILE}: save the model first (trainer.save_model()).")
    return sorted(name for name in manifest["files"] if name not in PRIVATE_FILES)


def is_owned(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in OWNED_PATTERNS)


class FolderSave:
    """One save into `folder`: `begin()` before writing, `finish(also=...)` after (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = os.fspath(folder)
        self.previous: dict[str, Any] | None = None
        self._before: dict[str, _Stat] = {}

    def begin(self) -> "FolderSave":
        try:
            self.previous = read_manifest(self.folder)
        except ValueError:  # unreadable: this save replaces it; owned files of earlier runs still go
            self.previous = None
        manifest = os.path.join(self.folder, MANIFEST_FILE)
        if os.path.isfile(manifest):
            os.remove(manifest)  # from here until finish() the folder is detectably incomplete
        self._before = _stats(self.folder)
        return self

    def finish(self, also: Iterable[str] = (), **info: Any) -> list[str]:
        """Remove the earlier runs' files that this save did not write, write the manifest; returns the stale names
        removed. `also`: files this run wrote into the folder before the save (e.g. the label noise)."""
        after = _stats(self.folder)
        written = {name for name, stat in after.items() if self._before.get(name) != stat}
        written |= {name for name in also if name in after}
        written.discard(MANIFEST_FILE)
        earlier = (self.previous or {}).get("files", {})
        # an earlier run's file changed since its save (e.g. a card you edited) is yours now: kept
        unchanged = {name for name, entry in earlier.items() if name in after and after[name][2] == entry.get("size")}
        stale = sorted(name for name in after if name not in written and name != MANIFEST_FILE
                       and (name in unchanged or is_owned(name)))
        for name in stale:
            os.remove(os.path.join(self.folder, name))
        write_manifest(self.folder, sorted(written), **info)
        return stale


def write_manifest(folder: str, names: Iterable[str], **info: Any) -> None:
    files = {name: {"size": os.path.getsize(os.path.join(folder, name))} for name in names}
    with atomic_path(os.path.join(folder, MANIFEST_FILE)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": 1, **info, "files": files}, f, indent=2)


def add_to_manifest(folder: str | os.PathLike, names: Iterable[str]) -> None:
    """Record files written into a finished folder after its save (the model card)."""
    folder = os.fspath(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return
    info = {k: v for k, v in manifest.items() if k not in ("format", "files")}
    write_manifest(folder, sorted(set(manifest["files"]) | set(names)), **info)


def written_by_varsmooth(folder: str | os.PathLike, name: str) -> bool:
    """Whether `folder/name` is, unchanged, a file a varsmooth save recorded in the manifest."""
    manifest = read_manifest(folder)
    path = os.path.join(os.fspath(folder), name)
    entry = (manifest or {}).get("files", {}).get(name)
    return entry is not None and os.path.isfile(path) and os.path.getsize(path) == entry["size"]
