"""A save into a folder that holds a complete save leaves the earlier save or the new one, whatever kills or fails it
(issue 65, item 4): `varsmooth.files.FolderSave` stages the new files beside the old and swaps them in by a journal."""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import signal
import sys

import datasets
import pytest
import torch

from helpers import digits_images, make_args, tiny_digits_resnet
from varsmooth import DiagonalGaussianPosterior, VariationalModel, VariationalTrainer
from varsmooth.files import SAVING_PREFIX, FolderSave, atomic_path, check_manifest, recover
from varsmooth.label_noise.compute import MAGNITUDE_COLUMNS, write_label_noise
from varsmooth.temperature_scaling import TemperatureScaling

#: the audit events (`sys.addaudithook`) by which a save changes files; safetensors and torch write from native code,
#: so a file they write shows as the next event after it
_MUTATIONS = {"open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "shutil.rmtree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
#: what the loading process exits with
_OLD, _NEW, _NEITHER = 10, 11, 12
_USERS_FILE = "notes.txt"


def _context() -> multiprocessing.context.BaseContext:
    # each save and load is a process of its own: forked from a fork server that imported the code once (a fork of
    # pytest itself can deadlock on a lock held by one of its threads, see test_files)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["helpers", "varsmooth"])
    return context


def _run(target, *args) -> int:
    process = _context().Process(target=target, args=args)
    process.start()
    process.join(120)
    if process.is_alive():
        process.kill()
        process.join()
    return process.exitcode


def _save(kind: str, new: bool, folder: str) -> None:
    """The earlier save (`new=False`: with a temperature, or a noise report, that the new one lacks: removed by it)
    or the new one, by `VariationalModel.save_pretrained` or `VariationalTrainer.save_model`."""
    torch.set_num_threads(1)  # the same bytes in every process
    if kind == "save_pretrained":
        model = tiny_digits_resnet(int(new))
        std = {name: torch.full_like(p, 0.02 if new else 0.01) for name, p in model.named_parameters()}
        saved = VariationalModel(model, DiagonalGaussianPosterior(model, std), num_samples=0)  # no BatchNorm draws
        if not new:
            saved.temperature_scaling = TemperatureScaling(1.5)
        saved.save_pretrained(folder)
        return
    from varsmooth.corruption import corrupt_labels

    train, report = corrupt_labels(digits_images(32).with_format(None), "symmetric", 0.2, seed=0, return_report=True)
    args = make_args(os.path.join(os.path.dirname(folder), f"run-{os.getpid()}"), max_steps=1 + int(new),
                     eval_mc_samples=2, learning_rate=0.2, lr_scheduler_type="constant",
                     train_sampling_strategy="sequential", ivon_compiled=False)  # no compile in each process
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.with_format("torch"),
                                 noise_report=None if new else report)
    trainer.train()
    trainer.save_model(folder)


def _touches(event: str, args: tuple, root: str) -> bool:
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        paths = [path] if writes else []
    else:
        dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod") else None
        if dir_fd is not None:  # shutil.rmtree removing by name within a folder it opened: only ours here
            return True
        paths = list(args[:2]) if event == "os.rename" else [args[0]]
    return any(isinstance(p, (str, bytes, os.PathLike)) and (os.path.realpath(os.fsdecode(p)) + os.sep)
               .startswith(root + os.sep) for p in paths)


def _save_killed(kind: str, folder: str, kill_at: int | None, count_file: str | None) -> None:
    """Save the new model into `folder`, SIGKILLed just before the `kill_at`-th change to a file under it (never with
    None: then the number of changes goes to `count_file`)."""
    root, changes = os.path.realpath(folder), 0

    def hook(event: str, args: tuple) -> None:
        nonlocal changes
        if event in _MUTATIONS and _touches(event, args, root):
            changes += 1
            if changes == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    original = VariationalModel.save_pretrained if kind == "save_pretrained" else VariationalTrainer.save_model

    def counted(self, folder, *args, **kwargs):  # the trainer's run writes elsewhere first: count only the save
        sys.addaudithook(hook)
        return original(self, folder, *args, **kwargs)

    setattr(VariationalModel if kind == "save_pretrained" else VariationalTrainer,
            "save_pretrained" if kind == "save_pretrained" else "save_model", counted)
    _save(kind, True, folder)
    if count_file is not None:
        with open(count_file, "w") as f:
            f.write(str(changes))


def _same(a: VariationalModel, b: VariationalModel) -> bool:
    one, other = a.model.state_dict(), b.model.state_dict()
    if one.keys() != other.keys() or not all(torch.equal(one[k], other[k]) for k in one):
        return False
    stds = a.posterior.std, b.posterior.std
    if stds[0].keys() != stds[1].keys() or not all(torch.equal(stds[0][k], stds[1][k]) for k in stds[0]):
        return False
    return (getattr(a.temperature_scaling, "temperature", None) == getattr(b.temperature_scaling, "temperature", None))


def _which_loads(folder: str, old: str, new: str) -> None:
    """Exit with `_OLD` or `_NEW` when `folder` loads as exactly the save in `old` or `new`, else `_NEITHER`."""
    torch.set_num_threads(1)
    loaded = VariationalModel.from_pretrained(folder)
    for reference, code in ((old, _OLD), (new, _NEW)):
        if _same(loaded, VariationalModel.from_pretrained(reference)):
            sys.exit(code)
    sys.exit(_NEITHER)


@pytest.mark.slow  # two processes per step of the save: ~25 s, and ~70 s through the trainer
@pytest.mark.parametrize("kind", ["save_pretrained", "save_model"])
def test_a_save_killed_at_any_step_leaves_the_earlier_save_or_the_new_one(tmp_path, kind):
    old, template = str(tmp_path / "old"), str(tmp_path / "template")
    _save(kind, False, old)
    shutil.copytree(old, template)
    with open(os.path.join(template, _USERS_FILE), "w") as f:
        f.write("the user's own file")
    new, count_file = str(tmp_path / "new"), str(tmp_path / "count")
    shutil.copytree(template, new)
    assert _run(_save_killed, kind, new, None, count_file) == 0
    with open(count_file) as f:
        changes = int(f.read())
    assert changes > 10  # staging, each file, the journal, each move, the stale file, the manifest, the clean-up
    assert _run(_which_loads, new, old, new) == _NEW
    assert _run(_which_loads, old, old, new) == _OLD

    outcomes = []
    for kill_at in range(1, changes + 1):
        folder = str(tmp_path / f"killed-{kill_at}")
        shutil.copytree(template, folder)
        assert _run(_save_killed, kind, folder, kill_at, None) == -signal.SIGKILL
        outcomes.append(_run(_which_loads, folder, old, new))  # a fresh process
        names = os.listdir(folder)
        assert not [n for n in names if n.startswith((SAVING_PREFIX, ".tmp-"))], (kill_at, names)  # recovered
        with open(os.path.join(folder, _USERS_FILE)) as f:
            assert f.read() == "the user's own file"
        shutil.rmtree(folder)
    # the earlier save until the journal is written, the new one from then on: never neither, never back
    committed = outcomes.index(_NEW)
    assert committed > 0 and outcomes == [_OLD] * committed + [_NEW] * (changes - committed), outcomes


@pytest.mark.parametrize("kind", ["save_pretrained", "save_model"])
@pytest.mark.parametrize("failing", ["posterior", "manifest"])
def test_a_full_disk_keeps_the_earlier_save_and_says_so(tmp_path, monkeypatch, kind, failing):
    folder = str(tmp_path / "model")
    _save(kind, False, folder)
    before = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "posterior":  # after the weights were written
        monkeypatch.setattr(DiagonalGaussianPosterior, "save", disk_full)
    else:  # the last write before the save commits
        monkeypatch.setattr("varsmooth.files.write_manifest", disk_full)
    with pytest.raises(OSError, match=r"The disk is full .*: nothing was changed there, its earlier save is as it "
                                      r"was") as raised:
        _save(kind, True, folder)
    assert raised.value.errno == errno.ENOSPC
    assert {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)} == before
    monkeypatch.undo()
    _save(kind, False, str(tmp_path / "again"))
    assert _same(VariationalModel.from_pretrained(folder), VariationalModel.from_pretrained(tmp_path / "again"))


def test_a_full_disk_on_a_first_save_says_nothing_was_written(tmp_path, monkeypatch):
    monkeypatch.setattr(DiagonalGaussianPosterior, "save",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(OSError, match="nothing was changed there, no save was written into it"):
        _save("save_pretrained", True, str(tmp_path / "model"))
    assert os.listdir(tmp_path / "model") == []


def test_a_save_or_write_under_way_is_left_alone_by_a_load(tmp_path):
    """A load while another save is being staged, or a file written, neither breaks it nor sees half of it."""
    folder = str(tmp_path / "model")
    _save("save_pretrained", False, folder)
    before = sorted(os.listdir(folder))
    with FolderSave(folder) as save, atomic_path(os.path.join(folder, "label_noise.parquet")) as tmp:
        with open(os.path.join(save.path, "model.safetensors"), "wb") as f:
            f.write(b"half of the new weights")
        with open(tmp, "wb") as f:
            f.write(b"half an export")
        assert recover(folder) == []  # both are locked by this writer
        check_manifest(folder)
        VariationalModel.from_pretrained(folder)  # the earlier save
        assert os.path.isdir(save.path) and os.path.isfile(tmp)
    # the block ended without finish(): the staged save is discarded, the export written
    assert sorted(os.listdir(folder)) == sorted([*before, "label_noise.parquet"])


def _noise() -> datasets.Dataset:
    return datasets.Dataset.from_dict({name: [0.1, 0.2, 0.3, 0.4] for name in MAGNITUDE_COLUMNS})


def _export_killed_mid_write(folder: str) -> None:
    def half_then_killed(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PAR1, half of it")
        os.kill(os.getpid(), signal.SIGKILL)

    datasets.Dataset.to_parquet = half_then_killed
    write_label_noise(_noise(), folder)


@pytest.mark.parametrize("next_touch", ["export", "load", "save"])
def test_no_temporary_file_outlives_a_killed_export(tmp_path, next_touch):
    folder = str(tmp_path / "run")
    _save("save_pretrained", False, folder)  # the run's model, beside which the label noise is exported
    assert _run(_export_killed_mid_write, folder) == -signal.SIGKILL
    leftovers = [name for name in os.listdir(folder) if name.startswith(".tmp-")]
    assert len(leftovers) == 1 and leftovers[0].endswith("label_noise.parquet")
    if next_touch == "export":
        write_label_noise(_noise(), folder)
        assert datasets.Dataset.from_parquet(os.path.join(folder, "label_noise.parquet")).num_rows == 4
    elif next_touch == "load":
        VariationalModel.from_pretrained(folder)
    else:
        _save("save_pretrained", True, folder)
    assert not [name for name in os.listdir(folder) if name.startswith(".tmp-")]
