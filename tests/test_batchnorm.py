"""BatchNorm statistics recomputed at the posterior mean when training with a posterior ends
(varsmooth.prediction.batchnorm)."""

import copy
import json

import numpy as np
import pytest
import torch
from torch.optim.swa_utils import update_bn

from helpers import TensorInput, digits_images, make_args, tiny_digits_resnet
from varsmooth import LabelNoiseCallback, VariationalTrainer
from varsmooth.hub.card import build_model_card
from varsmooth.label_noise import compute_label_noise
from varsmooth.prediction.batchnorm import batchnorm_layers, recompute_batchnorm_statistics
from varsmooth.prediction.bma import draw_seeds


def _statistics(model):
    return [torch.cat([layer.running_mean, layer.running_var]) for layer in batchnorm_layers(model)]


def _assert_same_statistics(a, b):
    for x, y in zip(_statistics(a), _statistics(b), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_the_statistics_are_those_of_torchs_update_bn_and_stop_after_max_examples():
    model = tiny_digits_resnet(0)
    x = digits_images(100)["pixel_values"]
    batches = [{"pixel_values": x[i:i + 32], "labels": torch.zeros(len(x[i:i + 32]), dtype=torch.long)}
               for i in range(0, 100, 32)]
    momenta = [layer.momentum for layer in batchnorm_layers(model)]
    model.eval()
    reference = TensorInput(copy.deepcopy(model))
    update_bn([b["pixel_values"] for b in batches], reference)
    assert recompute_batchnorm_statistics(model, batches) == 100
    _assert_same_statistics(model, reference.model)
    assert not model.training and [layer.momentum for layer in batchnorm_layers(model)] == momenta

    first = TensorInput(copy.deepcopy(model))
    update_bn([batches[0]["pixel_values"], batches[1]["pixel_values"]], first)
    assert recompute_batchnorm_statistics(model, batches, max_examples=40) == 64  # whole batches, until 40 are seen
    _assert_same_statistics(model, first.model)


def test_a_model_without_batchnorm_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10), torch.nn.LayerNorm(10))
    before = copy.deepcopy(model.state_dict())
    assert recompute_batchnorm_statistics(model, [{"input": torch.randn(4, 64)}]) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("method, recompute", [("ivon", True), ("ivon", False), ("erm", True)])
def test_training_with_a_posterior_ends_with_the_statistics_of_the_mean(tmp_path, method, recompute):
    """With IVON the running statistics gathered under sampled weights are replaced by those of the posterior mean over
    the training set (the reference: update_bn on the trained weights); turned off, or without a posterior, the
    statistics are the ones training gathered."""
    ds = digits_images(96)
    trainer = VariationalTrainer(
        model=tiny_digits_resnet(0), train_dataset=ds,
        args=make_args(tmp_path, method=method, max_steps=6, per_device_train_batch_size=32, learning_rate=0.05,
                       train_sampling_strategy="sequential",  # the reference's batches: statistics depend on them
                       **(dict(recompute_batchnorm_statistics=recompute, posterior_temperature=1.0) if method == "ivon"
                          else {})))  # ERM refuses IVON's settings
    trainer.train()
    model = trainer.model
    reference = TensorInput(copy.deepcopy(model))
    update_bn([ds["pixel_values"][i:i + 32] for i in range(0, 96, 32)], reference)
    same = all(torch.allclose(x, y, atol=1e-5, rtol=1e-5)
               for x, y in zip(_statistics(model), _statistics(reference.model)))
    assert same == (method == "ivon" and recompute)
    logged = [entry for entry in trainer.state.log_history if "batchnorm_recomputed_from_examples" in entry]
    assert [entry["batchnorm_recomputed_from_examples"] for entry in logged] == ([96] if same else [])
    trainer.save_model()
    card = build_model_card(trainer.run_record(), trainer.model, tmp_path).text
    assert ("recomputed at the posterior mean from 96 training examples" in card) == same


def test_the_label_noise_export_draws_normalise_with_their_own_statistics(tmp_path):
    """ε̄ = p̄ − P̂ of a BatchNorm model: P̂ averages draws that each normalise with statistics recomputed at the drawn
    weights (the reference loop: update_bn on every draw), p̄ the model's own; the model's statistics are unchanged."""
    ds = digits_images(64)
    trainer = VariationalTrainer(model=tiny_digits_resnet(0), train_dataset=ds,
                                 args=make_args(tmp_path, max_steps=4, per_device_train_batch_size=32,
                                                posterior_temperature=1.0, learning_rate=0.05))
    trainer.train()
    model, posterior = trainer.model.eval(), trainer.posterior()
    own = [s.clone() for s in _statistics(model)]
    noise = compute_label_noise(model, posterior, ds, num_samples=4, batch_size=32)
    x = ds[:]["pixel_values"]
    expected = 0
    for draw_seed, mirrored in draw_seeds(0, 4):
        with posterior.sampled(draw_seed, mirrored=mirrored):
            drawn = TensorInput(copy.deepcopy(model))
        update_bn([x[:32], x[32:]], drawn)
        expected = expected + drawn.eval()(x).softmax(-1) / 4
    with torch.no_grad():
        mean = model(pixel_values=x).logits.softmax(-1)
    torch.testing.assert_close(torch.as_tensor(np.asarray(noise["predictive_probs"]), dtype=torch.float32),
                               expected.detach(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.as_tensor(np.asarray(noise["mean_probs"]), dtype=torch.float32), mean, atol=1e-5,
                               rtol=1e-4)
    for before, after in zip(own, _statistics(model), strict=True):
        assert torch.equal(before, after)
    # batches that can be read only once: the ones the draws' statistics took are still measured
    once = iter([{"pixel_values": x[i:i + 32], "labels": ds[i:i + 32]["label"]} for i in (0, 32)])
    again = compute_label_noise(model, posterior, ds, num_samples=4, dataloader=once)
    assert np.array_equal(np.asarray(again["predictive_probs"]), np.asarray(noise["predictive_probs"]))


def test_the_export_and_the_card_say_that_each_draw_had_its_own_statistics(tmp_path):
    out = tmp_path / "run"
    trainer = VariationalTrainer(model=tiny_digits_resnet(0), train_dataset=digits_images(64),
                                 callbacks=[LabelNoiseCallback(num_samples=2)],
                                 args=make_args(out, max_steps=2, per_device_train_batch_size=32,
                                                posterior_temperature=1.0))
    trainer.train()
    trainer.save_model()
    assert json.loads((out / "label_noise_summary.json").read_text())["batchnorm_statistics_per_draw"] is True
    card = build_model_card(trainer.run_record(), trainer.model, out).text
    seconds = json.loads((out / "label_noise_summary.json").read_text())["export_seconds"]
    assert seconds > 0  # the export's cost, stated beside its samples
    assert ("(2 posterior samples at τ = 1, each normalised with BatchNorm statistics of its own, as in training, "
            f"exported in {seconds:.1f} s)" in card)
