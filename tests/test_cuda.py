"""The same guarantees on a CUDA GPU: placement, exact IVON arithmetic, resume, bf16, CPU reload, pipelines; and the
uncertainty baselines there: MC dropout's forked CUDA RNG, temperature scaling fitted on the GPU and applied after a
CPU reload, an ensemble whose members follow the pipeline to the GPU.

Skipped without a GPU (CI has none); run on a GPU machine with `python -m pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from helpers import (
    WORKERS,
    SeededIVON,
    TinyClassifier,
    digits_dataset,
    give_indexed_noise,
    indexed_noise,
    make_args,
    reference_ivon_loop,
    run_script,
    tiny_digits_resnet,
)
from test_ensemble import SENTENCES, point, tiny_bert, tiny_tokenizer, with_posterior
from test_mc_dropout import NormDropoutClassifier
from varsmooth import (
    DeepEnsemble,
    VariationalIVON,
    VariationalModel,
    VariationalTrainer,
    mc_dropout_predictive,
    pipeline,
)
from varsmooth.posterior import DiagonalGaussianPosterior

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

IVON_KW = dict(lr=0.2, hess_init=0.5, beta1=0.9, beta2=0.999, wd=2e-4)


def _gpu_args(tmp_path, **kw):
    base = dict(use_cpu=False, learning_rate=IVON_KW["lr"], hess_init=IVON_KW["hess_init"], beta1=IVON_KW["beta1"],
                beta2=IVON_KW["beta2"], prior_precision=IVON_KW["wd"], lr_scheduler_type="constant",
                max_grad_norm=0.0, train_sampling_strategy="sequential")
    base.update(kw)
    return make_args(tmp_path, **base)


def _max_diff(a, b):
    return max((pa.detach().cpu() - pb.detach().cpu()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def test_cuda_training_matches_hand_written_loop_on_the_gpu(tmp_path, monkeypatch):
    """GA 2 × 2 MC samples on the GPU == the ivon-opt README loop on the GPU, on the same (given) noise; all optimizer
    state lives there."""
    give_indexed_noise(monkeypatch)
    ds = digits_dataset(128)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    steps, batch, ga = 4, 16, 2
    trainer = VariationalTrainer(model=model, train_dataset=ds, args=_gpu_args(
        tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=ga, max_steps=steps, mc_samples=2))
    trainer.train()
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    assert all(t.device.type == "cuda" for state in trainer.ivon.state.values() for t in state.values())

    x, y = ds[:]["pixel_values"].cuda(), ds[:]["label"].cuda()

    def batches(step):
        s = step * batch * ga
        return [(x[s + k * batch: s + (k + 1) * batch], y[s + k * batch: s + (k + 1) * batch]) for k in range(ga)]

    ref, ref_opt = reference_ivon_loop(init.cuda(), batches, steps, ess=len(ds), seed=0, mc_samples=2,
                                       noise=indexed_noise, **IVON_KW)
    assert _max_diff(trainer.model, ref) < 1e-5
    assert torch.allclose(trainer.ivon.hessian(), ref_opt.param_groups[0]["hess"], atol=1e-5, rtol=1e-5)
    assert (trainer.ivon.hessian() - 0.5).abs().max() > 1e-3


@pytest.mark.parametrize("compiled", [True, False])
def test_engine_on_cuda_matches_ivon_opt_and_never_waits_for_the_device(compiled, monkeypatch):
    """Both CUDA paths (Triton kernels drawing e in the kernel; foreach ops) follow ivon-opt on the same given noise,
    with 1 and 2 samples per step; with the engine's own noise the step uses the e of the sample (checked against
    ivon-opt's formulas on θ - m); a sample and a step make no host sync; the Triton path holds one buffer besides
    the state."""
    from test_engine import IVON_KW as KW, MLP, _data, _groups

    kw = {k: v for k, v in KW.items() if k != "weight_decay"}
    give_indexed_noise(monkeypatch)
    for samples in (1, 2):
        torch.manual_seed(0)
        model = MLP().cuda()
        runs = []
        for make in (lambda g: VariationalIVON(g, sample_seed=3, compiled=compiled, **kw),
                     lambda g: SeededIVON(g, seed=3, noise=indexed_noise, **kw)):
            m = copy.deepcopy(model)
            opt = make(_groups(m, KW["weight_decay"]))
            x, y = (t.cuda() for t in _data(20 * samples))
            for step in range(20):
                for k in range(samples):
                    with opt.sampled_params(train=True):
                        opt.zero_grad()
                        torch.nn.functional.cross_entropy(m(x[step * samples + k]), y[step * samples + k]).backward()
                opt.step()
            runs.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
        torch.testing.assert_close(runs[0], runs[1], atol=1e-6, rtol=1e-6)
    # the engine's own noise, one step against ivon-opt's formulas; then a step with host syncs refused
    import ivon

    monkeypatch.undo()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(300, 40, device="cuda"))
    opt = VariationalIVON([w], lr=0.1, ess=50.0, hess_init=0.4, beta2=0.9, weight_decay=1e-2, sample_seed=1,
                          compiled=compiled)
    for checked in (True, False):
        m0 = w.detach().clone()
        if not checked:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with opt.sampled_params(train=True):
                n = w.detach() - m0
                (w.square().sum() + w.pow(3).sum()).backward()
                g = w.grad.clone()
                if compiled:
                    assert sum(t.numel() for t in opt._buffers[w].values() if t is not None) == w.numel()
            h0 = opt.state[w]["hess"].clone()
            mom0 = opt.state[w]["momentum"].clone()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if checked:
            mom = ivon.IVON._new_momentum(g, mom0, 0.9)
            hess = ivon.IVON._new_hess("price", h0, n * g, None, slice(None), 50.0, 0.9, 1e-2)
            # the noise read off the sample, n = θ − m, is θ's float32 rounding away from the engine's σ⊙e; the
            # update scales it by (1 − β2)·ess·(h0 + δ)·|g| (an H100 saw 4e-5 where |θ| ≈ 4)
            rounding = (1 - 0.9) * 50.0 * (0.4 + 1e-2) * torch.finfo(torch.float32).eps * (m0 + n).abs() * g.abs()
            assert ((opt.state[w]["hess"] - hess).abs() <= rounding + 1e-5 + 1e-5 * hess.abs()).all()
            # the mean's update on the engine's Hessian, so that the rounding above is not counted twice
            expected = ivon.IVON._new_param_averages(m0, opt.state[w]["hess"], mom, 0.1 * (0.4 + 1e-2), 1e-2,
                                                     float("inf"), 0.1, 0.4)
            torch.testing.assert_close(w.detach(), expected, atol=1e-5, rtol=1e-5)
        w.grad = None


def test_cuda_resume_continues_the_same_run(tmp_path):
    ds = digits_dataset(256)
    torch.manual_seed(0)
    init = TinyClassifier()
    common = dict(max_steps=8, per_device_train_batch_size=16, lr_scheduler_type="cosine", warmup_steps=2,
                  train_sampling_strategy="random")
    full = VariationalTrainer(model=copy.deepcopy(init), args=_gpu_args(tmp_path / "full", **common), train_dataset=ds)
    full.train()
    half_args = _gpu_args(tmp_path / "half", save_strategy="steps", save_steps=4, **common)
    VariationalTrainer(model=copy.deepcopy(init), args=half_args, train_dataset=ds).train()
    resumed = VariationalTrainer(model=copy.deepcopy(init), args=half_args, train_dataset=ds)
    resumed.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-4"))
    assert all(t.device.type == "cuda" for state in resumed.ivon.state.values() for t in state.values())
    assert _max_diff(full.model, resumed.model) < 1e-6
    assert torch.allclose(full.ivon.hessian(), resumed.ivon.hessian(), atol=1e-7)
    assert resumed.ivon.current_step == 8


def test_bf16_on_cuda_keeps_fp32_state_and_learns(tmp_path):
    """bf16 autocast: fp32 weights and Hessian, and the run stays close to the fp32 run from the same start."""
    ds = digits_dataset(512)
    torch.manual_seed(0)
    init = TinyClassifier(hidden=32)
    runs = {}
    for bf16 in (False, True):
        trainer = VariationalTrainer(model=copy.deepcopy(init), train_dataset=ds, eval_dataset=ds, args=_gpu_args(
            tmp_path / str(bf16), bf16=bf16, max_steps=60, per_device_train_batch_size=32, eval_mc_samples=8))
        trainer.train()
        runs[bf16] = (trainer, trainer.evaluate())
    trainer, metrics = runs[True]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert trainer.ivon.hessian().dtype == torch.float32 and torch.isfinite(trainer.ivon.hessian()).all()
    assert metrics["eval_accuracy"] > 0.8  # 10 classes: chance is 0.1
    assert abs(metrics["eval_accuracy"] - runs[False][1]["eval_accuracy"]) < 0.05
    rel = [((a - b).norm() / b.norm()).item()
           for a, b in zip(trainer.model.parameters(), runs[False][0].model.parameters())]
    assert max(rel) < 0.1, rel


def test_gpu_trained_posterior_reloads_on_cpu(tmp_path):
    """A model trained on the GPU predicts the same on the CPU after save/load (at the mean; BMA draws are per
    device)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          downsample_in_first_stage=False, num_labels=10)
    ds = digits_dataset(256).map(lambda b: {"pixel_values": np.asarray(b["pixel_values"])[:, None]}, batched=True)
    ds = ds.with_format("torch")
    torch.manual_seed(0)
    trainer = VariationalTrainer(model=ResNetForImageClassification(config), train_dataset=ds,
                                 args=_gpu_args(tmp_path / "run", max_steps=10, eval_mc_samples=4))
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    x = ds[:32]["pixel_values"]
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False  # TF32 convs differ by ~1e-4
    try:
        with torch.no_grad():
            trainer.model.eval()
            gpu_logits = trainer.model(pixel_values=x.cuda()).logits.cpu()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    loaded = VariationalModel.from_pretrained(tmp_path / "model", num_samples=0)
    with torch.no_grad():
        cpu_logits = loaded(pixel_values=x).logits
    assert torch.allclose(gpu_logits.log_softmax(-1), cpu_logits, atol=1e-4)
    posterior = DiagonalGaussianPosterior.load(loaded.model, tmp_path / "model")
    assert all(s.device.type == "cpu" for s in posterior.std.values())
    std_gpu = trainer.posterior().std
    assert all(s.device.type == "cuda" for s in std_gpu.values())
    for name, s in posterior.std.items():
        assert torch.allclose(s, std_gpu[name].cpu())


def test_pipeline_runs_on_the_gpu(tmp_path, monkeypatch):
    from transformers import ResNetConfig, ResNetForImageClassification, ViTImageProcessor

    config = ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          downsample_in_first_stage=False, num_labels=10,
                          id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)})
    processor = ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False)
    ds = digits_dataset(128)
    ds = ds.map(lambda b: {"pixel_values": np.asarray(b["pixel_values"])[:, None]}, batched=True).with_format("torch")
    trainer = VariationalTrainer(model=ResNetForImageClassification(config), train_dataset=ds,
                                 processing_class=processor,
                                 args=_gpu_args(tmp_path / "run", max_steps=5, eval_mc_samples=4))
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    from PIL import Image

    images = [Image.fromarray((digits_dataset(4)[i]["pixel_values"].numpy() * 255).astype("uint8")) for i in range(4)]
    # TF32 convs differ from the CPU's by ~1e-4, as much as the CPU/GPU comparison below allows
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    on_gpu = pipeline("image-classification", model=str(tmp_path / "model"), device=0)
    assert on_gpu.model.device.type == "cuda"
    for g in on_gpu(images, top_k=10):  # BMA over the GPU's draws
        assert abs(sum(x["score"] for x in g) - 1.0) < 1e-4
    assert all(s.device.type == "cuda" for s in on_gpu.variational_model.posterior.std.values())  # σ followed the model
    # at the posterior mean the GPU and CPU pipelines agree
    at_mean = [pipeline("image-classification", model=str(tmp_path / "model"), device=d,
                        num_samples=0)(images, top_k=10)
               for d in (0, -1)]
    for g, c in zip(*at_mean):
        gs, cs = ({x["label"]: x["score"] for x in r} for r in (g, c))
        assert max(abs(gs[k] - cs[k]) for k in gs) < 1e-4


@pytest.mark.parametrize("kind", ["mlp", "vit"])
def test_fsdp2_training_matches_unsharded_run_and_saves(tmp_path, kind):
    """One-GPU FSDP2 (fsdp_config version 2) through VariationalTrainer: the same weights, Hessian and BMA evaluation as
    the run without FSDP from the same seed, and a save that reloads (weights and posterior) like the unsharded one.
    `vit`: a tiny HF ViT, sharded beforehand by the user (accelerate keeps it as it is)."""
    from workers.trainer_fsdp_worker import FSDP_STEPS, fsdp_setup

    run_script(WORKERS / "trainer_fsdp_worker.py", str(tmp_path / "fsdp"), kind, nproc=1,
               env={"CUDA_VISIBLE_DEVICES": "0"})
    fsdp = torch.load(tmp_path / "fsdp" / "fsdp.pt", weights_only=False)

    model, ds, args = fsdp_setup(str(tmp_path / "plain"), kind)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ds)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(str(tmp_path / "plain_model"))
    assert fsdp["step"] == trainer.ivon.current_step == FSDP_STEPS
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(fsdp["weights"][name], p.detach().cpu(), atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(fsdp["hessian"], trainer.ivon.hessian().cpu(), atol=1e-5, rtol=1e-5)
    assert (trainer.ivon.hessian() - trainer.ivon.param_groups[0]["hess_init"]).abs().max() > 1e-4
    assert abs(fsdp["metrics"]["eval_loss"] - metrics["eval_loss"]) < 1e-4  # BMA: posterior_temperature 1

    if kind == "vit":
        return
    from safetensors.torch import load_file

    loaded = {}
    for kind, folder in (("fsdp", "fsdp/model"), ("plain", "plain_model")):
        model = TinyClassifier(hidden=32)
        model.load_state_dict(load_file(str(tmp_path / folder / "model.safetensors")))
        # the load checks the weights' fingerprint too
        loaded[kind] = (model, DiagonalGaussianPosterior.load(model, tmp_path / folder).std)
    for (name, a), (_, b) in zip(loaded["fsdp"][0].named_parameters(), loaded["plain"][0].named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    stds = {kind: std for kind, (_, std) in loaded.items()}
    assert stds["fsdp"].keys() == stds["plain"].keys() and stds["plain"]
    for name, s in stds["plain"].items():
        torch.testing.assert_close(stds["fsdp"][name], s, atol=1e-6, rtol=1e-5, msg=name)


# -- the uncertainty baselines: MC dropout, temperature scaling, ensembles ------------------------------------------
def test_mc_dropout_on_the_gpu_leaves_the_cuda_rng_alone_and_is_reproducible():
    torch.manual_seed(0)
    model = NormDropoutClassifier(p=0.3).cuda().eval()
    x = torch.rand(32, 8, 8, device="cuda")
    state = torch.cuda.get_rng_state()
    a = mc_dropout_predictive(model, {"pixel_values": x}, num_samples=8, seed=2)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    torch.testing.assert_close(mc_dropout_predictive(model, {"pixel_values": x}, num_samples=8, seed=2).probs, a.probs,
                               rtol=0, atol=0)
    assert a.probs.device.type == "cuda" and (a.mutual_information > 0).all()
    model.dropout.p = 0.0
    torch.testing.assert_close(mc_dropout_predictive(model, {"pixel_values": x}, num_samples=4).probs,
                               model(x).logits.softmax(-1), rtol=0, atol=1e-6)


def test_trainer_on_the_gpu_evaluates_by_mc_dropout(tmp_path):
    train, val = digits_dataset(160, seed=0), digits_dataset(64, seed=1)
    torch.manual_seed(0)
    model = NormDropoutClassifier(p=0.3)
    args = make_args(tmp_path, use_cpu=False, method="erm", max_steps=10, learning_rate=0.05, optim="sgd",
                     mc_dropout_samples=8, per_device_eval_batch_size=64)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=train, eval_dataset=val)
    trainer.train()
    log_probs = trainer.predict(val).predictions
    model.eval()
    expected = mc_dropout_predictive(model, {"pixel_values": val[:]["pixel_values"].cuda()}, 8,
                                     seed=trainer.args.eval_seed)
    np.testing.assert_allclose(np.exp(log_probs), expected.probs.cpu().numpy(), rtol=1e-5, atol=1e-6)


def test_temperature_fitted_on_the_gpu_is_applied_after_a_cpu_reload(tmp_path):
    train, val = digits_dataset(200, seed=0), digits_dataset(100, seed=1)
    args = make_args(tmp_path, use_cpu=False, method="erm", max_steps=30, learning_rate=0.05, optim="sgd",
                     temperature_scaling=True, remove_unused_columns=False)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.map(_channel),
                                 eval_dataset=val.map(_channel))
    trainer.train()
    scaling = trainer.temperature_scaling
    assert scaling is not None and scaling.nll_calibrated < scaling.nll_uncalibrated
    trainer.save_model(str(tmp_path))
    expected = np.exp(trainer.predict(val.map(_channel)).predictions)
    loaded = VariationalModel.from_pretrained(tmp_path)  # on the CPU
    assert loaded.temperature_scaling == scaling
    with torch.no_grad():
        got = loaded(pixel_values=torch.as_tensor(np.asarray(val.map(_channel)["pixel_values"]))).probs.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _channel(example):
    return {"pixel_values": np.asarray(example["pixel_values"])[None]}


def test_an_ensemble_pipeline_moves_every_member_to_the_gpu(tmp_path):
    ensemble = DeepEnsemble([with_posterior(tiny_bert(0), 0.05, 3), point(tiny_bert(1))])
    tokenizer = tiny_tokenizer(tmp_path / "vocab")
    ensemble.save_pretrained(tmp_path / "ens")
    tokenizer.save_pretrained(tmp_path / "ens")
    # member 0's posterior draws come from a CUDA generator on the GPU (other numbers than the CPU's for one seed)
    ensemble.to("cuda")
    with torch.no_grad():
        expected = [ensemble(**tokenizer(s, return_tensors="pt").to("cuda")).probs[0].cpu().numpy() for s in SENTENCES]
    classify = pipeline("text-classification", model=str(tmp_path / "ens"), device=0)
    assert all(p.device.type == "cuda" for p in classify.variational_model.parameters())
    for sentence, probs in zip(SENTENCES, expected):
        scores = {r["label"]: r["score"] for r in classify(sentence, top_k=None)}
        np.testing.assert_allclose([scores[f"class_{k}"] for k in range(3)], probs, rtol=1e-4, atol=1e-5)
