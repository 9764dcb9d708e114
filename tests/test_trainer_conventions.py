"""VariationalTrainer keeps the contracts of `transformers.Trainer` it inherits: compute_loss_func, batch_eval_metrics,
a saved model evaluated by a new trainer, and a warning that says when the posterior did not learn."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import log_loss
from transformers import ResNetConfig, ResNetForImageClassification

from helpers import TinyClassifier, digits_dataset, make_args, reference_ivon_loop
from varsmooth import POSTERIOR_FILE, DiagonalGaussianPosterior, VariationalModel, VariationalTrainer
from varsmooth.posterior.diagnostics import HESSIAN_STUCK_TOLERANCE

REPO = Path(__file__).resolve().parents[1]


def _sequential_args(tmp_path, **kw):
    base = dict(learning_rate=0.2, beta2=0.999, lr_scheduler_type="constant", train_sampling_strategy="sequential")
    return make_args(tmp_path, **{**base, **kw})


def _max_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


# -- compute_loss_func ---------------------------------------------------------------------------------
def test_compute_loss_func_drives_ivon_training(tmp_path):
    """3x the cross-entropy: the trainer must match the hand-written IVON loop on the 3x loss, not on the plain one."""
    ds = digits_dataset(64)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    calls = []

    def tripled(outputs, labels, num_items_in_batch=None):
        calls.append((labels.shape[0], num_items_in_batch))
        return 3.0 * F.cross_entropy(outputs.logits, labels)

    steps, batch = 3, 16
    trainer = VariationalTrainer(model=model, args=_sequential_args(tmp_path, max_steps=steps, per_device_train_batch_size=batch),
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
    # one call per posterior sample, on the micro-batch, asked for its mean (num_items_in_batch=None)
    assert calls == [(batch, None)] * steps


def test_compute_loss_func_replaces_the_loss_of_non_ivon_methods(tmp_path):
    ds = digits_dataset(32)
    model = TinyClassifier()
    before = copy.deepcopy(model)
    args = make_args(tmp_path, method="erm", optim="sgd", learning_rate=0.5, max_steps=2)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds,
                                 compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0.0 * outputs.logits.sum())
    trainer.train()
    assert _max_diff(model, before) == 0.0  # a zero loss moves nothing; cross-entropy would have


def test_compute_loss_func_with_a_method_that_has_its_own_loss_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func would replace the training loss of method='ls'"):
        VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, method="ls"), train_dataset=digits_dataset(16),
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
    batched = VariationalTrainer(model=copy.deepcopy(model), args=make_args(tmp_path / "b", batch_eval_metrics=True, **common),
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

    trainer = VariationalTrainer(model=_PixelClassifier(), args=make_args(tmp_path, max_steps=1, include_for_metrics=["inputs", "loss"]),
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
def _tiny_resnet():
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                     layer_type="basic", num_labels=10, downsample_in_first_stage=False))


def _pixels(n):
    ds = digits_dataset(n).with_format(None)
    return ds.map(lambda b: {"pixel_values": np.asarray(b["pixel_values"], "float32")[:, None]}, batched=True).with_format("torch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    train, test = _pixels(128), _pixels(48)
    trainer = VariationalTrainer(model=_tiny_resnet(), args=make_args(out, max_steps=8, eval_mc_samples=4, beta2=0.99),
                                 train_dataset=train, eval_dataset=test)
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
    with caplog.at_level("WARNING", logger="varsmooth.trainer"):
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
    posterior = DiagonalGaussianPosterior.load(model, out / POSTERIOR_FILE)
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test,
                                 posterior=posterior)
    assert trainer.evaluate()["eval_nll"] == pytest.approx(trained_metrics["eval_nll"], rel=1e-5)


def test_bma_without_posterior_warns_and_names_the_metrics_after_the_mean(tmp_path, caplog):
    _tiny_resnet().save_pretrained(tmp_path / "plain")
    model = ResNetForImageClassification.from_pretrained(tmp_path / "plain")
    test = _pixels(32)
    trainer = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=4), eval_dataset=test)
    with caplog.at_level("WARNING", logger="varsmooth.trainer"):
        metrics = trainer.evaluate()
    assert "asks for Bayesian model averaging, but there is no posterior" in caplog.text
    assert "eval_accuracy" not in metrics and "eval_nll" not in metrics
    with torch.no_grad():
        probs = model(pixel_values=test[:]["pixel_values"]).logits.softmax(-1).numpy()
    assert metrics["eval_mean_nll"] == pytest.approx(log_loss(test[:]["label"].numpy(), probs, labels=range(10)), rel=1e-5)
    # asking for the mean (eval_mc_samples=0) is not a reason to warn
    caplog.clear()
    at_mean = VariationalTrainer(model=model, args=make_args(tmp_path, eval_mc_samples=0), eval_dataset=test)
    with caplog.at_level("WARNING", logger="varsmooth.trainer"):
        assert "eval_nll" in at_mean.evaluate()
    assert "no posterior" not in caplog.text


def test_posterior_of_another_head_is_not_used(saved, tmp_path, caplog):
    out, _, _ = saved
    model = ResNetForImageClassification.from_pretrained(out, num_labels=3, ignore_mismatched_sizes=True)
    with caplog.at_level("WARNING", logger="varsmooth.trainer"):
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
                  lr_scheduler_type="constant", per_device_train_batch_size=16, logging_strategy="steps", logging_steps=1)
    torch.manual_seed(0)
    init = TinyClassifier()
    _WeightedLossTrainer.calls = 0
    weighted = _WeightedLossTrainer(model=copy.deepcopy(init), args=make_args(tmp_path / "a", **common), train_dataset=data)
    weighted.train()
    assert _WeightedLossTrainer.calls == 3 * 2  # steps × samples
    plain = VariationalTrainer(model=copy.deepcopy(init), args=make_args(tmp_path / "b", **common), train_dataset=data)
    plain.train()
    # the first step: the same weights and the same posterior draws, so the logged loss is exactly doubled
    first = [next(e["loss"] for e in t.state.log_history if "loss" in e) for t in (weighted, plain)]
    assert first[0] == pytest.approx(2 * first[1], rel=1e-4)
    assert not torch.equal(weighted.model.head.weight, plain.model.head.weight)  # and the doubled gradient moved it
