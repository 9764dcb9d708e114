"""Nothing lost, nothing stale: saves, loads, resumes and checkpoints keep weights and posterior together."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import signal

import datasets
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from helpers import TinyClassifier, digits_dataset, digits_images, make_args, tiny_digits_resnet
from varsmooth import (
    POSTERIOR_FILE,
    DiagonalGaussianPosterior,
    LabelNoiseCallback,
    VariationalModel,
    VariationalTrainer,
)
from varsmooth.corruption import corrupt_labels
from varsmooth.files import MANIFEST_FILE, add_to_manifest

IVON = dict(learning_rate=0.2, beta2=0.99, lr_scheduler_type="constant", train_sampling_strategy="sequential")


def _train_ivon(out, model=None, steps: int = 3, **kw) -> VariationalTrainer:
    args = make_args(out, max_steps=steps, eval_mc_samples=2, **{**IVON, **kw})
    trainer = VariationalTrainer(model=model if model is not None else tiny_digits_resnet(), args=args,
                                 train_dataset=digits_images(64))
    trainer.train()
    return trainer


# -- 1. a posterior is bound to its weights; a save removes the earlier run's files; a folder is whole ---------------
def test_erm_run_in_a_reused_folder_leaves_nothing_of_the_ivon_run(tmp_path):
    out = tmp_path / "model"
    train, report = corrupt_labels(digits_images(64).with_format(None), "symmetric", 0.2, seed=0, return_report=True)
    train = train.with_format("torch")
    ivon_args = make_args(out, max_steps=2, eval_mc_samples=2, **IVON)
    ivon = VariationalTrainer(model=tiny_digits_resnet(), args=ivon_args, train_dataset=train, noise_report=report,
                              callbacks=[LabelNoiseCallback(num_samples=2)])
    ivon.train()
    ivon.save_model()
    stale = {POSTERIOR_FILE, "label_noise.parquet", "label_noise_summary.json", "noise_report.json"}
    assert stale <= set(os.listdir(out))
    (out / "my_notes.txt").write_text("the user's own file")

    erm = VariationalTrainer(model=tiny_digits_resnet(1), args=make_args(out, method="erm", max_steps=2),
                             train_dataset=digits_images(64))
    erm.train()
    erm.save_model()
    assert not stale & set(os.listdir(out))
    assert (out / "my_notes.txt").read_text() == "the user's own file"  # not varsmooth's: kept, and not in the manifest
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert (manifest["method"] == "erm" and "model.safetensors" in manifest["files"]
            and "my_notes.txt" not in manifest["files"])
    with pytest.warns(UserWarning, match="Predicting at the posterior mean"):
        VariationalModel.from_pretrained(out)


def test_a_save_removes_earlier_files_it_did_not_write_unless_they_were_edited(tmp_path):
    model = tiny_digits_resnet()
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()})
    VariationalModel(model, posterior).save_pretrained(tmp_path)
    for name in ("README.md", "tokenizer.json"):  # as if the earlier run had also written these
        (tmp_path / name).write_text("{}")
    add_to_manifest(tmp_path, ["README.md", "tokenizer.json"])
    with open(tmp_path / "README.md", "a") as f:
        f.write("edited by hand")
    VariationalModel(model, DiagonalGaussianPosterior.point_mass(model)).save_pretrained(tmp_path)  # no posterior now
    assert sorted(os.listdir(tmp_path)) == sorted(["README.md", "config.json", MANIFEST_FILE, "model.safetensors"])


def test_posterior_of_replaced_weights_is_refused(tmp_path):
    trainer = _train_ivon(tmp_path / "run")
    trainer.save_model(str(tmp_path / "model"))
    VariationalModel.from_pretrained(tmp_path / "model")  # the pair as saved loads
    tiny_digits_resnet(5).save_pretrained(tmp_path / "model")  # new weights of the same size, beside the old σ
    with pytest.raises(ValueError, match="truncated or replaced after the save"):  # the manifest notices first
        VariationalModel.from_pretrained(tmp_path / "model")
    os.remove(tmp_path / "model" / MANIFEST_FILE)  # the fingerprint alone is enough
    with pytest.raises(ValueError, match=r"posterior.safetensors belongs to other weights"):
        VariationalModel.from_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="fingerprint"):
        DiagonalGaussianPosterior.load(tiny_digits_resnet(5), tmp_path / "model")


@pytest.mark.parametrize("earlier_save", [True, False], ids=["over-an-earlier-save", "into-a-new-folder"])
def test_save_failing_between_weights_and_posterior_keeps_the_earlier_save(tmp_path, monkeypatch, earlier_save):
    trainer = _train_ivon(tmp_path / "run", steps=2)
    out = tmp_path / "model"
    if earlier_save:
        trainer.save_model(str(out))
        before = {name: (out / name).read_bytes() for name in os.listdir(out)}
        trainer.args.max_steps = 4
        trainer.train(resume_from_checkpoint=None)  # the weights move on
    real_save = DiagonalGaussianPosterior.save
    monkeypatch.setattr(DiagonalGaussianPosterior, "save", lambda self, *args: (_ for _ in ()).throw(OSError("failed")))
    with pytest.raises(OSError, match="failed"):
        trainer.save_model(str(out))  # after the weights were written
    if earlier_save:  # the earlier save, as it was, and nothing of the failed one
        assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
        VariationalModel.from_pretrained(out)
    else:
        assert os.listdir(out) == []
        with pytest.raises(ValueError, match="holds no saved model: it is empty"):
            VariationalModel.from_pretrained(out)
    monkeypatch.setattr(DiagonalGaussianPosterior, "save", real_save)
    trainer.save_model(str(out))  # the next save completes the folder
    assert VariationalModel.from_pretrained(out).posterior.names


def test_file_changed_after_the_save_is_refused(tmp_path):
    train, report = corrupt_labels(digits_images(64).with_format(None), "symmetric", 0.2, seed=0, return_report=True)
    args = make_args(tmp_path, max_steps=2, eval_mc_samples=2, **IVON)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.with_format("torch"),
                                 noise_report=report)
    trainer.train()
    trainer.save_model()
    with open(tmp_path / "noise_report.json", "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"noise_report.json has \d+ bytes, recorded \d+\): they were truncated"):
        VariationalModel.from_pretrained(tmp_path)
    os.remove(tmp_path / "noise_report.json")
    with pytest.raises(ValueError, match=r"lacks \['noise_report.json'\], which its varsmooth_manifest.json lists"):
        VariationalModel.from_pretrained(tmp_path)


# -- 2. incomplete posteriors refuse to load ----------------------------------------------------------------------
@pytest.fixture
def saved_posterior(tmp_path):
    model = TinyClassifier()
    std = {name: torch.full_like(p, 0.05) for name, p in model.named_parameters()}
    path = DiagonalGaussianPosterior(model, std, {"step": 3}).save(tmp_path / POSTERIOR_FILE)
    with safe_open(path, framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    return model, path, tensors, metadata


def test_a_complete_posterior_loads(saved_posterior):
    model, path, tensors, _ = saved_posterior
    loaded = DiagonalGaussianPosterior.load(model, path)
    assert set(loaded.std) == set(tensors) and loaded.metadata["step"] == 3


@pytest.mark.parametrize("edit,message", [
    (lambda t: {k: v for i, (k, v) in enumerate(sorted(t.items())) if i % 2}, "does not cover the parameters"),
    (lambda t: {}, "holds no standard deviations"),
    (lambda t: {**t, "head.bias": torch.full_like(t["head.bias"], float("nan"))},
     "non-finite standard deviation for 'head.bias'"),
    (lambda t: {**t, "body.bias": torch.zeros_like(t["body.bias"])},
     "zero or negative standard deviation for 'body.bias'"),
])
def test_incomplete_or_broken_posterior_is_refused(saved_posterior, edit, message):
    model, path, tensors, metadata = saved_posterior
    save_file(edit(tensors), path, metadata=metadata)
    with pytest.raises(ValueError, match=re.escape(path) + ".*" + re.escape(message)):
        DiagonalGaussianPosterior.load(model, path)


def test_truncated_posterior_file_is_named(saved_posterior):
    model, path, _, _ = saved_posterior
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(path) + ".*truncated or corrupted"):
        DiagonalGaussianPosterior.load(model, path)


@pytest.mark.parametrize("edit", [lambda t: {k: v * 10 for k, v in t.items()},
                                  lambda t: {**t, "head.weight": torch.cat([t["head.weight"][:1] * 2,
                                                                            t["head.weight"][1:]])},
                                  lambda t: {**t, "body.bias": t["body.bias"] + 1e-7}])
def test_std_rewritten_with_its_metadata_kept_is_refused_without_the_manifest(saved_posterior, edit):
    """The file records the SHA-256 of its own tensors: σ changed in any way is refused even where no manifest lies
    beside it (the fingerprint of the weights alone ties σ to the weights, not to its own values)."""
    model, path, tensors, metadata = saved_posterior
    assert not os.path.exists(os.path.join(os.path.dirname(path), MANIFEST_FILE))
    save_file(edit(tensors), path, metadata=metadata)
    with pytest.raises(ValueError,
                       match=re.escape(path) + r" holds other standard deviations than the ones it was saved with"):
        DiagonalGaussianPosterior.load(model, path)
    save_file(tensors, path, metadata=metadata)  # the tensors as saved load again
    assert DiagonalGaussianPosterior.load(model, path).metadata["step"] == 3


# -- 3. resume without optimizer state ----------------------------------------------------------------------------
def _std_in(folder) -> torch.Tensor:
    with safe_open(os.path.join(folder, POSTERIOR_FILE), framework="pt") as f:
        return torch.cat([f.get_tensor(k).flatten() for k in sorted(f.keys())])


def _std_of(trainer) -> torch.Tensor:
    std = trainer.posterior().std
    return torch.cat([std[k].flatten() for k in sorted(std)])


class _StdAtFirstStep(TrainerCallback):
    """σ of the trainer's posterior when the first step (of a resumed run: after the resume) begins."""

    def __init__(self):
        self.trainer, self.std = None, None

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.std is None:
            self.std = _std_of(self.trainer)


def test_resume_without_optimizer_state_restores_the_posterior(tmp_path):
    args = dict(save_strategy="steps", save_steps=4, save_only_model=True)
    _train_ivon(tmp_path, model=TinyClassifier(), steps=4, **args)
    ckpt = tmp_path / "checkpoint-4"
    assert not (ckpt / "optimizer.pt").exists()
    first_step = _StdAtFirstStep()
    resumed = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, max_steps=5, **IVON, **args),
                                 train_dataset=digits_images(64), callbacks=[first_step])
    first_step.trainer = resumed
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.ivon.current_step == 5  # one step on from 4, not restarted at 0
    # h = 1/(ess σ²) − δ inverts σ: the restored IVON gives back the checkpoint's σ (not σ0 from hess_init)
    torch.testing.assert_close(first_step.std, _std_in(ckpt), rtol=1e-5, atol=0)
    assert (_std_in(ckpt) - _std_in(ckpt)[0]).abs().max() > 1e-4  # σ moved away from the uniform σ0

    os.remove(ckpt / POSTERIOR_FILE)
    again = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, max_steps=5, **IVON, **args),
                               train_dataset=digits_images(64))
    with pytest.raises(ValueError, match=r"lacks \['posterior.safetensors'\]"):  # the checkpoint's manifest first
        again.train(resume_from_checkpoint=str(ckpt))
    os.remove(ckpt / MANIFEST_FILE)
    with pytest.raises(ValueError, match="neither optimizer.pt nor posterior.safetensors"):
        again.train(resume_from_checkpoint=str(ckpt))


def test_best_model_reload_brings_its_own_posterior(tmp_path):
    data = digits_images(64)
    args = make_args(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                     save_only_model=True, load_best_model_at_end=True, metric_for_best_model="loss",
                     greater_is_better=True, eval_mc_samples=2, **IVON)  # "greater loss is better": the first is best
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-2")
    torch.testing.assert_close(_std_of(trainer), _std_in(best), rtol=1e-5, atol=0)
    assert (_std_in(best) - _std_in(tmp_path / "checkpoint-6")).abs().max() > 1e-4  # the last step's σ differs


# -- 4. a checkpoint is visible only when complete: real SIGKILLs -------------------------------------------------
CHECKPOINT_FILES = ("model.safetensors", POSTERIOR_FILE, "optimizer.pt", "scheduler.pt", "trainer_state.json",
                    "rng_state.pth")


class _Started(TrainerCallback):
    def __init__(self, event):
        self.event = event

    def on_step_end(self, args, state, control, **kwargs):
        self.event.set()


def _train_until_killed(out: str, steps: int, ds: datasets.Dataset, started=None) -> None:
    torch.set_num_threads(1)
    args = make_args(out, max_steps=steps, save_strategy="steps", save_steps=1, save_total_limit=3, **IVON)
    trainer = VariationalTrainer(model=TinyClassifier(hidden=1024), args=args, train_dataset=ds,
                                 callbacks=[_Started(started)] if started is not None else None)
    trainer.train(resume_from_checkpoint=get_last_checkpoint(out) is not None)


def _assert_complete(checkpoint: str) -> None:
    for name in CHECKPOINT_FILES:
        assert os.path.isfile(os.path.join(checkpoint, name)), f"{checkpoint} lacks {name}: {os.listdir(checkpoint)}"
    torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == int(checkpoint.rsplit("-", 1)[1])


def test_sigkill_never_leaves_a_visible_half_checkpoint(tmp_path):
    # far more steps than eight short rounds reach (a step with its checkpoint takes ~10 ms here): no round finishes
    out, steps, rng, ds = str(tmp_path), 20_000, random.Random(0), digits_dataset(256)
    # Each round is a training process. Not "fork": forking this process (whose earlier tests started torch's and
    # datasets' threads) can deadlock the child on a lock held by a thread that was not copied. A fork server is a
    # fresh single-threaded process that imports the training code once, so no round pays for the import either.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["helpers", "varsmooth"])
    kills = 0
    for _ in range(8):
        started = context.Event()
        child = context.Process(target=_train_until_killed, args=(out, steps, ds, started))
        child.start()
        try:
            assert started.wait(120), f"the training process did not start (exit code {child.exitcode})"
            child.join(rng.uniform(0.05, 1.0))  # a few to ~100 checkpoint saves in
        finally:  # a child left alive would hang pytest's exit, which joins every child
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
                kills += 1
            child.join()
        visible = [os.path.join(out, d) for d in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", d)]
        for checkpoint in visible:
            _assert_complete(checkpoint)
    assert kills >= 6
    last = get_last_checkpoint(out)
    assert last is not None and not os.path.basename(last).startswith(".")
    resume_to = int(last.rsplit("-", 1)[1]) + 2  # resume from the newest (complete) checkpoint and finish
    final = context.Process(target=_train_until_killed, args=(out, resume_to, ds))
    final.start()
    final.join(120)
    if final.is_alive():
        final.kill()
        final.join()
    assert final.exitcode == 0
    _assert_complete(os.path.join(out, f"checkpoint-{resume_to}"))


# -- 6. non-finite training ---------------------------------------------------------------------------------------
def _with_nan_in_second_batch() -> datasets.Dataset:
    clean = digits_dataset(64)
    pixels = clean[:]["pixel_values"].numpy().copy()
    pixels[20] = np.nan
    return datasets.Dataset.from_dict({"pixel_values": pixels, "label": clean[:]["label"].numpy()}).with_format("torch")


@pytest.mark.parametrize("method", ["erm", "sam"])
def test_non_finite_loss_stops_erm_and_sam_with_the_last_finite_weights(tmp_path, method):
    common = dict(method=method, learning_rate=1e-2, train_sampling_strategy="sequential")
    torch.manual_seed(0)
    init = TinyClassifier()
    one_step = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path / "a", max_steps=1, **common),
                                  train_dataset=_with_nan_in_second_batch())
    one_step.model.load_state_dict(init.state_dict())
    one_step.train()
    broken = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path / "b", max_steps=4, **common),
                                train_dataset=_with_nan_in_second_batch())
    broken.model.load_state_dict(init.state_dict())
    with pytest.raises(FloatingPointError,
                       match=f"Non-finite training loss in optimizer step 2 with method='{method}'. "
                                                 r"That step was not applied.*last finite step \(after step 1\)"):
        broken.train()
    for (name, p), q in zip(broken.model.named_parameters(), one_step.model.parameters()):
        assert torch.isfinite(p).all() and torch.equal(p, q), name


def test_micro_batch_without_labels_is_a_zero_gradient_ivon_step(tmp_path):
    clean = digits_dataset(32)
    labels = clean[:]["label"].numpy().copy()
    labels[:16] = -100  # the whole first micro-batch
    ds = datasets.Dataset.from_dict({"pixel_values": clean[:]["pixel_values"].numpy(),
                                     "label": labels}).with_format("torch")
    torch.manual_seed(0)
    trainer = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, max_steps=2, **IVON),
                                 train_dataset=ds)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.ivon.current_step == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


# -- 8. errors that say what is wrong -----------------------------------------------------------------------------
class NoLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, pixel_values, labels=None):
        return {"scores": self.linear(pixel_values.flatten(1))}


def test_model_output_without_logits_is_a_clear_error(tmp_path):
    trainer = VariationalTrainer(model=NoLogits(), args=make_args(tmp_path, max_steps=1, **IVON),
                                 train_dataset=digits_dataset(32))
    with pytest.raises(ValueError, match=r"keys \['scores'\] but no 'logits'"):
        trainer.train()


@pytest.mark.parametrize("field,value",
                         [("hess_init", float("inf")), ("hess_init", float("nan")), ("ess", float("inf")),
                                         ("prior_precision", float("nan")), ("prior_precision", float("inf")),
                                         ("hessian_window", float("inf")), ("learning_rate", float("nan"))])
def test_non_finite_ivon_settings_are_refused(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field} must be finite"):
        make_args(tmp_path, **{field: value})


@pytest.fixture(scope="module")
def image_model_dir(tmp_path_factory):
    from transformers import ViTImageProcessor

    out = tmp_path_factory.mktemp("image_model")
    model = tiny_digits_resnet()
    model.config.id2label = {i: str(i) for i in range(10)}
    model.config.label2id = {str(i): i for i in range(10)}
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.02) for n, p in model.named_parameters()})
    VariationalModel(model, posterior, num_samples=3).save_pretrained(out)
    ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False).save_pretrained(out)
    return out


def test_image_pipeline_takes_a_numpy_array_and_refuses_bad_calls(image_model_dir):
    import PIL.Image

    from varsmooth import pipeline

    classify = pipeline("image-classification", model=str(image_model_dir))
    array = (np.random.default_rng(0).random((8, 8)) * 255).astype("uint8")
    from_pil = classify(PIL.Image.fromarray(array), top_k=10)
    from_array = classify(array, top_k=10)
    assert [r["label"] for r in from_array] == [r["label"] for r in from_pil]
    np.testing.assert_allclose([r["score"] for r in from_array], [r["score"] for r in from_pil], rtol=1e-5)
    with pytest.raises(ValueError, match="empty list of inputs"):
        classify([])
    with pytest.raises(ValueError, match="num_samples must be >= 0"):
        pipeline("image-classification", model=str(image_model_dir), num_samples=-3)
    with pytest.raises(ValueError, match="num_samples must be >= 0"):
        VariationalModel.from_pretrained(image_model_dir, num_samples=-3)


def test_text_pipeline_truncates_texts_longer_than_the_model_takes(tmp_path):
    from example_utils.models import create_text_classifier
    from varsmooth import pipeline

    words = ["good", "great", "bad", "awful"]
    model, tokenizer = create_text_classifier(None, {0: "neg", 1: "pos"},
                                              train_texts=[f"the film was {w} ." for w in words])
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()})
    VariationalModel(model, posterior, num_samples=2).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    classify = pipeline("text-classification", model=str(tmp_path))
    limit = model.config.max_position_embeddings
    long_text = " ".join(["good"] * (3 * limit))
    truncated = tokenizer.convert_tokens_to_string(tokenizer.tokenize(long_text)[: limit - 2])  # [CLS] ... [SEP]
    got, expected = classify(long_text, top_k=2), classify(truncated, top_k=2)
    assert [r["label"] for r in got] == [r["label"] for r in expected]
    np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in expected], rtol=1e-5)


# -- 9. issue 33: hashes in the manifest; nothing removed that a manifest does not list with its hash --------------
def _erm(out, seed: int = 0, steps: int = 1, **kw) -> VariationalTrainer:
    trainer = VariationalTrainer(model=TinyClassifier(),
                                 args=make_args(out, method="erm", max_steps=steps, seed=seed, **kw),
                                 train_dataset=digits_dataset(32))
    trainer.train()
    return trainer


def test_same_size_edit_of_the_card_is_kept(tmp_path):
    trainer = _erm(tmp_path)
    trainer.save_model()
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    edited = card.replace("erm", "ERM", 1)  # a hand edit of the same byte length
    assert edited != card and len(edited.encode()) == len(card.encode())
    (tmp_path / "README.md").write_text(edited)
    with pytest.raises(FileExistsError, match="not written by varsmooth"):
        trainer.create_model_card()
    _erm(tmp_path, steps=2).save_model()  # the next run's save: the card is no longer the one it recorded
    assert (tmp_path / "README.md").read_text() == edited


def test_own_file_named_like_a_library_file_is_kept(tmp_path, caplog):
    (tmp_path / "label_noise_mine.png").write_bytes(b"my picture")
    (tmp_path / "noise_report.json").write_text("{}")
    trainer = _erm(tmp_path)
    with caplog.at_level("WARNING"):
        trainer.save_model()
    assert (tmp_path / "label_noise_mine.png").read_bytes() == b"my picture"
    assert (tmp_path / "noise_report.json").read_text() == "{}"
    assert "Removed files" not in caplog.text
    assert not {"label_noise_mine.png",
                "noise_report.json"} & set(json.loads((tmp_path / MANIFEST_FILE).read_text())["files"])


def test_manifest_records_the_hash_of_every_file(tmp_path):
    import hashlib

    _erm(tmp_path).save_model()
    files = json.loads((tmp_path / MANIFEST_FILE).read_text())["files"]
    assert "model.safetensors" in files
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(), name


def _replace_text(path, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert old in text
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def _rewrite_posterior(path, std_factor=1.0, metadata_edit=None):
    with safe_open(path, framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) * std_factor for k in f.keys()}, f.metadata()
    if metadata_edit is not None:
        metadata = {**metadata, "varsmooth": metadata_edit(metadata["varsmooth"])}
    save_file(tensors, path, metadata=metadata)


@pytest.mark.parametrize("name,edit", [
    (POSTERIOR_FILE, lambda p: _rewrite_posterior(p, std_factor=1000.0)),
    (POSTERIOR_FILE, lambda p: _rewrite_posterior(
        p, metadata_edit=lambda m: m.replace('"posterior_temperature": 1.0', '"posterior_temperature": 9.0'))),
    ("config.json", lambda p: _replace_text(p, '"relu"', '"gelu"')),
])
def test_edited_file_is_refused_on_load_by_its_hash(tmp_path, name, edit):
    model = tiny_digits_resnet()
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()},
                                          {"posterior_temperature": 1.0})
    VariationalModel(model, posterior).save_pretrained(tmp_path)
    size = os.path.getsize(tmp_path / name)
    edit(str(tmp_path / name))
    assert os.path.getsize(tmp_path / name) == size  # the size-only manifest of before could not see it
    with pytest.raises(ValueError, match=rf"SHA-256.*\['{re.escape(name)}'\]"):
        VariationalModel.from_pretrained(tmp_path)
    if name == POSTERIOR_FILE:  # loaded on its own, too
        with pytest.raises(ValueError, match="SHA-256"):
            DiagonalGaussianPosterior.load(model, tmp_path)


def _truncate(path) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def test_truncated_weights_are_named_before_they_are_read(tmp_path):
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=make_args(tmp_path, method="erm", max_steps=1),
                                 train_dataset=digits_images(32))
    trainer.train()
    trainer.save_model()
    _truncate(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors has \d+ bytes, recorded \d+\): they were truncated"):
        VariationalModel.from_pretrained(tmp_path)


def test_truncated_optimizer_state_is_named_on_resume(tmp_path):
    _train_ivon(tmp_path, model=TinyClassifier(), steps=2, save_strategy="steps", save_steps=2)
    _truncate(tmp_path / "checkpoint-2" / "optimizer.pt")
    resumed = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, max_steps=4, **IVON),
                                 train_dataset=digits_images(64))
    with pytest.raises(ValueError, match=r"optimizer.pt has \d+ bytes, recorded \d+\): they were truncated"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


# -- 10. issue 33: non-finite gradients behind a finite loss; no non-finite weights saved or loaded ---------------
def _inf_in_second_batch() -> datasets.Dataset:
    clean = digits_dataset(64)
    pixels = clean[:]["pixel_values"].numpy().copy()
    pixels[20, 3, 3] = np.inf  # tanh saturates: the loss stays finite, the body's weight gradient is inf·0 = NaN
    return datasets.Dataset.from_dict({"pixel_values": pixels, "label": clean[:]["label"].numpy()}).with_format("torch")


@pytest.mark.parametrize("method", ["ivon", "erm", "sam"])
def test_non_finite_gradients_with_a_finite_loss_stop_before_the_update(tmp_path, method):
    common = dict(method=method, train_sampling_strategy="sequential",
                  **({k: v for k, v in IVON.items() if k != "train_sampling_strategy"} if method == "ivon"
                     else {"learning_rate": 1e-2}))
    torch.manual_seed(0)
    init = TinyClassifier().state_dict()
    one_step = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path / "a", max_steps=1, **common),
                                  train_dataset=_inf_in_second_batch())
    one_step.model.load_state_dict(init)
    one_step.train()
    args = make_args(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=1, **common)
    broken = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=_inf_in_second_batch())
    broken.model.load_state_dict(init)
    with torch.no_grad():  # the loss of the second batch is finite: only its gradient is not
        assert torch.isfinite(broken.compute_loss(broken.model,
                                                  {k: v[16:32] for k, v in _inf_in_second_batch()[:].items()}
                                                  | {"labels": _inf_in_second_batch()[16:32]["label"]}))
    with pytest.raises(FloatingPointError,
                       match=r"Non-finite gradients \(NaN, inf or past float32's range, with a finite loss\) in "
                             r"optimizer step 2 .*last finite step \(after step 1\)"):
        broken.train()
    for (name, p), q in zip(broken.model.named_parameters(), one_step.model.parameters()):
        assert torch.isfinite(p).all() and torch.equal(p, q), name
    if method == "ivon":  # IVON's posterior (σ from its Hessian) is that of step 1 too
        torch.testing.assert_close(_std_of(broken), _std_of(one_step), rtol=0, atol=0)
    assert sorted(d for d in os.listdir(tmp_path / "b") if d.startswith("checkpoint-")) == ["checkpoint-1"]
    broken.save_model()  # what the message promises: the weights are finite, and saving them is safe
    from safetensors.torch import load_file

    reloaded = TinyClassifier()
    reloaded.load_state_dict(load_file(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(p, q) for p, q in zip(reloaded.parameters(), one_step.model.parameters()))
    if method == "ivon":
        DiagonalGaussianPosterior.load(reloaded, tmp_path / "b")  # σ bound to these weights, finite and positive


def test_a_save_refuses_non_finite_weights_and_leaves_the_folder_as_it_was(tmp_path):
    trainer = _erm(tmp_path)
    trainer.save_model()
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with torch.no_grad():
        trainer.model.head.bias[3] = float("nan")
    with pytest.raises(FloatingPointError, match=r"Not saving to .*\['head.bias'\] are not finite"):
        trainer.save_model()
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before
    model = tiny_digits_resnet()
    with torch.no_grad():
        next(model.parameters())[0] = float("inf")
    with pytest.raises(FloatingPointError, match="are not finite"):
        VariationalModel(model, DiagonalGaussianPosterior.point_mass(model)).save_pretrained(tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_non_finite_weights_are_refused_on_load_for_every_method(tmp_path):
    from varsmooth import pipeline

    model = tiny_digits_resnet()
    model.config.id2label = {i: str(i) for i in range(10)}
    with torch.no_grad():
        model.classifier[1].weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path)  # as an ERM run that diverged would have, before saves refused it
    with pytest.raises(ValueError, match=r"not finite \(NaN or inf\) in \['classifier.1.weight'\]"):
        VariationalModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not finite"):
        pipeline("image-classification", model=str(tmp_path))


# -- 11. issue 32: reproducible bytes and ordinary permissions ------------------------------------------------------
def test_posterior_file_is_byte_reproducible(tmp_path):
    model = tiny_digits_resnet()
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()},
                                          {"ess": 64, "posterior_temperature": 1.0, "step": 3})
    saved = {posterior.save(tmp_path / f"{i}.safetensors") and (tmp_path / f"{i}.safetensors").read_bytes()
             for i in range(12)}
    assert len(saved) == 1


def test_saved_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        _train_ivon(tmp_path, model=TinyClassifier(), steps=1).save_model()
    finally:
        os.umask(old)
    modes = {name: oct(os.stat(tmp_path / name).st_mode & 0o777) for name in os.listdir(tmp_path)
             if os.path.isfile(tmp_path / name)}
    assert {"model.safetensors", POSTERIOR_FILE, MANIFEST_FILE} <= set(modes)
    assert set(modes.values()) == {oct(0o640)}, modes


# -- issue 42: nothing lost after training, nothing resumed under another name ---------------------------------------
class _FailsAfterTraining(TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        raise KeyError("the user's report needs a column 'split'")


def _relabelling_transform(label: int):
    """A batch transform whose labels cannot be checked before it runs: every label becomes `label`."""
    def transform(batch):
        return {"pixel_values": torch.as_tensor(np.asarray(batch["pixel_values"], dtype="float32")),
                "labels": torch.full((len(batch["label"]),), label)}
    return transform


@pytest.mark.parametrize("method, after", [
    *((method, after) for method in ("ivon", "erm") for after in ("a user's callback", "temperature scaling")),
    ("ivon", "the posterior temperature"), ("ivon", "the label-noise export")])
def test_a_step_after_training_that_fails_saves_the_trained_run_first(tmp_path, method, after):
    """Whatever fails after the last step (reading user data no check at construction could read: a transform's
    labels, a callback's), the trained model is saved before the error, which names the step's error and the folder."""
    ivon = method == "ivon"
    bad_eval = digits_images(16).with_format(None).with_transform(_relabelling_transform(12))
    kw = dict(IVON, eval_mc_samples=2) if ivon else dict(learning_rate=1e-3)
    sets, callbacks = {}, []
    if after == "a user's callback":
        callbacks = [_FailsAfterTraining()]
        kw.update(posterior_temperature=1.0) if ivon else None
    elif after == "the posterior temperature":
        sets = {"eval_dataset": bad_eval}
    elif after == "temperature scaling":
        sets = {"eval_dataset": bad_eval}
        kw.update(temperature_scaling=True, **({"posterior_temperature": 1.0} if ivon else {}))
    else:
        callbacks = [LabelNoiseCallback(num_samples=2, dataset=bad_eval)]
        kw.update(posterior_temperature=1.0)
    args = make_args(tmp_path, method=method, max_steps=2, remove_unused_columns=False, **kw)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=digits_images(32),
                                 callbacks=callbacks, **sets)
    with pytest.raises(RuntimeError, match=r"Training finished \(step 2\), but a step after it failed .*"
                                           + ("and its posterior were" if ivon else "model was") + " saved to "
                                           + re.escape(str(tmp_path))) as failed:
        trainer.train()
    assert isinstance(failed.value.__cause__, (KeyError, ValueError, IndexError, RuntimeError))
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["global_step"] == 2 and (POSTERIOR_FILE in manifest["files"]) == ivon
    loaded = VariationalModel.from_pretrained(tmp_path).model if ivon else type(trainer.model).from_pretrained(tmp_path)
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, trained[name]) for name, p in loaded.named_parameters())  # the trained weights


@pytest.mark.parametrize("how", ["callbacks=", "add_callback"])
def test_the_label_noise_datasets_labels_are_checked_at_construction(tmp_path, how):
    bad = digits_images(32).with_format(None).cast_column("label", datasets.Value("int64"))
    bad = bad.map(lambda row, i: {"label": 12 if i == 7 else row["label"]}, with_indices=True).with_format("torch")
    args = make_args(tmp_path, max_steps=1, eval_mc_samples=2, **IVON)
    with pytest.raises(ValueError, match=r"'label' column of the dataset of LabelNoiseCallback holds 12 \(row 7;.*"
                                         r"outside the model's 10 classes"):
        if how == "callbacks=":
            VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=digits_images(32),
                               callbacks=[LabelNoiseCallback(num_samples=2, dataset=bad)])
        else:
            trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=digits_images(32))
            trainer.add_callback(LabelNoiseCallback(num_samples=2, dataset=bad))


def _checkpointed_ivon(out, steps: int = 2, n: int = 64, **kw) -> VariationalTrainer:
    args = make_args(out, max_steps=steps, eval_mc_samples=2, save_strategy="steps", save_steps=1,
                     posterior_temperature=1.0, **{**IVON, **kw})
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=digits_images(n))
    return trainer


@pytest.mark.parametrize("change, message", [
    (dict(seed=1), r"trained with --seed 0, but this run has --seed 1"),
    (dict(method="ivon_fixed_hessian", beta2=None),
     r"trained with --method ivon, but this run has --method ivon_fixed_hessian"),
    (dict(hess_init=0.1),
     r"other IVON settings than it was trained with: hess_init=0.1 \(the checkpoint's: 0.5\).*Pass hess_init=0.5"),
    (dict(ess=500.0), r"ess=500.0 \(the checkpoint's: 64.0\)"),
    (dict(beta2=0.9, prior_precision=1e-3),
     r"beta2=0.9 \(the checkpoint's: 0.99\), prior_precision=0.001 \(the checkpoint's: 0.0002\)"),
    (dict(learning_rate=0.05), r"learning_rate=0.05 \(the checkpoint's: 0.2\).*Pass learning_rate=0.2"),
])
def test_resuming_through_the_api_under_another_name_is_refused(tmp_path, change, message):
    """`trainer.train(resume_from_checkpoint=...)` gives the examples' guarantees: another seed, method or explicit
    IVON setting than the checkpoint's is refused before a step is taken (IVON's state would carry the checkpoint's
    while the run records the new ones)."""
    _checkpointed_ivon(tmp_path).train()
    before = {n: (tmp_path / n / MANIFEST_FILE).read_bytes() for n in ("checkpoint-1", "checkpoint-2")}
    other = _checkpointed_ivon(tmp_path, steps=3, **change)
    with pytest.raises(ValueError, match=message):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert not (tmp_path / "checkpoint-3").exists()  # no step was taken, no checkpoint rewritten
    assert {n: (tmp_path / n / MANIFEST_FILE).read_bytes() for n in before} == before


def test_a_setting_left_to_the_run_takes_the_checkpoints_value_and_records_it(tmp_path):
    """ess left unset is the training-set size: resumed on another number of examples, IVON goes on with the
    checkpoint's ess, and the posterior and the card say so."""
    _checkpointed_ivon(tmp_path, n=64).train()
    resumed = _checkpointed_ivon(tmp_path, steps=3, n=48)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.ivon.param_groups[0]["ess"] == 64.0
    assert resumed.posterior().metadata["ess"] == 64.0
    resumed.save_model()
    with safe_open(str(tmp_path / POSTERIOR_FILE), "pt") as f:
        assert json.loads(f.metadata()["varsmooth"])["ess"] == 64.0


@pytest.mark.parametrize("resume", [True, "path"])
def test_a_finished_run_resumed_through_the_api_is_refused_not_trained_one_step_more(tmp_path, resume):
    _checkpointed_ivon(tmp_path, steps=2).train()
    again = _checkpointed_ivon(tmp_path, steps=2)
    with pytest.raises(ValueError, match=r"has finished: its last checkpoint .*checkpoint-2 is at step 2"):
        again.train(resume_from_checkpoint=True if resume is True else str(tmp_path / "checkpoint-2"))
    assert not (tmp_path / "checkpoint-3").exists() and again.state.global_step == 0
    longer = _checkpointed_ivon(tmp_path, steps=3)
    longer.train(resume_from_checkpoint=True)  # training on is resuming
    assert longer.state.global_step == 3


# -- 12. issues 32/33: an example re-run in a used output_dir ----------------------------------------------------
def test_resuming_another_seeds_checkpoint_is_refused(tmp_path):
    from example_utils.script import checkpoint_to_resume

    _erm(tmp_path, seed=0, steps=2, save_strategy="steps", save_steps=1)
    os.rename(tmp_path / "checkpoint-2", tmp_path / "hidden")  # as if killed after step 1 of 2
    assert checkpoint_to_resume(make_args(tmp_path, method="erm", max_steps=2, seed=0)).endswith("checkpoint-1")
    with pytest.raises(ValueError,
                       match=r"trained with --seed 0, but this run has --seed 1.*Pass --seed 0 to resume it, "
                             r"or start the seed-1 run in another --output_dir"):
        checkpoint_to_resume(make_args(tmp_path, method="erm", max_steps=2, seed=1))


def test_relaunching_a_finished_run_is_refused_instead_of_training_one_more_step(tmp_path):
    from example_utils.script import checkpoint_to_resume

    _erm(tmp_path, steps=2, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match=r"has finished: its last checkpoint .*checkpoint-2 is at step 2, the end of "
                                         r"--max_steps 2.*raise --max_steps or --num_train_epochs"):
        checkpoint_to_resume(make_args(tmp_path, method="erm", max_steps=2))
    longer = make_args(tmp_path, method="erm", max_steps=3)
    assert checkpoint_to_resume(longer).endswith("checkpoint-2")  # training on is resuming
    epochs = make_args(tmp_path, method="erm", num_train_epochs=1)  # 32 examples / 16: the same 2 steps
    with pytest.raises(ValueError, match="--num_train_epochs 1"):
        checkpoint_to_resume(epochs)


@pytest.mark.slow
def test_the_image_example_refuses_a_finished_run_and_another_seeds_checkpoint(tmp_path):
    from test_examples import _image

    flags = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no",
             "--output_dir", str(tmp_path)]
    first = _image(*flags)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _image(*flags)
    assert again.returncode != 0 and "has finished: its last checkpoint" in again.stderr
    assert not (tmp_path / "checkpoint-3").exists()  # not one step more
    other_seed = _image(*flags, "--max_steps", "4", "--seed", "1")
    assert other_seed.returncode != 0
    assert ("trained with --seed 42, but this run has --seed 1" in other_seed.stderr
            and "Pass --seed 42" in other_seed.stderr)


def test_non_finite_running_statistics_stop_training_and_are_not_saved(tmp_path):
    clean = digits_images(64)
    pixels = clean[:]["pixel_values"].numpy().copy()
    pixels[20, 0, 3, 3] = np.inf  # BatchNorm's running statistics take it in the forward pass, whatever the update
    ds = datasets.Dataset.from_dict({"pixel_values": pixels, "label": clean[:]["label"].numpy()}).with_format("torch")
    args = make_args(tmp_path, method="erm", max_steps=3, save_strategy="steps", save_steps=1,
                     train_sampling_strategy="sequential")
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=ds)
    with pytest.raises(FloatingPointError,
                       match=r"optimizer step 2 .*last finite step \(after step 1\), but the forward "
                             r"pass made the buffers \['resnet.embedder.embedder.normalization.running_mean'"
                             r".*so saving is refused"):
        trainer.train()
    with pytest.raises(FloatingPointError, match=r"Not saving to .*running_mean.*nothing was written"):
        trainer.save_model()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    VariationalModel.from_pretrained(tmp_path / "checkpoint-1")  # finite, whole


def test_a_checkpoint_manifest_lists_its_training_state_apart(tmp_path):
    from varsmooth.files import shareable_files

    _train_ivon(tmp_path, model=TinyClassifier(), steps=2, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "checkpoint-2"
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == set(os.listdir(checkpoint)) - {MANIFEST_FILE}  # every file, optimizer.pt too
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(manifest["training_state"])
    assert set(shareable_files(checkpoint)) == {"model.safetensors", POSTERIOR_FILE}  # what a model push copies
    assert "optimizer.pt" in shareable_files(checkpoint, training_state=True)


def test_a_smaller_ensemble_keeps_an_earlier_member_folder_that_was_edited(tmp_path):
    from varsmooth import DeepEnsemble

    networks = [tiny_digits_resnet(seed) for seed in range(3)]
    members = [VariationalModel(m, DiagonalGaussianPosterior.point_mass(m)) for m in networks]
    DeepEnsemble(members).save_pretrained(tmp_path)
    _replace_text(tmp_path / "member-2" / "config.json", '"relu"', '"gelu"')  # edited by hand since
    (tmp_path / "member-1" / "notes.txt").write_text("mine")  # a file of the user's beside the member
    with pytest.warns(UserWarning, match="member-1, a member of the ensemble saved there before"):
        DeepEnsemble(members[:1]).save_pretrained(tmp_path)
    assert (tmp_path / "member-1" / "notes.txt").read_text() == "mine"
    assert '"gelu"' in (tmp_path / "member-2" / "config.json").read_text()
    DeepEnsemble(members[:2]).save_pretrained(tmp_path / "other2")
    DeepEnsemble(members[:1]).save_pretrained(tmp_path / "other2")  # unchanged: removed as before
    assert not (tmp_path / "other2" / "member-1").exists()


def test_rotation_keeps_the_newest_and_the_best_and_leaves_nothing_half_deleted(tmp_path):
    from varsmooth.files import DELETING_PREFIX, STAGING_PREFIX, clear_leftovers, write_manifest
    from varsmooth.trainer.checkpoint_files import rotate_checkpoints

    for step in range(1, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"w")
        write_manifest(str(tmp_path / f"checkpoint-{step}"), ["model.safetensors"], training_state=[])
        os.utime(tmp_path / f"checkpoint-{step}", (1000 + 10 * step, 1000 + 10 * step))  # ordered by mtime
    (tmp_path / f"{STAGING_PREFIX}checkpoint-6").mkdir()  # left by a killed run
    (tmp_path / f"{DELETING_PREFIX}checkpoint-0").mkdir()
    (tmp_path / ".tmp-abcd_123model.safetensors").write_bytes(b"half")  # a killed atomic write
    rotate_checkpoints(tmp_path, None, None)  # no limit: all kept
    assert len([d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")]) == 5
    rotate_checkpoints(tmp_path, 2, str(tmp_path / "checkpoint-1"))
    assert clear_leftovers(tmp_path) == sorted([".tmp-abcd_123model.safetensors", f"{DELETING_PREFIX}checkpoint-0",
                                                f"{STAGING_PREFIX}checkpoint-6"])
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-5"]


@pytest.mark.parametrize("name", ["checkpoint-0-backup", "checkpoint-3.old", "checkpoint-20"])
def test_rotation_never_removes_a_folder_the_run_did_not_write(tmp_path, name):
    """A user's folder named like a checkpoint, or a checkpoint-N without the manifest a run's checkpoint has (copied
    in by hand), is not the run's: `save_total_limit` keeps it, however old."""
    mine = tmp_path / "run" / name
    mine.mkdir(parents=True)
    (mine / "model.safetensors").write_bytes(b"the user's weights")
    os.utime(mine, (1000, 1000))  # older than every checkpoint of the run
    _erm(tmp_path / "run", steps=4, save_strategy="steps", save_steps=1, save_total_limit=1)
    assert (mine / "model.safetensors").read_bytes() == b"the user's weights"
    runs = sorted(d for d in os.listdir(tmp_path / "run") if re.fullmatch(r"checkpoint-\d+", d) and d != name)
    assert runs == ["checkpoint-4"]  # the run's own checkpoints were rotated as asked


def test_leftovers_of_a_killed_save_are_deleted_by_the_next_run_and_never_counted_as_files(tmp_path):
    """What a kill -9 leaves under a temporary name (an `atomic_path` file, a checkpoint being written or deleted) does
    not make the example refuse the folder as used, and the next train() deletes it; a user's file is kept."""
    from example_utils.script import checkpoint_to_resume
    from varsmooth.files import DELETING_PREFIX, STAGING_PREFIX

    tmp_path.mkdir(exist_ok=True)
    leftovers = [".tmp-k1ll3d_9posterior.safetensors", ".tmp-abcdefghlabel_noise.parquet"]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"half a file")
    (tmp_path / f"{STAGING_PREFIX}checkpoint-3" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / f"{DELETING_PREFIX}checkpoint-1").mkdir()
    assert checkpoint_to_resume(make_args(tmp_path, method="erm", max_steps=1)) is None  # not "not empty"
    (tmp_path / ".tmp-notes").write_text("the user's, not named as atomic_path names")
    _erm(tmp_path, steps=1).save_model()
    assert {".tmp-notes", MANIFEST_FILE, "model.safetensors"} <= set(os.listdir(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n in leftovers or n.startswith((STAGING_PREFIX, DELETING_PREFIX))]


def test_publishing_a_checkpoint_lists_its_training_state_and_replaces_an_earlier_one_whole(tmp_path):
    from varsmooth.files import STAGING_PREFIX, check_manifest, write_manifest
    from varsmooth.trainer.checkpoint_files import publish_checkpoint

    staging, final = tmp_path / f"{STAGING_PREFIX}checkpoint-3", tmp_path / "checkpoint-3"
    written = staging / "checkpoint-3"
    written.mkdir(parents=True)
    (written / "model.safetensors").write_bytes(b"weights")
    write_manifest(str(written), ["model.safetensors"])  # the model's save
    (written / "optimizer.pt").write_bytes(b"state")  # the training state, written after it
    final.mkdir()
    (final / "stale.bin").write_bytes(b"an earlier run's")
    publish_checkpoint(staging, final)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]
    assert set(os.listdir(final)) == {MANIFEST_FILE, "model.safetensors", "optimizer.pt"}
    assert json.loads((final / MANIFEST_FILE).read_text())["training_state"] == ["optimizer.pt"]
    check_manifest(final)
    (final / "optimizer.pt").write_bytes(b"cut")
    with pytest.raises(ValueError, match="optimizer.pt"):
        check_manifest(final)


def test_ivon_restored_from_a_posterior_gets_its_std_and_refuses_other_trainable_parameters(tmp_path):
    from varsmooth import VariationalIVON
    from varsmooth.posterior.resume import restore_ivon_from_posterior

    model = TinyClassifier()
    names = [name for name, _ in model.named_parameters()]
    DiagonalGaussianPosterior(model,
                              {name: torch.full_like(p, 0.1) for name, p in model.named_parameters()}).save(tmp_path)
    ivon = VariationalIVON(list(model.parameters()), lr=0.1, ess=100.0)
    restore_ivon_from_posterior(ivon, model, str(tmp_path), names, default_step=7)  # no step recorded: the default
    assert ivon.current_step == 7
    stds = torch.cat([s.flatten() for s in ivon.posterior_std()])  # h = 1/(ess σ²) − δ inverts σ
    torch.testing.assert_close(stds, torch.full_like(stds, 0.1), rtol=1e-5, atol=0)
    head_only = VariationalIVON([model.head.weight, model.head.bias], lr=0.1, ess=100.0)
    with pytest.raises(ValueError, match="covers 4 parameters but IVON trains 2"):
        restore_ivon_from_posterior(head_only, model, str(tmp_path), ["head.weight", "head.bias"], default_step=7)


def test_the_checkpoint_prefix_is_the_trainers():
    """`varsmooth.files` names checkpoint folders without importing transformers; the Trainer names them so."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from varsmooth.files import CHECKPOINT_PREFIX, is_leftover

    assert CHECKPOINT_PREFIX == PREFIX_CHECKPOINT_DIR
    assert is_leftover(f".partial-{PREFIX_CHECKPOINT_DIR}-12") and not is_leftover(f"{PREFIX_CHECKPOINT_DIR}-12")


@pytest.mark.parametrize("path", ["/nonexistent/run", "./missing-run", "outputs/missing/run"])
def test_a_missing_local_folder_is_named_as_one(path) -> None:
    from varsmooth import VariationalModel

    with pytest.raises(FileNotFoundError, match=r"No folder .*check the path the model was saved to"):
        VariationalModel.from_pretrained(path)


def test_a_file_is_not_a_model_folder(tmp_path) -> None:
    from varsmooth import VariationalModel

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is a file: pass the folder"):
        VariationalModel.from_pretrained(tmp_path / "model.safetensors")
