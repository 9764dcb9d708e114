"""Variational prediction: metrics against scikit-learn, BMA in the trainer, posterior save/load round trip."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy
from sklearn.metrics import brier_score_loss, log_loss
from transformers import ResNetConfig, ResNetForImageClassification

from helpers import TinyClassifier, digits_dataset, digits_images, make_args, tiny_digits_resnet
from varsmooth import DiagonalGaussianPosterior, VariationalModel, VariationalTrainer, classification_metrics
from varsmooth.metrics import CALIBRATION_METRIC_PATH, expected_calibration_error
from varsmooth.outputs import entropy
from varsmooth.posterior import POSTERIOR_FILE


def _random_probs(n=500, k=4, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return probs, rng.integers(0, k, n)


def test_metrics_match_scikit_learn():
    probs, labels = _random_probs()
    m = classification_metrics(probs, labels)
    assert m["nll"] == pytest.approx(log_loss(labels, probs, labels=range(4)), rel=1e-9)
    assert m["brier"] == pytest.approx(brier_score_loss(labels, probs, labels=range(4), scale_by_half=False), rel=1e-9)
    assert m["accuracy"] == pytest.approx((probs.argmax(1) == labels).mean())


def test_ece_against_hand_computation():
    probs = np.array([[0.95, 0.05], [0.95, 0.05], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 0, 1])
    # bins of width 1/15: {0.95, 0.95} share a bin (acc 0.5, conf 0.95); 0.6 and 0.7 are alone and correct
    expected = 0.5 * abs(0.5 - 0.95) + 0.25 * abs(1 - 0.6) + 0.25 * abs(1 - 0.7)
    assert expected_calibration_error(probs, labels, 15) == pytest.approx(expected)


def test_evaluate_module_works_offline(monkeypatch):
    import evaluate

    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    probs, labels = _random_probs(50)
    metric = evaluate.load(CALIBRATION_METRIC_PATH, keep_in_memory=True)
    out = metric.compute(predictions=probs.tolist(), references=labels.tolist())
    assert out == pytest.approx(classification_metrics(probs, labels))


def test_bad_labels_are_refused():
    with pytest.raises(ValueError, match=r"Labels must lie in \[0, 4\)"):
        classification_metrics(np.full((2, 4), 0.25), np.array([0, 7]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train, test = digits_images(256), digits_images(96)
    # τ fixed at 1: these tests are about the learned posterior's BMA (the temperature has tests of its own)
    args = make_args(out, max_steps=30, eval_mc_samples=8, beta2=0.999, eval_seed=3, posterior_temperature=1.0)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train, eval_dataset=test)
    trainer.train()
    trainer.save_model(str(out))
    return trainer, test, out


def test_bma_evaluation_is_the_nll_of_averaged_probabilities(trained):
    trainer, test, _ = trained
    metrics = trainer.evaluate()
    pred = trainer.predict(test)
    probs = np.exp(pred.predictions)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    labels = test[:]["label"].numpy()
    assert metrics["eval_nll"] == pytest.approx(log_loss(labels, probs, labels=range(10)), rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_nll"], rel=1e-4)
    # the posterior-mean metrics come from the unperturbed model
    model = trainer.model.eval()
    with torch.no_grad():
        mean_probs = torch.softmax(model(pixel_values=test[:]["pixel_values"]).logits, -1).numpy()
    assert metrics["eval_mean_nll"] == pytest.approx(log_loss(labels, mean_probs, labels=range(10)), rel=1e-5)
    assert not np.allclose(probs, mean_probs, atol=1e-3)  # the samples really differ from the mean
    # evaluation does not move the weights (every sample is restored)
    with torch.no_grad():
        again = torch.softmax(model(pixel_values=test[:]["pixel_values"]).logits, -1).numpy()
    np.testing.assert_array_equal(mean_probs, again)


def test_posterior_std_is_ivon_formula(trained):
    trainer, _, _ = trained
    opt = trainer.ivon
    group = opt.param_groups[0]
    expected = 1.0 / torch.sqrt(group["ess"] * (opt.hessian() + group["weight_decay"]))
    got = torch.cat([s.flatten() for s in trainer.posterior().std.values()])
    torch.testing.assert_close(got, expected)


def test_entropy_closed_forms():
    # uniform over K: log K; one-hot: 0 (0 log 0 = 0, not NaN); a random row: SciPy's entropy in nats
    probs = torch.tensor([[0.25] * 4, [0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    torch.testing.assert_close(entropy(probs), torch.tensor([np.log(4), 0.0, scipy_entropy([0.1, 0.2, 0.3, 0.4])],
                                                            dtype=torch.float64))


def test_samples_have_the_posterior_distribution():
    model = torch.nn.Linear(200, 100)
    std = {"weight": torch.full((100, 200), 0.3), "bias": torch.full((100,), 0.0)}
    posterior = DiagonalGaussianPosterior(model, std)
    mean = model.weight.detach().clone()
    with posterior.sampled(seed=1):
        z = (model.weight.detach() - mean) / 0.3
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01
    with posterior.sampled(seed=1):
        assert torch.equal((model.weight.detach() - mean) / 0.3, z)  # same seed, same sample
    assert torch.equal(model.weight, mean)


def test_crash_inside_a_sample_restores_the_mean():
    model = torch.nn.Linear(4, 3)
    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    posterior = DiagonalGaussianPosterior(model, {"weight": torch.ones(3, 4)})
    with pytest.raises(KeyboardInterrupt):
        with posterior.sampled(seed=0):
            raise KeyboardInterrupt
    assert all(torch.equal(p, mean[n]) for n, p in model.named_parameters())


def test_saved_model_predicts_like_the_trainer(trained):
    trainer, test, out = trained
    assert os.path.isfile(out / POSTERIOR_FILE)
    expected = np.exp(trainer.predict(test).predictions)
    loaded = VariationalModel.from_pretrained(out)
    assert (loaded.num_samples, loaded.seed) == (8, 3)  # taken from the training run
    with torch.no_grad():
        got = loaded(pixel_values=test[:]["pixel_values"]).probs.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_model_without_posterior_predicts_at_mean_with_warning(tmp_path):
    model = tiny_digits_resnet().eval()
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="Predicting at the posterior mean"):
        loaded = VariationalModel.from_pretrained(tmp_path)
    x = torch.rand(3, 1, 8, 8)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(pixel_values=x).probs.numpy(),
                                   model(pixel_values=x).logits.softmax(-1).numpy(), atol=1e-6)


def test_posterior_of_another_model_is_refused(trained, tmp_path):
    _, _, out = trained
    other = ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 32],
                                                      depths=[1, 1], layer_type="basic", num_labels=10,
                                                      downsample_in_first_stage=False))
    with pytest.raises(ValueError, match="does not belong to this model"):
        DiagonalGaussianPosterior.load(other, out / POSTERIOR_FILE)


def test_posterior_file_written_whole_or_not_at_all(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    posterior = DiagonalGaussianPosterior(model, {"weight": torch.ones(2, 3)})
    import varsmooth.posterior.gaussian as gaussian

    def failing_save(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(gaussian, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        posterior.save(tmp_path / POSTERIOR_FILE)
    assert os.listdir(tmp_path) == []


def test_eval_mc_samples_zero_predicts_at_mean(tmp_path):
    ds = digits_dataset(64)
    args = make_args(tmp_path, max_steps=3, eval_mc_samples=0)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=ds, eval_dataset=ds)
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_mean_nll" not in metrics
    with torch.no_grad():
        probs = trainer.model(pixel_values=ds[:]["pixel_values"]).logits.softmax(-1).numpy()
    assert metrics["eval_nll"] == pytest.approx(log_loss(ds[:]["label"].numpy(), probs, labels=range(10)), rel=1e-5)


def test_cached_and_fresh_draws_are_the_same_weights():
    model = torch.nn.Linear(30, 20)
    std = {"weight": torch.full((20, 30), 0.1), "bias": torch.full((20,), 0.2)}
    cached, fresh = DiagonalGaussianPosterior(model, std), DiagonalGaussianPosterior(model, std, cache_bytes=0)
    for seed in (0, 1, 0):
        with cached.sampled(seed):
            a = [p.detach().clone() for p in model.parameters()]
        with fresh.sampled(seed):
            b = [p.detach().clone() for p in model.parameters()]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert cached._cache_used > 0 and fresh._cache_used == 0


def test_posterior_follows_the_model_when_it_moves():
    """A pipeline moves the model after the posterior is loaded (to a GPU; here: to float64): σ and the draws follow."""
    model = torch.nn.Linear(30, 20)
    posterior = DiagonalGaussianPosterior(model, {"weight": torch.full((20, 30), 0.1)})
    with posterior.sampled(0):
        pass
    model.double()
    mean = model.weight.detach().clone()
    with posterior.sampled(0):
        delta = model.weight.detach() - mean
    assert posterior.std["weight"].dtype == torch.float64 and delta.dtype == torch.float64
    assert abs(delta.std().item() - 0.1) < 0.02  # a draw with the posterior's σ (600 values)
    assert torch.equal(model.weight, mean)
    assert posterior._cache_used == sum(t.numel() * t.element_size() for t in posterior._cache[0])


@pytest.mark.slow
def test_pipeline_on_a_one_channel_timm_model(tmp_path):
    """A grayscale timm model (TimmWrapperConfig has no `num_channels`, only the `in_chans` of its timm model) trained,
    saved and served by `varsmooth.pipeline`: the scores are the BMA probabilities of the reloaded model."""
    from PIL import Image
    from transformers import ViTImageProcessor

    from example_utils.models import create_image_classifier
    from varsmooth import pipeline

    torch.manual_seed(0)
    model = create_image_classifier("test_resnet", {i: str(i) for i in range(10)}, num_channels=1)
    processor = ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False)
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, max_steps=3, eval_mc_samples=4, beta2=0.99),
                                 train_dataset=digits_images(64), processing_class=processor)
    trainer.train()
    trainer.save_model(str(tmp_path))
    images = [Image.fromarray((image.numpy() * 255).astype("uint8"), mode="L")
              for image in digits_dataset(3)[:]["pixel_values"]]
    classify = pipeline("image-classification", model=str(tmp_path))
    scores = [{row["label"]: row["score"] for row in classify(image, top_k=10)} for image in images]
    loaded = VariationalModel.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = loaded(**processor(images, return_tensors="pt")).probs.numpy()
    got = np.array([[s[str(k)] for k in range(10)] for s in scores])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # an RGB picture is turned to grayscale for this model, as the digits it was trained on
    rgb = {row["label"]: row["score"] for row in classify(images[0].convert("RGB"), top_k=10)}
    np.testing.assert_allclose([rgb[str(k)] for k in range(10)], got[0], rtol=1e-5, atol=1e-6)
