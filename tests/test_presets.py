"""The run-size-aware IVON rule of varsmooth.presets (pure functions, no training)."""

from __future__ import annotations

import math

import pytest

from varsmooth.presets import beta2_for_window, hessian_window_of, total_optimizer_steps


def test_total_steps_counts_optimizer_steps():
    # the benchmarks' MNIST run: 9000 examples, batch 64 -> 141 steps per epoch, 20 epochs
    assert total_optimizer_steps(9000, 64, 20) == 2820
    assert total_optimizer_steps(9000, 64, 20, gradient_accumulation_steps=2) == 20 * 71
    assert total_optimizer_steps(9000, 32, 20, world_size=2) == 2820
    assert total_optimizer_steps(10, 64, 0.5) == 1


def test_beta2_window_is_a_fraction_of_the_run():
    b2 = beta2_for_window(2820, 0.1, min_window_steps=0)
    assert b2 == pytest.approx(1 - 1 / 282)
    assert 1 / (1 - b2) == pytest.approx(282)  # the EMA window in steps
    assert hessian_window_of(b2, 2820) == pytest.approx(0.1)
    # longer runs get a slower EMA, the same relative window (the 100-epoch reference: 1 - 1/1410)
    assert beta2_for_window(14100, 0.1) == pytest.approx(1 - 1 / 1410)
    # ... but never shorter than MIN_HESSIAN_WINDOW_STEPS (300): the 20-epoch MNIST run gets 300, not 282
    assert beta2_for_window(2820, 0.1) == pytest.approx(1 - 1 / 300)
    assert beta2_for_window(480, 0.1) == pytest.approx(1 - 1 / 300)
    # the authors' 200-epoch CIFAR run: β2 = 1 - 1e-5 is a window of half the run
    assert hessian_window_of(0.99999, 200_000) == pytest.approx(0.5)
    assert hessian_window_of(1.0, 100) == math.inf


def test_tiny_runs_and_bad_inputs():
    assert beta2_for_window(5, 0.1, min_window_steps=0) == 0.0  # window never shorter than one step
    with pytest.raises(ValueError):
        beta2_for_window(0, 0.1)
    with pytest.raises(ValueError):
        beta2_for_window(100, 0.0)
    with pytest.raises(ValueError):
        total_optimizer_steps(0, 64, 1)


def test_trainer_hessian_window_sets_beta2_from_the_run_length(tmp_path):
    import torch

    from helpers import TinyClassifier, digits_dataset, make_args
    from varsmooth import VariationalTrainer

    torch.manual_seed(0)
    ds = digits_dataset(n=64)
    args = make_args(tmp_path, hessian_window=0.25, num_train_epochs=2, per_device_train_batch_size=16)  # T = 8
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=ds)
    assert trainer.method.hyperparameters()["beta2"] is None  # not known before training
    trainer.train()
    group = trainer.ivon.param_groups[0]
    assert trainer.state.max_steps == 8
    assert group["beta2"] == pytest.approx(1 - 1 / 300)  # 0.25 x 8 steps is below the 300-step floor
    assert group["clip_radius"] == 0.05  # the window rule's default clipping
    assert trainer.method.hyperparameters()["beta2"] == pytest.approx(1 - 1 / 300)


def test_trainer_hessian_window_keeps_an_explicit_clip_radius_and_validates(tmp_path):
    from helpers import make_args

    args = make_args(tmp_path, hessian_window=0.1, clip_radius=0.2)
    from varsmooth.methods import get_method_class

    method = get_method_class("ivon")(args.method_config, num_train_examples=100)
    method.total_steps = 10_000
    assert method.ivon_settings()["clip_radius"] == 0.2
    assert method.ivon_settings()["beta2"] == pytest.approx(1 - 1 / 1000)
    with pytest.raises(ValueError, match="hessian_window"):
        make_args(tmp_path, hessian_window=0.0)
    # a beta2 given turns the rule off: beta2 as given, no clipping
    plain = get_method_class("ivon")(make_args(tmp_path, beta2=0.99999).method_config, num_train_examples=100)
    plain.total_steps = 10_000
    assert plain.ivon_settings()["beta2"] == 0.99999 and plain.ivon_settings()["clip_radius"] == math.inf
