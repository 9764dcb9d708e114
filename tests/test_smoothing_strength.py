"""`ivon_smoothing`: IVON's ess set from the label noise it measures, so that it smooths as much as LS's α."""

import numpy as np
import pytest
import torch

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import VariationalTrainer
from varsmooth.label_noise import SmoothingStrengthCallback, label_smoothing_noise, mean_label_noise


def _knob(trainer):
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, SmoothingStrengthCallback))


@pytest.mark.parametrize("alpha,k", [(0.1, 10), (0.3, 2), (1.0, 6)])
def test_label_smoothing_noise_is_the_l1_size_of_ls_targets_minus_the_label(alpha, k):
    y = np.eye(k)[0]
    assert label_smoothing_noise(alpha, k) == pytest.approx(np.abs((1 - alpha) * y + alpha / k - y).sum())


def _train(tmp_path, alpha, **kw):
    torch.manual_seed(0)
    data = digits_dataset()
    # the finetune preset's settings but a step bound (3e-3) that learns digits from scratch in 6 epochs
    args = make_args(tmp_path, num_train_epochs=6, ivon_preset="finetune", clip_radius=1e-2, learning_rate=0.3,
                     ivon_smoothing=alpha, **kw)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=data.select(range(1200)))
    trainer.train()
    return trainer, data.select(range(1200, 1797))


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory):
    return {alpha: _train(tmp_path_factory.mktemp(f"alpha{alpha}"), alpha) for alpha in (0.05, 0.3)}


def _held_out_noise(trainer, data):
    """(mean ‖ε̄‖₁, mean ‖p̂ − 1/K‖₁) on `data`, 32 draws: other examples and more draws than the knob's probe."""
    loader = torch.utils.data.DataLoader(data, batch_size=256, collate_fn=trainer.data_collator)
    sums = mean_label_noise(trainer.model, trainer.posterior(), loader, num_samples=32, seed=1)
    return sums.noise_l1 / sums.count, sums.distance_from_uniform / sums.count


@pytest.mark.slow
def test_the_knob_brings_the_measured_label_noise_to_alpha_times_the_means_distance_from_uniform(smoothed):
    for alpha, (trainer, held_out) in smoothed.items():
        knob = _knob(trainer)
        assert len(knob.history) == 5
        # the preset's ess (1e8) smooths nothing: the first update moved it by orders of magnitude
        assert knob.history[0]["label_noise_l1"] < 0.1 * knob.history[0]["target"]
        assert trainer.ivon.param_groups[0]["ess"] < 1e6
        noise, distance = _held_out_noise(trainer, held_out)
        assert 0.5 * alpha * distance < noise < 1.5 * alpha * distance, (alpha, noise, distance)
        # digits are learned (the mean fairly certain), so the target comes near LS's 2α(1 − 1/K)
        assert knob.history[-1]["target"] > 0.7 * label_smoothing_noise(alpha, 10)


def test_more_smoothing_means_a_smaller_ess_and_a_larger_label_noise(smoothed):
    (low, low_data), (high, _) = smoothed[0.05], smoothed[0.3]
    assert high.ivon.param_groups[0]["ess"] < low.ivon.param_groups[0]["ess"]
    assert np.mean(high.label_noise(low_data)["noise_l1"]) > 2 * np.mean(low.label_noise(low_data)["noise_l1"])


def test_the_posterior_and_the_card_record_the_ess_that_was_used(smoothed):
    trainer, _ = smoothed[0.3]
    ess = trainer.ivon.param_groups[0]["ess"]
    meta = trainer.posterior().metadata
    assert meta["ess"] == pytest.approx(ess) and meta["ivon_smoothing"] == 0.3
    # σ = 1/sqrt(ess (h + δ)) with the ess the optimizer samples with
    assert trainer.ivon.param_groups[0]["ess"] == pytest.approx(trainer.method.config.ess)


@pytest.mark.slow
def test_a_resume_continues_with_the_ess_the_knob_reached(tmp_path):
    whole, _ = _train(tmp_path / "whole", 0.3, save_strategy="steps", save_steps=300)
    torch.manual_seed(0)
    args = make_args(tmp_path / "resumed", num_train_epochs=6, ivon_preset="finetune", clip_radius=1e-2,
                     learning_rate=0.3, ivon_smoothing=0.3)
    resumed = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=digits_dataset().select(range(1200)))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-300"))
    # the updates up to 300 are in the checkpoint's ess
    assert [h["step"] for h in _knob(resumed).history] == [360, 450]
    assert resumed.ivon.param_groups[0]["ess"] == pytest.approx(whole.ivon.param_groups[0]["ess"], rel=1e-6)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b)


def test_ivon_smoothing_is_refused_outside_its_range_and_without_ivon(tmp_path):
    with pytest.raises(ValueError, match="ivon_smoothing"):
        make_args(tmp_path, ivon_smoothing=1.5)
    with pytest.raises(ValueError, match="ivon_smoothing"):
        make_args(tmp_path, method="ls", method_config={"ivon_smoothing": 0.1})


def _summary(mean_l1, num_classes):
    quantiles = {f"q{q:02d}": mean_l1 for q in (0, 10, 25, 50, 75, 90, 99, 100)}
    return {"num_examples": 100, "num_classes": num_classes,
            "all": {"noise_l1": {"mean": mean_l1, "std": 0.0, **quantiles}}}


def test_the_card_sets_the_measured_label_noise_beside_label_smoothing():
    from varsmooth.hub.posterior_text import label_noise_numbers

    # the text example's former export: mean |ε̄|₁ 0.0019 on 2 classes, LS at α = 0.1 adds 0.1
    text = label_noise_numbers(_summary(0.0019, 2))
    assert "label smoothing with α = 0.0019" in text and "near-point posterior" in text and "(α = 0.1: 0.1)" in text
    assert "near-point" not in label_noise_numbers(_summary(0.09, 10))  # α = 0.05 on 10 classes
    asked = label_noise_numbers(_summary(0.5, 10), asked=0.3)
    assert "as LS at α = 0.3 would with the model's own predictions" in asked


class _Simulated:
    """A posterior whose mean ‖ε̄‖₁ is distance · e0/(e0 + ess) (it grows towards the distance from uniform as ess
    falls), and a mean that unlearns below `ess_learns`: its distance from uniform falls with ess there, as the draws'
    noise keeps it from fitting (what wrecked a 2,000-sentence SST-2 run under a fixed target of LS's size)."""

    def __init__(self, ess, e0=1e4, ess_learns=1e3, distance=1.0, reach=1.0):
        self.ess, self.e0, self.ess_learns, self.distance, self.reach = ess, e0, ess_learns, distance, reach

    def measure(self, num_samples, seed):
        distance = self.distance * min(1.0, self.ess / self.ess_learns)
        return self.reach * distance * self.e0 / (self.e0 + self.ess), distance

    def scale_ess(self, factor):
        self.ess *= factor
        return self.ess


def _run_knob(system, alpha, steps=100):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    knob = SmoothingStrengthCallback(alpha).connect(system.measure, system.scale_ess, seed=0)
    state = TrainerState(max_steps=steps)
    for step in range(1, steps + 1):
        state.global_step = step
        knob.on_step_end(TrainingArguments(output_dir="unused", report_to="none"), state, TrainerControl())
    return knob


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5])
def test_the_knob_settles_where_the_noise_is_alpha_of_the_distance_from_uniform(alpha):
    system = _Simulated(ess=1e8)
    _run_knob(system, alpha)
    solution = system.e0 * (1 - alpha) / alpha  # reach · e0/(e0 + ess) = α
    assert solution / 1.2 < system.ess < solution * 1.2


def test_a_target_out_of_reach_leaves_ess_where_it_was_instead_of_driving_it_down():
    # ε̄ never exceeds half the distance from uniform: α = 0.9 cannot be reached at any ess
    system = _Simulated(ess=1e8, reach=0.5)
    knob = _run_knob(system, 0.9)
    assert knob.history[0]["ess"] == pytest.approx(1e8)
    # the later corrections move at most ×3 each, and the mean still learns where they leave it
    assert system.ess == pytest.approx(1e8 / 3 ** 4) and system.ess > system.ess_learns


def test_a_mean_that_predicts_uniformly_leaves_ess_alone():
    system = _Simulated(ess=1e8, distance=0.0)
    knob = _run_knob(system, 0.3)
    assert system.ess == 1e8 and [h["ess"] for h in knob.history] == [1e8] * 5
