"""Bayesian model averaging on BatchNorm networks: each posterior draw predicts with BatchNorm statistics of its own,
computed when training ends and saved with the posterior (`PosteriorPredictor`, varsmooth.prediction.batchnorm)."""

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.optim.swa_utils import update_bn

from helpers import TensorInput, digits_images, make_args, tiny_digits_resnet
from varsmooth import PosteriorTemperature, VariationalModel, VariationalTrainer
from varsmooth.prediction.batchnorm import batchnorm_layers, draw_buffer_tensors, draw_buffers_from_tensors
from varsmooth.prediction.bma import draw_seeds, predictive_distribution
from varsmooth.prediction.predictors import PosteriorPredictor


def _reference_bma(model, posterior, x, train_x, num_samples, seed, batch_size=32, temperature=1.0):
    """The BMA of the definition: every draw a copy of the network at θ_s whose BatchNorm statistics torch's update_bn
    recomputed from the training images, each averaged in probability."""
    total = 0
    for draw_seed, mirrored in draw_seeds(seed, num_samples):
        with posterior.sampled(draw_seed, mirrored=mirrored, scale=temperature):
            drawn = TensorInput(copy.deepcopy(model))
        update_bn([train_x[i:i + batch_size] for i in range(0, len(train_x), batch_size)], drawn)
        with torch.no_grad():
            total = total + drawn.eval()(x).softmax(-1)
    return total / num_samples


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train = digits_images(96)
    trainer = VariationalTrainer(model=tiny_digits_resnet(0), train_dataset=train, eval_dataset=digits_images(48),
                                 args=make_args(out, max_steps=6, per_device_train_batch_size=32,
                                                per_device_eval_batch_size=32, posterior_temperature=1.0,
                                                eval_mc_samples=4, learning_rate=0.05))
    trainer.train()
    trainer.save_model()
    return trainer, train, out


def test_evaluate_averages_draws_that_each_have_the_statistics_update_bn_gives_them(trained):
    trainer, train, _ = trained
    model, predictor = trainer.model.eval(), trainer.posterior_predictor()
    posterior = predictor.posterior
    assert predictor.draw_buffers is not None and len(predictor.draw_buffers) == 4
    assert trainer.posterior_predictor() is predictor  # built once, when training ended
    own = [layer.running_mean.clone() for layer in batchnorm_layers(model)]
    x = trainer.eval_dataset[:]["pixel_values"]
    expected = _reference_bma(model, posterior, x, train[:]["pixel_values"], 4, trainer.args.eval_seed)
    got = torch.from_numpy(trainer.predict(trainer.eval_dataset).predictions).exp()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # the mean's own statistics are back, and with them (the old behaviour) the draws are other, worse networks
    for before, layer in zip(own, batchnorm_layers(model), strict=True):
        assert torch.equal(before, layer.running_mean)
    labels = trainer.eval_dataset[:]["label"]
    stale = predictive_distribution(model, posterior, {"pixel_values": x}, 4, trainer.args.eval_seed).probs
    assert not torch.allclose(stale, expected, atol=1e-3)
    nll = lambda p: -p[torch.arange(len(labels)), labels].log().mean().item()  # noqa: E731
    assert nll(expected) < nll(stale)


def test_the_saved_model_predicts_with_the_same_draws_in_a_new_object(trained):
    trainer, _, out = trained
    x = trainer.eval_dataset[:]["pixel_values"]
    expected = torch.from_numpy(trainer.predict(trainer.eval_dataset).predictions).exp()
    with safe_open(str(out / "posterior.safetensors"), framework="pt") as f:
        meta = json.loads(f.metadata()["varsmooth"])
        keys = list(f.keys())
    assert meta["draw_buffers"] == {"seed": trainer.args.eval_seed, "temperature": 1.0, "num_draws": 4}
    assert sum(k.startswith("draw_buffers/3/") for k in keys) == 3 * len(batchnorm_layers(trainer.model))
    loaded = VariationalModel.from_pretrained(out)
    torch.testing.assert_close(loaded(pixel_values=x).probs, expected, atol=1e-6, rtol=1e-5)
    # fewer draws of the same seed reuse the first statistics; other draws have none to use
    saved = loaded.posterior_predictor
    assert saved.drawing(2).draw_buffers is not None
    assert saved.drawing(5).draw_buffers is None
    assert saved.drawing(2, trainer.args.eval_seed + 1).draw_buffers is None
    assert saved.drawing(2, temperature=PosteriorTemperature(0.5)).draw_buffers is None
    assert saved.drawing(2, temperature=PosteriorTemperature(0.0)).draw_buffers is not None  # τ = 0 measures at τ = 1
    # the prediction's settings are the predictor's; σ's own metadata holds none of them
    assert "posterior_temperature" not in saved.posterior.metadata and "draw_buffers" not in saved.posterior.metadata


def test_changing_tau_after_training_rebuilds_the_prediction_with_its_draws_statistics(trained):
    trainer, train, _ = trained
    try:
        predictor = trainer.prepare_predictor(0.5)
        assert trainer.posterior_predictor() is predictor and trainer.posterior_temperature.value == 0.5
        assert predictor.draws_temperature == 0.5 and len(predictor.draw_buffers) == 4
        x = trainer.eval_dataset[:]["pixel_values"]
        expected = _reference_bma(trainer.model.eval(), predictor.posterior, x, train[:]["pixel_values"], 4,
                                  trainer.args.eval_seed, temperature=0.5)
        got = torch.from_numpy(trainer.predict(trainer.eval_dataset).predictions).exp()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    finally:
        trainer.prepare_predictor(1.0)


def test_draws_the_prediction_was_not_prepared_for_are_said_to_lack_their_statistics(trained):
    trainer, _, _ = trained
    try:
        trainer.args.eval_mc_samples = 6  # more draws than training prepared
        with pytest.warns(UserWarning, match="BatchNorm statistics of their own"):
            assert trainer.posterior_predictor().draw_buffers is None
        trainer.args.eval_mc_samples = 2  # fewer: the first draws' statistics serve them
        assert len(trainer.posterior_predictor().draw_buffers) == 2
    finally:
        trainer.args.eval_mc_samples = 4


def test_a_posterior_file_with_edited_draw_buffers_is_refused(trained, tmp_path):
    trainer, _, out = trained
    model = trainer.model
    with safe_open(str(out / "posterior.safetensors"), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    std = {k: v for k, v in tensors.items() if not k.startswith("draw_buffers/")}
    cases = {
        "a draw's buffer missing": ({k: v for k, v in tensors.items() if not k.startswith("draw_buffers/2/")}, meta),
        "buffers without their description": (tensors, {"varsmooth": json.dumps(
            {k: v for k, v in json.loads(meta["varsmooth"]).items() if k != "draw_buffers"})}),
        "a description without buffers": (std, meta),
        "a buffer the model does not have": ({**tensors, **{f"draw_buffers/{s}/nope.running_mean": torch.zeros(1)
                                                            for s in range(4)}}, meta),
    }
    for case, (content, metadata) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(content, str(path), metadata=metadata)
        with pytest.raises(ValueError, match="draw"):
            PosteriorPredictor.load(model, path)


def test_draw_buffers_round_trip_through_their_tensors():
    model = torch.nn.Module()
    model.a = torch.nn.BatchNorm1d(2)
    buffers = [{"a.running_mean": torch.full((2,), float(s)), "a.num_batches_tracked": torch.tensor(s)}
               for s in range(3)]
    back = draw_buffers_from_tensors(draw_buffer_tensors(buffers), 3, model, "f")
    for a, b in zip(buffers, back, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="4 posterior draws"):
        draw_buffers_from_tensors(draw_buffer_tensors(buffers), 4, model, "f")
