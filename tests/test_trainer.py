"""VariationalTrainer trains exactly like a hand-written IVON loop and avoids the pitfalls of a naive Trainer
integration (weight decay fed into IVON's prior, clipped or scaled sample gradients, re-initialised models, lost
optimizer state), and keeps the contracts of `transformers.Trainer` it inherits: compute_loss_func, batch_eval_metrics,
a saved model evaluated by a new trainer, and a warning that says when the posterior did not learn."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import log_loss
from transformers import HfArgumentParser, ResNetForImageClassification

from helpers import TinyClassifier, digits_dataset, digits_images, make_args, reference_ivon_loop, tiny_digits_resnet
from varsmooth import (
    POSTERIOR_FILE,
    DiagonalGaussianPosterior,
    VariationalModel,
    VariationalTrainer,
    VariationalTrainingArguments,
)
from varsmooth.methods.ivon import IVONConfig, check_ivon_sharding
from varsmooth.posterior import VariationalIVON
from varsmooth.posterior.diagnostics import HESSIAN_STUCK_TOLERANCE, hessian_summary
from varsmooth.prediction.predictors import PosteriorPredictor
from varsmooth.trainer.arguments import POSTERIOR_FIELDS

REPO = Path(__file__).resolve().parents[1]
IVON_KW = dict(lr=0.2, hess_init=0.5, beta1=0.9, beta2=0.999, wd=2e-4)


def _trainer_args(tmp_path, **kw):
    base = dict(learning_rate=IVON_KW["lr"], hess_init=IVON_KW["hess_init"], beta1=IVON_KW["beta1"],
                beta2=IVON_KW["beta2"], prior_precision=IVON_KW["wd"], lr_scheduler_type="constant",
                max_grad_norm=0.0, train_sampling_strategy="sequential")
    base.update(kw)
    return make_args(tmp_path, **base)


def _sequential_args(tmp_path, **kw):
    base = dict(learning_rate=0.2, beta2=0.999, lr_scheduler_type="constant", train_sampling_strategy="sequential")
    return make_args(tmp_path, **{**base, **kw})


def _sequential_batches(ds, batch, grad_accum):
    x, y = ds[:]["pixel_values"], ds[:]["label"]

    def batches(step):
        start = step * batch * grad_accum
        return [(x[start + k * batch: start + (k + 1) * batch], y[start + k * batch: start + (k + 1) * batch])
                for k in range(grad_accum)]
    return batches


def _max_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("grad_accum,mc_samples,clip,spare_core",
                         [(1, 1, 0.0, False), (2, 1, 0.0, False), (2, 2, 0.0, False), (1, 2, 0.5, False),
                          (2, 2, 0.0, True)])
def test_trainer_matches_hand_written_ivon_loop(tmp_path, grad_accum, mc_samples, clip, spare_core, monkeypatch):
    """Weights, Hessian and step counter equal the ivon-opt README loop run on the same samples.

    Covers: forward and backward inside the sampling context, gradients zeroed per sample, one sample per
    micro-batch with its mean loss (not divided by the accumulation count), clipping inside the context; with a
    spare core, the next sample's e drawn ahead (`prefetch`), to the same numbers.
    """
    monkeypatch.setattr("varsmooth.posterior.optimizer._spare_core", lambda: spare_core)
    ds = digits_dataset(128)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    steps, batch = 4, 16
    args = _trainer_args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=grad_accum,
                         max_steps=steps, mc_samples=mc_samples, max_grad_norm=clip)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    assert trainer.ivon.prefetch is spare_core
    ref, ref_opt = reference_ivon_loop(init, _sequential_batches(ds, batch, grad_accum), steps, ess=len(ds),
                                       seed=0, mc_samples=mc_samples, clip_norm=clip, **IVON_KW)
    assert _max_diff(trainer.model, ref) < 1e-6
    assert torch.allclose(trainer.ivon.hessian(), ref_opt.param_groups[0]["hess"], atol=1e-6, rtol=1e-6)
    assert trainer.ivon.current_step == ref_opt.current_step == steps
    # the Hessian did move (β2 = 0.999): the comparison is not between two untouched initial values
    assert (trainer.ivon.hessian() - 0.5).abs().max() > 1e-3


def test_trainer_semantics_of_accumulation_would_differ(tmp_path):
    """The comparison above can fail: the Trainer's default 1/GA loss scaling gives other weights."""
    ds = digits_dataset(64)
    torch.manual_seed(0)
    init = TinyClassifier()
    batches = _sequential_batches(ds, 16, 2)
    good, good_opt = reference_ivon_loop(init, batches, 3, ess=64, seed=0, **IVON_KW)
    scaled, scaled_opt = reference_ivon_loop(init, batches, 3, ess=64, seed=0, loss_scale=0.5, **IVON_KW)
    assert _max_diff(good, scaled) > 1e-4
    assert not torch.allclose(good_opt.param_groups[0]["hess"], scaled_opt.param_groups[0]["hess"], atol=1e-6)


def test_frozen_mean_modules_learn_their_sigma_as_ivon_opt_with_a_zero_rate_group(tmp_path):
    """`frozen_mean_modules`: their weights never move, their σ learns, and the run is ivon-opt's with those weights in
    a param group at lr 0; the saved posterior names each σ after its own weight."""
    ds = digits_dataset(128)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    args = _trainer_args(tmp_path, per_device_train_batch_size=16, max_steps=4, frozen_mean_modules=["body"])
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    ref, ref_opt = reference_ivon_loop(init, _sequential_batches(ds, 16, 1), 4, ess=len(ds), seed=0,
                                       frozen_mean=("body",), **IVON_KW)
    assert _max_diff(trainer.model, ref) < 1e-6
    ref_hess = torch.cat([g["hess"] for g in ref_opt.param_groups])
    assert torch.allclose(trainer.ivon.hessian(), ref_hess, atol=1e-6, rtol=1e-6)
    assert torch.equal(model.body.weight, init.body.weight) and torch.equal(model.body.bias, init.body.bias)
    assert not torch.equal(model.head.weight, init.head.weight)
    std = trainer.posterior().std
    assert std["body.weight"].shape == model.body.weight.shape  # not another weight's σ
    body_hess = 1.0 / (len(ds) * std["body.weight"].double() ** 2) - IVON_KW["wd"]
    assert (body_hess - IVON_KW["hess_init"]).abs().max() > 1e-3  # σ learned while the mean stayed


def test_frozen_mean_modules_that_name_no_trainable_module_are_refused(tmp_path):
    args = _trainer_args(tmp_path, max_steps=1, frozen_mean_modules=["embeddings"])
    with pytest.raises(ValueError, match=r"'embeddings'.*match no module.*body"):
        VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=digits_dataset(32)).train()


@pytest.mark.parametrize("frozen_mean", [None, ["body"]])
def test_resume_is_exact(tmp_path, frozen_mean):
    """Train 2N steps == train N, checkpoint, resume, train N (weights, Hessian, step counter, data order); with a
    frozen-mean group too."""
    ds = digits_dataset(256)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    common = dict(max_steps=8, per_device_train_batch_size=16, gradient_accumulation_steps=2,
                  lr_scheduler_type="cosine", warmup_steps=2, beta2=0.999, train_sampling_strategy="random",
                  frozen_mean_modules=frozen_mean)
    full = VariationalTrainer(model=model, args=make_args(tmp_path / "full", **common), train_dataset=ds)
    full.train()

    half_args = make_args(tmp_path / "half", save_strategy="steps", save_steps=4, **common)
    VariationalTrainer(model=copy.deepcopy(init), args=half_args, train_dataset=ds).train()
    # a fresh process would start from the initial weights and the checkpoint: mimic it
    resumed = VariationalTrainer(model=copy.deepcopy(init), args=half_args, train_dataset=ds)
    resumed.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-4"))

    assert _max_diff(full.model, resumed.model) == 0.0
    assert torch.equal(full.ivon.hessian(), resumed.ivon.hessian())
    assert resumed.ivon.current_step == full.ivon.current_step == 8
    ckpt = torch.load(tmp_path / "half" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert ckpt["param_groups"][0]["current_step"] == 4
    assert set(ckpt["state"]) == {0, 1, 2, 3} and set(ckpt["state"][0]) == {"momentum", "hess"}  # per parameter


def test_ivon_reached_through_accelerate_wrapper(tmp_path):
    ds = digits_dataset(64)
    trainer = VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=ds)
    trainer.train()
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    assert not hasattr(trainer.optimizer, "sampled_params")
    assert isinstance(trainer.ivon, VariationalIVON)


def test_frozen_and_gradless_parameters(tmp_path):
    """Frozen weights are neither perturbed nor decayed; a trainable head without gradient does not crash."""
    ds = digits_dataset(64)
    model = TinyClassifier(with_unused=True)
    model.body.weight.requires_grad_(False)
    frozen = model.body.weight.detach().clone()
    trainer = VariationalTrainer(model=model, args=_trainer_args(tmp_path, max_steps=3), train_dataset=ds)
    trainer.train()
    assert torch.equal(model.body.weight, frozen)
    ivon_params = {id(p) for g in trainer.ivon.param_groups for p in g["params"]}
    assert id(model.body.weight) not in ivon_params
    assert torch.isfinite(model.unused.weight).all()


def test_exception_inside_sample_restores_mean_weights():
    model = TinyClassifier()
    opt = VariationalIVON(model.parameters(), lr=0.1, ess=100.0, hess_init=0.5)
    mean = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        with opt.sampled_params(train=True):
            assert any(not torch.equal(p, m) for p, m in zip(model.parameters(), mean))  # really perturbed
            raise RuntimeError("boom")
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), mean))
    with pytest.raises(RuntimeError, match="without any gradient sample"):
        opt.step()  # the failed sample was not recorded


def test_non_finite_loss_is_a_clear_error_and_weights_survive(tmp_path):
    clean = digits_dataset(32)
    pixels = clean[:]["pixel_values"].numpy().copy()
    pixels[0] = np.nan
    ds = datasets.Dataset.from_dict({"pixel_values": pixels, "label": clean[:]["label"].numpy()}).with_format("torch")
    model = TinyClassifier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = VariationalTrainer(model=model, args=_trainer_args(tmp_path, max_steps=2), train_dataset=ds)
    with pytest.raises(FloatingPointError, match="Non-finite training loss"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_weight_decay_is_refused_with_ivon_and_names_prior_precision(tmp_path):
    with pytest.raises(ValueError,
                       match="weight_decay=0.01 cannot be honoured: IVON's weight decay is the precision of its "
                             "Gaussian prior, `prior_precision`"):
        make_args(tmp_path, weight_decay=0.01)
    assert make_args(tmp_path, method="erm", weight_decay=0.01).weight_decay == 0.01  # AdamW's, as in TrainingArguments


def test_fp16_refused_with_clear_error(tmp_path):
    with pytest.raises(ValueError, match="fp16=True cannot be honoured: fp16 with a gradient scaler is not supported"):
        make_args(tmp_path, fp16=True)


def test_low_precision_weights_refused(tmp_path):
    model = TinyClassifier().to(torch.bfloat16)
    trainer = VariationalTrainer(model=model, args=_trainer_args(tmp_path, max_steps=1),
                                 train_dataset=digits_dataset(32))
    with pytest.raises(ValueError, match="IVON needs fp32 trainable weights"):
        trainer.train()


def test_ivon_accepts_fsdp2_and_refuses_fsdp1_and_deepspeed(tmp_path):
    """FSDP2 (DTensor parameters) is what IVON trains sharded; FSDP1 and DeepSpeed are refused naming the fix."""
    args = make_args(tmp_path, fsdp=True, fsdp_config={"version": 2})
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    with pytest.raises(ValueError, match=r"IVON needs FSDP2 .* got FSDP version 1.*fsdp_config=\{'version': 2\}"):
        make_args(tmp_path, fsdp=True, fsdp_config={"version": 1})
    # not IVON: the Trainer's affair
    assert make_args(tmp_path, method="erm", fsdp=True, fsdp_config={"version": 1}).fsdp
    with pytest.raises(ValueError, match="not supported with DeepSpeed.*FSDP2"):
        check_ivon_sharding(None, deepspeed=True)  # building DeepSpeed arguments needs deepspeed installed
    check_ivon_sharding(None, deepspeed=False)


def test_bf16_autocast_trains_and_hessian_moves(tmp_path):
    """bf16 autocast on the CPU against the same run in fp32: the forward runs in bf16, the weights stay fp32, and
    the weights and the Hessian end close to fp32's (bf16 keeps 8 bits of mantissa)."""
    ds = digits_dataset(64)

    def train(folder, **kw):
        torch.manual_seed(0)
        model = TinyClassifier()
        initial = [p.detach().clone() for p in model.parameters()]
        dtypes = set()
        model.head.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
        trainer = VariationalTrainer(model=model, args=_trainer_args(folder, max_steps=5, **kw), train_dataset=ds)
        trainer.train()
        return model, initial, trainer.ivon.hessian(), dtypes

    model, initial, hess, dtypes = train(tmp_path / "bf16", bf16=True)
    ref, ref_initial, ref_hess, ref_dtypes = train(tmp_path / "fp32")
    assert dtypes == {torch.bfloat16} and ref_dtypes == {torch.float32}  # autocast was on, and only there
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(initial, ref_initial))
    assert torch.isfinite(hess).all() and (hess != 0.5).float().mean() > 0.9
    for p, q, p0 in zip(model.parameters(), ref.parameters(), initial):
        step = (q - p0).norm()
        assert step > 0 and (p - q).norm() < 0.02 * step, (float((p - q).norm()), float(step))
    h0 = 0.5
    assert (hess - ref_hess).norm() < 0.02 * (ref_hess - h0).norm()


def test_args_parse_with_hf_argument_parser():
    (config,) = HfArgumentParser(IVONConfig).parse_args_into_dataclasses(
        ["--ess", "1e4", "--hess_init", "0.1", "--beta2", "0.9999", "--mc_samples", "2", "--prior_precision", "1e-3",
         "--clip_radius", "0.05"])
    (args,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--eval_mc_samples", "0", "--method_config", json.dumps(dataclasses.asdict(config))])
    ivon = args.method_config
    assert (ivon.ess, ivon.hess_init, ivon.beta2, ivon.mc_samples, args.eval_mc_samples) == (1e4, 0.1, 0.9999, 2, 0)
    # no preset named: the rate waits for the model the trainer is handed (one built here trains from scratch)
    assert args.method == "ivon" and args.learning_rate is None and ivon.clip_radius == 0.05
    assert args.for_model(TinyClassifier())[0].learning_rate == 0.2
    (erm,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(["--output_dir", "o",
                                                                                         "--method", "erm"])
    assert erm.learning_rate == 5e-5


def test_unknown_method_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="Unknown method 'sgld'"):
        make_args(tmp_path, method="sgld")


def test_ess_defaults_to_training_set_size(tmp_path):
    ds = digits_dataset(48)
    trainer = VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=ds)
    trainer.train()
    assert trainer.ivon.param_groups[0]["ess"] == 48.0


def test_best_model_reload_brings_its_posterior(tmp_path):
    """With load_best_model_at_end the Hessian is the best checkpoint's, not the last step's."""
    ds = digits_dataset(128)
    args = _trainer_args(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                         save_steps=3,
                         load_best_model_at_end=True, metric_for_best_model="accuracy", greater_is_better=True,
                         train_sampling_strategy="random")
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=ds, eval_dataset=ds)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    saved = torch.load(os.path.join(best, "optimizer.pt"), weights_only=True)
    assert torch.equal(trainer.ivon.hessian(), torch.cat([saved["state"][i]["hess"].flatten() for i in range(4)]))
    assert trainer.ivon.current_step == saved["param_groups"][0]["current_step"]


def test_hessian_diagnostics_logged_and_stuck_hessian_warned(tmp_path, caplog):
    ds = digits_dataset(64)
    args = _trainer_args(tmp_path, max_steps=4, logging_strategy="steps", logging_steps=2, beta2=0.99999)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=ds)
    with caplog.at_level("WARNING", logger="varsmooth.posterior.diagnostics"):
        trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert (logged
            and all({"hess_mean", "hess_median", "posterior_std_mean", "posterior_std_median"} <= set(e)
                    for e in logged))
    expected_std = 1 / np.sqrt(64 * (logged[-1]["hess_median"] + 2e-4))
    assert logged[-1]["posterior_std_median"] == pytest.approx(expected_std, rel=1e-3)
    assert "Hessian hardly moved" in caplog.text and "leave beta2 unset" in caplog.text
    # β2 unset: the run-length rule's window is at its floor here, and the advice is not to leave beta2 unset
    caplog.clear()
    unset = VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path / "u", max_steps=4, beta2=None),
                               train_dataset=ds)
    with caplog.at_level("WARNING", logger="varsmooth.posterior.diagnostics"):
        unset.train()
    assert "Hessian hardly moved" in caplog.text and "leave beta2 unset" not in caplog.text
    assert "at least 300 steps: pass a smaller beta2" in caplog.text
    # with β2 = 0.9 the Hessian moves and there is no warning
    caplog.clear()
    moving = VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path / "b", max_steps=4, beta2=0.9),
                                train_dataset=ds)
    with caplog.at_level("WARNING", logger="varsmooth.posterior.diagnostics"):
        moving.train()
    assert "Hessian hardly moved" not in caplog.text


def test_label_smoothing_factor_is_refused(tmp_path):
    with pytest.raises(ValueError, match="method='ls'"):
        VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, label_smoothing_factor=0.1))


def test_prior_precision_is_ivons_weight_decay(tmp_path):
    """IVON's δ is `prior_precision` (weight_decay is refused with IVON methods: test above)."""
    args = _trainer_args(tmp_path, max_steps=1, prior_precision=5e-3)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=digits_dataset(32))
    trainer.train()
    assert [g["weight_decay"] for g in trainer.ivon.param_groups] == [5e-3]


def test_with_transform_dataset_needs_no_flags(tmp_path):
    """`with_transform` reads raw columns at fetch time; the trainer keeps them without remove_unused_columns=False."""
    from example_utils.data import load_digits_dataset

    raw = load_digits_dataset()["train"].select(range(64))

    def transform(batch):
        pixels = torch.stack([torch.as_tensor(np.asarray(im, dtype="float32") / 255.0) for im in batch["image"]])
        return {"pixel_values": pixels, "labels": torch.as_tensor(batch["label"])}

    trainer = VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=2),
                                 train_dataset=raw.with_transform(transform),
                                 eval_dataset=raw.with_transform(transform))
    trainer.train()
    assert "eval_accuracy" in trainer.evaluate()
    assert raw.column_names == ["image", "label"]  # the user's dataset is untouched


def test_timm_model_keeps_timm_initialisation():
    """transformers would re-initialise a TimmWrapper from a config with N(0, 0.02)."""
    from example_utils.models import create_image_classifier

    model = create_image_classifier("test_resnet", {i: str(i) for i in range(10)}, num_channels=1)
    conv = next(p for p in model.timm_model.parameters() if p.dim() == 4)
    assert conv.std().item() > 0.05  # timm's fan-in init (≈0.11 here), not transformers' N(0, 0.02)


def test_finetune_preset_fills_only_untouched_ivon_fields():
    from varsmooth.presets import FINETUNE_PRESET

    args = VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True,
                                        method_config=IVONConfig(ivon_preset="finetune", beta2=0.99))
    assert args.method_config.beta2 == 0.99  # set by the user: kept
    for name in ("ess", "hess_init", "prior_precision", "rescale_lr", "clip_radius"):
        assert getattr(args.method_config, name) == FINETUNE_PRESET[name], name
    assert args.learning_rate == FINETUNE_PRESET["learning_rate"]
    scratch = VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True, method_config={"ivon_preset": "scratch"})
    ivon = scratch.method_config
    assert (scratch.learning_rate, ivon.hess_init, ivon.ess, ivon.rescale_lr) == (0.2, 0.5, None, True)
    # none named: every preset field waits for the model the trainer is handed
    unset = VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True)
    ivon = unset.method_config
    assert (unset.learning_rate, ivon.hess_init, ivon.ess, ivon.rescale_lr) == (None, None, None, None)
    # the preset is about IVON: another method has none
    with pytest.raises(ValueError, match=r"\['ivon_preset'\], which method='erm'"):
        VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True, method="erm",
                                     method_config={"ivon_preset": "finetune"})
    with pytest.raises(ValueError, match="ivon_preset must be"):
        IVONConfig(ivon_preset="pretrained")


def test_finetune_preset_builds_the_documented_optimizer(tmp_path):
    """σ0 = 1/sqrt(ess·(h0 + δ)) ≈ 3e-3 and IVON's clip radius 1e-3 reach the optimizer."""
    ds = digits_dataset(64)
    trainer = VariationalTrainer(model=TinyClassifier(), train_dataset=ds,
                                 args=make_args(tmp_path, ivon_preset="finetune", max_steps=1))
    trainer.create_optimizer()  # before any step: σ is the initial one
    group = trainer.ivon.param_groups[0]
    assert group["ess"] == 1e8 and group["weight_decay"] == 0.0 and group["clip_radius"] == 1e-3
    std = trainer.posterior().std
    assert all(torch.allclose(s, torch.full_like(s, (1e8 * 1e-3) ** -0.5), rtol=0.05) for s in std.values())


# -- issue 33: refused up front, with the problem and the fix --------------------------------------------------------
@pytest.mark.parametrize("value", [2.5, "2", True])
def test_a_fractional_sample_count_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=rf"mc_samples is a number of samples, a whole number, got {value!r}"):
        make_args(tmp_path, mc_samples=value)
    # a whole float (e.g. from a JSON config) is fine
    assert make_args(tmp_path, mc_samples=2.0).method_config.mc_samples == 2


def test_string_labels_are_refused_with_the_fix(tmp_path):
    clean = digits_dataset(32)
    ds = datasets.Dataset.from_dict({"pixel_values": clean[:]["pixel_values"].numpy(),
                                     "label": [["zero", "one"][int(y) % 2]
                                               for y in clean[:]["label"]]}).with_format("torch")
    with pytest.raises(ValueError, match=r"'label' column of train_dataset holds strings \(e.g. '(zero|one)'\).*"
                                         r"class_encode_column\('label'\)"):
        VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=ds)
    with pytest.raises(ValueError, match="column of eval_dataset holds strings"):
        VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=clean,
                           eval_dataset=ds)
    encoded = ds.with_format(None).class_encode_column("label").with_format("torch")  # the fix the message names
    VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=encoded).train()


def test_an_empty_training_set_is_refused(tmp_path):
    empty = digits_dataset(32).select([])
    with pytest.raises(ValueError, match="train_dataset has no examples"):
        VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=empty)


def _relabelled(dataset: datasets.Dataset, rows: dict[int, object] | None = None, dtype: str = "int64",
                default: object = None) -> datasets.Dataset:
    """`dataset` with a plain `label` column (no ClassLabel, which would refuse values outside its names) of `dtype`,
    `rows` set to the values given, every other row to `default` when given."""
    rows = rows or {}
    plain = dataset.with_format(None)
    labels = [rows.get(i, label if default is None else default) for i, label in enumerate(plain["label"])]
    plain = plain.remove_columns("label").add_column("label", labels)
    return plain.cast_column("label", datasets.Value(dtype)).with_format("torch")


@pytest.mark.parametrize("role", ["train_dataset", "eval_dataset"])
@pytest.mark.parametrize("rows, dtype, message", [
    ({5: 10}, "int64", r"holds 10 \(row 5; 1 rows in all, values \[10\]\), outside the model's 10 classes \[0, 10\)"),
    ({0: 57, 9: -3}, "int64", r"holds 57 \(row 0; 2 rows in all, values \[-3, 57\]\).*only -100 may mark"),
    ({3: -7}, "int32", r"holds -7 \(row 3;.*num_labels="),
    ({}, "float32", r"holds floats \(e.g. .*cast_column\('label', datasets.Value\('int64'\)\)"),
])
def test_labels_the_model_cannot_take_are_refused_before_the_first_step(tmp_path, role, rows, dtype, message):
    """Labels are checked at construction, in the training and every evaluation set, against the model's number of
    classes: a bad one found after training would cost the run (issue 42, classes 1 and 6)."""
    bad = _relabelled(digits_images(32), rows, dtype)
    sets = {"train_dataset": bad if role == "train_dataset" else digits_images(32)}
    if role == "eval_dataset":
        sets["eval_dataset"] = {"noisy": bad, "clean": digits_images(16)}
    with pytest.raises(ValueError, match=rf"'label' column of {role}.*" + message):
        VariationalTrainer(model=tiny_digits_resnet(), args=_trainer_args(tmp_path, max_steps=1), **sets)
    assert not os.path.exists(tmp_path / "checkpoint-1")
    ignored = _relabelled(digits_images(32), {0: -100, 1: -100})  # the ignore index is no error, in either role
    VariationalTrainer(model=tiny_digits_resnet(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=ignored,
                       eval_dataset=ignored)


def test_a_training_set_of_ignored_labels_only_is_refused(tmp_path):
    ignored = _relabelled(digits_images(32), default=-100)
    with pytest.raises(ValueError, match=r"Every row of train_dataset has 'label' = -100.*loss of 0"):
        VariationalTrainer(model=tiny_digits_resnet(), args=_trainer_args(tmp_path, max_steps=1), train_dataset=ignored)
    # as evaluation data it scores nothing but is no error
    VariationalTrainer(model=tiny_digits_resnet(), args=_trainer_args(tmp_path, max_steps=1),
                       train_dataset=digits_images(32), eval_dataset=ignored)


@pytest.mark.parametrize("role", ["train_dataset", "eval_dataset"])
def test_a_renamed_input_column_is_refused_with_the_rename_to_make(tmp_path, role):
    renamed = digits_images(32).rename_column("pixel_values", "image_array")
    sets = ({"train_dataset": renamed} if role == "train_dataset"
            else {"train_dataset": digits_images(32), "eval_dataset": renamed})
    with pytest.raises(ValueError, match=rf"No column of {role} \(\['image_array', 'label'\]\) is an input of the "
                                         r"model's forward \(\['pixel_values', .*rename_column\('image_array', "
                                         r"'pixel_values'\)"):
        VariationalTrainer(model=tiny_digits_resnet(), args=_trainer_args(tmp_path, max_steps=1), **sets)
    # with remove_unused_columns=False the columns go to forward() as they are: a collator may rename them
    VariationalTrainer(model=tiny_digits_resnet(),
                       args=_trainer_args(tmp_path, max_steps=1, remove_unused_columns=False),
                       train_dataset=digits_images(32), eval_dataset=renamed)


@pytest.mark.parametrize("method", ["ivon", "erm", "sam"])
@pytest.mark.parametrize("model, dataset, shape", [
    (tiny_digits_resnet, lambda: digits_images(32).with_format(None).map(
        lambda b: {"pixel_values": np.repeat(np.asarray(b["pixel_values"], "float32"), 3, axis=1)}, batched=True
    ).with_format("torch"), r"pixel_values \(16, 3, 8, 8\) float32"),
    (lambda: TinyClassifier(in_features=32), lambda: digits_dataset(32), r"pixel_values \(16, 8, 8\) float32"),
])
def test_inputs_of_a_shape_the_model_cannot_take_are_named_at_the_first_step(tmp_path, method, model, dataset, shape):
    """torch's shape error names neither the column nor the fix: the first step, before any update, names both."""
    trainer = VariationalTrainer(model=model(), args=make_args(tmp_path, max_steps=2, method=method),
                                 train_dataset=dataset())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    # the type of the model's own error is kept (torch raises RuntimeError, HF's ResNet a ValueError)
    with pytest.raises((RuntimeError, ValueError),
                       match=r"cannot take the first training batch \((RuntimeError|ValueError): .*\)\. The batch "
                             rf"holds: (.*, )?{shape}(, .*)?\. Give the model the inputs"):
        trainer.train()
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))  # no update was applied


@pytest.mark.parametrize("method", ["erm", "sam", "ls"])
@pytest.mark.parametrize("setting", [dict(ess=100.0), dict(hess_init=0.1), dict(mc_samples=2), dict(beta2=0.999),
                                     dict(posterior_temperature=0.5), dict(prior_precision=1e-3), dict(clip_radius=0.1),
                                     dict(rescale_lr=False), dict(ivon_compiled=False), dict(hessian_window=0.5)])
def test_ivon_settings_with_a_method_without_ivon_are_refused_by_name(tmp_path, method, setting):
    (name, value), = setting.items()
    if name in POSTERIOR_FIELDS:  # a setting of prediction with a posterior, which the method learns none of
        with pytest.raises(ValueError,
                           match=rf"^{name}={value!r} is a setting of prediction with IVON's posterior, and "
                                             rf"method='{method}' learns none.*Drop {name}, or choose an IVON method"):
            make_args(tmp_path, method=method, **setting)
    else:  # an IVON setting: not a field of the other method's config
        with pytest.raises(ValueError, match=rf"method_config has \['{name}'\], which method='{method}'"):
            make_args(tmp_path, method=method, method_config=setting)
    args = make_args(tmp_path, method=method)  # the defaults are no setting: accepted and copied
    assert dataclasses.replace(args).method == method
    make_args(tmp_path, method="ivon", **setting)  # IVON takes them


# -- compute_loss_func ---------------------------------------------------------------------------------
def test_compute_loss_func_drives_ivon_training(tmp_path):
    """3x the cross-entropy: the trainer must match the hand-written IVON loop on the 3x loss, not on the plain one."""
    ds = digits_dataset(64)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    calls = []

    def tripled(outputs, labels, num_items_in_batch=None):
        calls.append((labels.shape[0], int(num_items_in_batch)))
        return 3.0 * F.cross_entropy(outputs.logits, labels)

    steps, batch = 3, 16
    trainer = VariationalTrainer(model=model,
                                 args=_sequential_args(tmp_path, max_steps=steps, per_device_train_batch_size=batch),
                                 train_dataset=ds, compute_loss_func=tripled)
    trainer.train()
    x, y = ds[:]["pixel_values"], ds[:]["label"]

    def batches(step):
        return [(x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch])]

    kw = dict(lr=0.2, hess_init=0.5, beta1=0.9, beta2=0.999, wd=2e-4, ess=len(ds), seed=0)
    ref3, _ = reference_ivon_loop(init, batches, steps, loss_scale=3.0, **kw)
    ref1, _ = reference_ivon_loop(init, batches, steps, **kw)
    assert _max_diff(ref3, ref1) > 1e-3  # the factor changes IVON's run (its Hessian estimate scales with g)
    assert _max_diff(trainer.model, ref3) < 1e-6
    # one call per posterior sample, on the micro-batch, with its labelled examples as num_items_in_batch
    assert calls == [(batch, batch)] * steps


def test_compute_loss_func_replaces_the_loss_of_non_ivon_methods(tmp_path):
    ds = digits_dataset(32)
    model = TinyClassifier()
    before = copy.deepcopy(model)
    args = make_args(tmp_path, method="erm", optim="sgd", learning_rate=0.5, max_steps=2)
    trainer = VariationalTrainer(
        model=model, args=args, train_dataset=ds,
        compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0.0 * outputs.logits.sum())
    trainer.train()
    assert _max_diff(model, before) == 0.0  # a zero loss moves nothing; cross-entropy would have


def test_compute_loss_func_with_a_method_that_has_its_own_loss_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func would replace the training loss of method='ls'"):
        VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, method="ls"),
                           train_dataset=digits_dataset(16),
                           compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum())


# -- compute_metrics -----------------------------------------------------------------------------------
class _PixelClassifier(TinyClassifier):
    main_input_name = "pixel_values"  # what include_for_metrics=["inputs"] passes on, as for HF vision models


class _BatchedCount:
    """A user's batch-wise metric, as transformers documents it: accumulate, report on `compute_result`."""

    def __init__(self):
        self.seen, self.calls, self.with_inputs, self.with_losses = 0, 0, 0, 0

    def __call__(self, eval_pred, compute_result):
        self.calls += 1
        self.seen += len(eval_pred.label_ids)
        self.with_inputs += eval_pred.inputs is not None
        self.with_losses += eval_pred.losses is not None
        return {"examples": self.seen} if compute_result else {}


def test_batch_eval_metrics_gives_the_same_metrics_and_the_user_sees_every_batch(tmp_path):
    ds = digits_dataset(100)
    common = dict(max_steps=3, eval_mc_samples=4, per_device_eval_batch_size=32, include_for_metrics=["inputs", "loss"])
    torch.manual_seed(0)
    model = _PixelClassifier()
    whole = VariationalTrainer(model=copy.deepcopy(model), args=make_args(tmp_path / "a", **common), train_dataset=ds,
                               eval_dataset=ds)
    whole.train()
    expected = whole.evaluate()
    count = _BatchedCount()
    batched = VariationalTrainer(model=copy.deepcopy(model),
                                 args=make_args(tmp_path / "b", batch_eval_metrics=True, **common),
                                 train_dataset=ds, eval_dataset=ds, compute_metrics=count)
    batched.train()
    got = batched.evaluate()
    for key in ("eval_accuracy", "eval_nll", "eval_ece", "eval_brier", "eval_mean_accuracy", "eval_mean_nll"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key
    assert got["eval_examples"] == 100 and count.calls == 4  # 32 + 32 + 32 + 4
    assert count.with_inputs == count.with_losses == 4


def test_user_metrics_get_inputs_and_losses(tmp_path):
    ds = digits_dataset(40)
    seen = {}

    def metrics(eval_pred):
        seen.update(inputs=eval_pred.inputs, losses=eval_pred.losses, predictions=eval_pred.predictions)
        return {}

    trainer = VariationalTrainer(model=_PixelClassifier(),
                                 args=make_args(tmp_path, max_steps=1, include_for_metrics=["inputs", "loss"]),
                                 train_dataset=ds, eval_dataset=ds, compute_metrics=metrics)
    trainer.train()
    trainer.evaluate()
    np.testing.assert_allclose(seen["inputs"], ds[:]["pixel_values"].numpy())
    assert seen["losses"].shape == (40,)
    np.testing.assert_allclose(np.exp(seen["predictions"]).sum(1), 1.0, atol=1e-5)  # log P̂, as documented


def test_batch_eval_metrics_needs_compute_result_in_the_users_function(tmp_path):
    with pytest.raises(ValueError, match="compute_result"):
        VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, batch_eval_metrics=True),
                           compute_metrics=lambda eval_pred: {})


# -- a saved IVON model in a new trainer ----------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    train, test = digits_images(128), digits_images(48)
    # τ fixed at 1: the tests below are about predicting with the saved posterior, not about choosing τ
    trainer = VariationalTrainer(model=tiny_digits_resnet(), train_dataset=train, eval_dataset=test,
                                 args=make_args(out, max_steps=8, eval_mc_samples=4, beta2=0.99,
                                                posterior_temperature=1.0))
    trainer.train()
    trainer.save_model(str(out))
    return out, test, trainer.evaluate()


def _bma_probs(folder, test):
    loaded = VariationalModel.from_pretrained(folder, num_samples=4, seed=0)
    with torch.no_grad():
        return loaded(pixel_values=test[:]["pixel_values"]).probs.numpy()


def test_new_trainer_on_a_saved_model_predicts_by_bma_with_its_posterior(saved, tmp_path, caplog):
    out, test, trained_metrics = saved
    model = ResNetForImageClassification.from_pretrained(out)
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test)
    with caplog.at_level("WARNING", logger="varsmooth.trainer.trainer"):
        metrics = trainer.evaluate()
    assert "no posterior" not in caplog.text
    labels = test[:]["label"].numpy()
    assert metrics["eval_nll"] == pytest.approx(log_loss(labels, _bma_probs(out, test), labels=range(10)), rel=1e-5)
    assert metrics["eval_nll"] == pytest.approx(trained_metrics["eval_nll"], rel=1e-5)
    assert metrics["eval_nll"] != pytest.approx(metrics["eval_mean_nll"], rel=1e-4)  # BMA, not the mean


def test_posterior_passed_to_the_trainer_is_used(saved, tmp_path):
    out, test, trained_metrics = saved
    elsewhere = tmp_path / "weights_only"
    ResNetForImageClassification.from_pretrained(out).save_pretrained(elsewhere)  # no posterior file there
    model = ResNetForImageClassification.from_pretrained(elsewhere)
    # the whole prediction (σ, τ, each draw's BatchNorm statistics), as the trained model predicted
    predictor = PosteriorPredictor.load(model, out / POSTERIOR_FILE)
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test,
                                 posterior=predictor)
    assert trainer.evaluate()["eval_nll"] == pytest.approx(trained_metrics["eval_nll"], rel=1e-5)
    # σ alone: the same posterior, its draws normalising with the mean's statistics (another prediction)
    alone = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test,
                               posterior=DiagonalGaussianPosterior.load(model, out / POSTERIOR_FILE))
    assert alone.posterior().std.keys() == predictor.posterior.std.keys()
    assert alone.evaluate()["eval_nll"] != pytest.approx(trained_metrics["eval_nll"], rel=1e-3)


@pytest.mark.parametrize("given", ["beside the model", "as posterior="])
def test_a_loaded_posterior_is_saved_with_the_model_it_came_with(saved, tmp_path, given):
    """A trainer that predicts with a loaded posterior and never trains saves that posterior beside the weights: the
    new folder predicts as the trained run did, and `VariationalModel` loads it (a folder of weights alone would be
    a model whose BMA the trainer could not reproduce)."""
    out, test, trained_metrics = saved
    if given == "beside the model":
        model = ResNetForImageClassification.from_pretrained(out)
        trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test)
    else:
        ResNetForImageClassification.from_pretrained(out).save_pretrained(tmp_path / "weights_only")
        model = ResNetForImageClassification.from_pretrained(tmp_path / "weights_only")
        trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test,
                                     posterior=PosteriorPredictor.load(model, out / POSTERIOR_FILE))
    again = tmp_path / "saved_again"
    trainer.save_model(str(again))
    assert (again / POSTERIOR_FILE).is_file()
    original = DiagonalGaussianPosterior.load(model, out / POSTERIOR_FILE).std
    copied = DiagonalGaussianPosterior.load(model, again / POSTERIOR_FILE).std
    assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in original)
    assert min(float(s.min()) for s in copied.values()) > 0  # a posterior, not a point mass written out
    np.testing.assert_allclose(_bma_probs(again, test), _bma_probs(out, test), rtol=1e-5, atol=1e-7)
    reloaded = VariationalTrainer(model=ResNetForImageClassification.from_pretrained(again),
                                  args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test)
    assert reloaded.evaluate()["eval_nll"] == pytest.approx(trained_metrics["eval_nll"], rel=1e-5)


def test_bma_without_posterior_warns_and_names_the_metrics_after_the_mean(tmp_path, caplog):
    tiny_digits_resnet().save_pretrained(tmp_path / "plain")
    model = ResNetForImageClassification.from_pretrained(tmp_path / "plain")
    test = digits_images(32)
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test)
    with caplog.at_level("WARNING", logger="varsmooth.trainer.trainer"):
        metrics = trainer.evaluate()
    assert "asks for Bayesian model averaging, but there is no posterior" in caplog.text
    assert "eval_accuracy" not in metrics and "eval_nll" not in metrics
    with torch.no_grad():
        probs = model(pixel_values=test[:]["pixel_values"]).logits.softmax(-1).numpy()
    assert metrics["eval_mean_nll"] == pytest.approx(log_loss(test[:]["label"].numpy(), probs, labels=range(10)),
                                                     rel=1e-5)
    # asking for the mean (eval_mc_samples=0) is not a reason to warn
    caplog.clear()
    at_mean = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=0), eval_dataset=test)
    with caplog.at_level("WARNING", logger="varsmooth.trainer.trainer"):
        assert "eval_nll" in at_mean.evaluate()
    assert "no posterior" not in caplog.text


def test_posterior_of_another_head_is_not_used(saved, tmp_path, caplog):
    out, _, _ = saved
    model = ResNetForImageClassification.from_pretrained(out, num_labels=3, ignore_mismatched_sizes=True)
    with caplog.at_level("WARNING", logger="varsmooth.trainer.trainer"):
        trainer = VariationalTrainer(model=model, args=make_args(tmp_path))
    assert trainer.posterior().is_point_mass and "does not belong to this model" in caplog.text


# -- the "Hessian hardly moved" warning ------------------------------------------------------------------
def test_hessian_warning_fires_on_a_run_like_the_default_digits_example(tmp_path, caplog):
    """The image example's default (β2 = 0.99999, ~1,350 steps on digits) gives the learned curvature a weight of
    1 − β2^T ≈ 1.3 % (median h 0.5 → 0.493). 14 steps at β2 = 0.999 give it the same weight, in a second."""
    steps, beta2 = 14, 0.999
    assert 1 - beta2 ** steps == pytest.approx(1 - 0.99999 ** 1350, rel=0.05)
    trainer = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, max_steps=steps, beta2=beta2),
                                 train_dataset=digits_dataset(224))
    with caplog.at_level("WARNING", logger="varsmooth.posterior.diagnostics"):
        trainer.train()
    assert "Hessian hardly moved" in caplog.text
    moved = ((trainer.ivon.hessian() - 0.5).abs().median() / 0.5).item()
    assert 0.005 < moved < HESSIAN_STUCK_TOLERANCE  # it moved, by about the digits run's 1.4 %, yet not enough


def test_a_hessian_that_only_forgot_h0_is_not_counted_as_learned():
    """A weight without curvature (gradient 0) only decays from h0 towards h0·β2^t; one with curvature c ≫ h0 moves
    towards c. Only the second is learned from the data, though both moved far from h0."""
    torch.manual_seed(0)
    flat, curved = torch.nn.Parameter(torch.randn(30)), torch.nn.Parameter(torch.randn(10))
    opt = VariationalIVON([flat, curved], lr=0.01, ess=100.0, hess_init=0.5, beta2=0.99, weight_decay=1e-4,
                          sample_seed=0)
    for _ in range(100):
        with opt.sampled_params(train=True):
            (0.0 * flat.sum() + 25.0 * curved.square().sum()).backward()  # curvature 0 and 50
        opt.step()
        opt.zero_grad()
    got = hessian_summary(opt)
    assert got["hess_decayed"] == pytest.approx(0.5 * 0.99**100)
    h = opt.hessian()
    assert ((h[:30] - 0.5).abs() / 0.5).min() > 0.5  # far from h0, yet
    assert ((h[:30] - got["hess_decayed"]).abs() / got["hess_decayed"]).max() < 0.01  # only forgotten
    assert got["hess_data_share"] == pytest.approx(10 / 40)


def test_readme_states_the_threshold_of_the_code():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stated = re.findall(r"hardly moved \(median relative change from `hess_init` below (\d+) %", readme)
    assert stated == [f"{HESSIAN_STUCK_TOLERANCE * 100:.0f}"]


class _WeightedLossTrainer(VariationalTrainer):
    """The Trainer's extension point: a subclass's own `compute_loss` (here, twice the cross-entropy)."""

    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        type(self).calls += 1
        loss = 2.0 * F.cross_entropy(model(pixel_values=inputs["pixel_values"]).logits, inputs["labels"])
        return (loss, None) if return_outputs else loss


def test_a_subclass_compute_loss_is_what_every_posterior_sample_backpropagates(tmp_path):
    """IVON's Monte-Carlo step runs in the method (it never calls back into the trainer), but a trainer subclass that
    overrides `compute_loss` still computes the loss of every sample: the run equals one with a doubled loss."""
    data = digits_dataset(32)
    common = dict(max_steps=3, mc_samples=2, learning_rate=0.1, beta2=0.99, train_sampling_strategy="sequential",
                  lr_scheduler_type="constant", per_device_train_batch_size=16, logging_strategy="steps",
                  logging_steps=1)
    torch.manual_seed(0)
    init = TinyClassifier()
    _WeightedLossTrainer.calls = 0
    weighted = _WeightedLossTrainer(model=copy.deepcopy(init), args=make_args(tmp_path / "a", **common),
                                    train_dataset=data)
    weighted.train()
    assert _WeightedLossTrainer.calls == 3 * 2  # steps × samples
    plain = VariationalTrainer(model=copy.deepcopy(init), args=make_args(tmp_path / "b", **common), train_dataset=data)
    plain.train()
    # the first step: the same weights and the same posterior draws, so the logged loss is exactly doubled
    first = [next(e["loss"] for e in t.state.log_history if "loss" in e) for t in (weighted, plain)]
    assert first[0] == pytest.approx(2 * first[1], rel=1e-4)
    assert not torch.equal(weighted.model.head.weight, plain.model.head.weight)  # and the doubled gradient moved it


def test_the_training_sets_noise_report_spans_the_models_classes(tmp_path):
    """Integer labels in which the last class never occurs: the realized noise report the trainer saves counts the
    model's 10 classes (config.num_labels), not the 9 that max(label) + 1 would infer, and says nothing of inferring."""
    import warnings

    from varsmooth.corruption import corrupt_labels

    ds = digits_images(120).with_format(None)
    ds = ds.filter(lambda row: row["label"] != 9).cast_column("label", datasets.Value("int64"))
    train = corrupt_labels(ds, "symmetric", 0.0, seed=0, num_classes=10).with_format("torch")
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=make_args(tmp_path, max_steps=1),
                                 train_dataset=train)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = trainer.train_noise_report()
    assert report.num_classes == 10 and len(report.realized_transition) == 10
    assert report.class_counts[9] == 0 and sum(report.class_counts) == len(train)

    # a ClassLabel names the classes itself, and a model with more outputs (12) is no contradiction to refuse
    twelve = {i: str(i) for i in range(12)}
    model = ResNetForImageClassification(dataclasses.replace(tiny_digits_resnet().config, id2label=twelve,
                                                             label2id={v: k for k, v in twelve.items()}))
    assert model.config.num_labels == 12
    classed = corrupt_labels(digits_images(60).with_format(None), "symmetric", 0.2, seed=0).with_format("torch")
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, max_steps=1), train_dataset=classed)
    assert trainer.train_noise_report().num_classes == 10
