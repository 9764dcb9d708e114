"""VariationalTrainer trains exactly like a hand-written IVON loop and avoids the pitfalls of a naive Trainer integration
(weight decay fed into IVON's prior, clipped or scaled sample gradients, re-initialised models, lost optimizer state)."""

from __future__ import annotations

import copy
import os

import datasets
import numpy as np
import pytest
import torch
from transformers import HfArgumentParser

from helpers import TinyClassifier, digits_dataset, make_args, reference_ivon_loop
from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.posterior import VariationalIVON
from varsmooth.methods.ivon import check_ivon_sharding

IVON_KW = dict(lr=0.2, hess_init=0.5, beta1=0.9, beta2=0.999, wd=2e-4)


def _trainer_args(tmp_path, **kw):
    base = dict(learning_rate=IVON_KW["lr"], hess_init=IVON_KW["hess_init"], beta1=IVON_KW["beta1"],
                beta2=IVON_KW["beta2"], prior_precision=IVON_KW["wd"], lr_scheduler_type="constant",
                max_grad_norm=0.0, train_sampling_strategy="sequential")
    base.update(kw)
    return make_args(tmp_path, **base)


def _sequential_batches(ds, batch, grad_accum):
    x, y = ds[:]["pixel_values"], ds[:]["label"]

    def batches(step):
        start = step * batch * grad_accum
        return [(x[start + k * batch: start + (k + 1) * batch], y[start + k * batch: start + (k + 1) * batch])
                for k in range(grad_accum)]
    return batches


def _max_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("grad_accum,mc_samples,clip", [(1, 1, 0.0), (2, 1, 0.0), (2, 2, 0.0), (1, 2, 0.5)])
def test_trainer_matches_hand_written_ivon_loop(tmp_path, grad_accum, mc_samples, clip):
    """Weights, Hessian and step counter equal the ivon-opt README loop run on the same samples.

    Covers: forward and backward inside the sampling context, gradients zeroed per sample, one sample per
    micro-batch with its mean loss (not divided by the accumulation count), clipping inside the context.
    """
    ds = digits_dataset(128)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    steps, batch = 4, 16
    args = _trainer_args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=grad_accum,
                         max_steps=steps, mc_samples=mc_samples, max_grad_norm=clip)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()
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


def test_resume_is_exact(tmp_path):
    """Train 2N steps == train N, checkpoint, resume, train N (weights, Hessian, step counter, data order)."""
    ds = digits_dataset(256)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    common = dict(max_steps=8, per_device_train_batch_size=16, gradient_accumulation_steps=2, lr_scheduler_type="cosine",
                  warmup_steps=2, beta2=0.999, train_sampling_strategy="random")
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
    with pytest.raises(ValueError, match="IVON's weight decay is the precision of its Gaussian prior, `prior_precision`"):
        make_args(tmp_path, weight_decay=0.01)
    assert make_args(tmp_path, method="erm", weight_decay=0.01).weight_decay == 0.01  # AdamW's, as in TrainingArguments


def test_fp16_refused_with_clear_error(tmp_path):
    with pytest.raises(ValueError, match="fp16 with a gradient scaler is not supported with IVON"):
        make_args(tmp_path, fp16=True)


def test_low_precision_weights_refused(tmp_path):
    model = TinyClassifier().to(torch.bfloat16)
    trainer = VariationalTrainer(model=model, args=_trainer_args(tmp_path, max_steps=1), train_dataset=digits_dataset(32))
    with pytest.raises(ValueError, match="IVON needs fp32 trainable weights"):
        trainer.train()


def test_ivon_accepts_fsdp2_and_refuses_fsdp1_and_deepspeed(tmp_path):
    """FSDP2 (DTensor parameters) is what IVON trains sharded; FSDP1 and DeepSpeed are refused naming the fix."""
    args = make_args(tmp_path, fsdp=True, fsdp_config={"version": 2})
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    with pytest.raises(ValueError, match=r"IVON needs FSDP2 .* got FSDP version 1.*fsdp_config=\{'version': 2\}"):
        make_args(tmp_path, fsdp=True, fsdp_config={"version": 1})
    assert make_args(tmp_path, method="erm", fsdp=True, fsdp_config={"version": 1}).fsdp  # not IVON: the Trainer's affair
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
    (args,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--ess", "1e4", "--hess_init", "0.1", "--beta2", "0.9999", "--mc_samples", "2",
         "--eval_mc_samples", "0", "--prior_precision", "1e-3", "--clip_radius", "0.05"])
    assert (args.ess, args.hess_init, args.beta2, args.mc_samples, args.eval_mc_samples) == (1e4, 0.1, 0.9999, 2, 0)
    assert args.method == "ivon" and args.learning_rate == 0.2 and args.clip_radius == 0.05
    (erm,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(["--output_dir", "o", "--method", "erm"])
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
    args = _trainer_args(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3,
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
    assert logged and all({"hess_mean", "hess_median", "posterior_std_mean", "posterior_std_median"} <= set(e) for e in logged)
    expected_std = 1 / np.sqrt(64 * (logged[-1]["hess_median"] + 2e-4))
    assert logged[-1]["posterior_std_median"] == pytest.approx(expected_std, rel=1e-3)
    assert "Hessian hardly moved" in caplog.text
    # with β2 = 0.9 the Hessian moves and there is no warning
    caplog.clear()
    moving = VariationalTrainer(model=TinyClassifier(), args=_trainer_args(tmp_path / "b", max_steps=4, beta2=0.9), train_dataset=ds)
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
                                 train_dataset=raw.with_transform(transform), eval_dataset=raw.with_transform(transform))
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

    parser = HfArgumentParser(VariationalTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "/tmp/x", "--use_cpu", "--ivon_preset", "finetune", "--beta2", "0.99"])
    assert args.beta2 == 0.99  # set by the user: kept
    for name in ("ess", "hess_init", "prior_precision", "rescale_lr", "clip_radius", "learning_rate"):
        assert getattr(args, name) == FINETUNE_PRESET[name], name
    scratch = VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True)
    assert (scratch.learning_rate, scratch.hess_init, scratch.ess, scratch.rescale_lr) == (0.2, 0.5, None, True)
    # the preset is about IVON: another method keeps its own defaults
    erm = VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True, method="erm", ivon_preset="finetune")
    assert erm.learning_rate == 5e-5
    with pytest.raises(ValueError, match="ivon_preset must be"):
        VariationalTrainingArguments(output_dir="/tmp/x", use_cpu=True, ivon_preset="pretrained")


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
    assert make_args(tmp_path, mc_samples=2.0).mc_samples == 2  # a whole float (e.g. from a JSON config) is fine


def test_string_labels_are_refused_with_the_fix(tmp_path):
    clean = digits_dataset(32)
    ds = datasets.Dataset.from_dict({"pixel_values": clean[:]["pixel_values"].numpy(),
                                     "label": [["zero", "one"][int(y) % 2] for y in clean[:]["label"]]}).with_format("torch")
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
