"""The uncertainty baselines on a CUDA GPU: MC dropout's forked CUDA RNG, temperature scaling fitted on the GPU and
applied after a CPU reload, an ensemble whose members follow the pipeline to the GPU.

Skipped without a GPU (CI has none); run on a GPU machine with `python -m pytest tests/test_cuda_baselines.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import digits_dataset, make_args, tiny_digits_resnet
from test_ensemble import SENTENCES, point, tiny_bert, tiny_tokenizer, with_posterior
from test_mc_dropout import NormDropoutClassifier
from varsmooth import DeepEnsemble, VariationalModel, VariationalTrainer, mc_dropout_predictive, pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_mc_dropout_on_the_gpu_leaves_the_cuda_rng_alone_and_is_reproducible():
    torch.manual_seed(0)
    model = NormDropoutClassifier(p=0.3).cuda().eval()
    x = torch.rand(32, 8, 8, device="cuda")
    state = torch.cuda.get_rng_state()
    a = mc_dropout_predictive(model, {"pixel_values": x}, num_samples=8, seed=2)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    torch.testing.assert_close(mc_dropout_predictive(model, {"pixel_values": x}, num_samples=8, seed=2).probs, a.probs, rtol=0, atol=0)
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
    expected = mc_dropout_predictive(model, {"pixel_values": val[:]["pixel_values"].cuda()}, 8, seed=trainer.args.eval_seed)
    np.testing.assert_allclose(np.exp(log_probs), expected.probs.cpu().numpy(), rtol=1e-5, atol=1e-6)


def test_temperature_fitted_on_the_gpu_is_applied_after_a_cpu_reload(tmp_path):
    train, val = digits_dataset(200, seed=0), digits_dataset(100, seed=1)
    args = make_args(tmp_path, use_cpu=False, method="erm", max_steps=30, learning_rate=0.05, optim="sgd",
                     temperature_scaling=True, remove_unused_columns=False)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.map(_channel), eval_dataset=val.map(_channel))
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
    assert all(p.device.type == "cuda" for p in classify.predictor.parameters())
    for sentence, probs in zip(SENTENCES, expected):
        scores = {r["label"]: r["score"] for r in classify(sentence, top_k=None)}
        np.testing.assert_allclose([scores[f"class_{k}"] for k in range(3)], probs, rtol=1e-4, atol=1e-5)
