"""Posterior temperature τ: σ scaled by τ at prediction time, τ chosen by validation NLL after training."""

import json

import numpy as np
import pytest
import torch
from transformers import HfArgumentParser

from helpers import TinyClassifier, digits_dataset, make_args, noisy_digits_images, tiny_digits_resnet
from varsmooth import (
    LabelNoiseCallback,
    PosteriorTemperature,
    VariationalModel,
    VariationalTrainer,
    VariationalTrainingArguments,
    pipeline,
)
from varsmooth.label_noise import compute_label_noise
from varsmooth.posterior import DiagonalGaussianPosterior, derive_seed
from varsmooth.prediction.batchnorm import draw_batchnorm_statistics
from varsmooth.prediction.bma import predictive_distribution
from varsmooth.prediction.temperature import (
    SELECTION_SAMPLES,
    TEMPERATURE_GRID,
    TIE_STANDARD_ERRORS,
    choose_temperature,
    paired_standard_errors,
    temperature_nll,
    tied_temperatures,
)


def _model_and_posterior(scale=0.3):
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    gen = torch.Generator().manual_seed(1)
    std = {n: scale * torch.rand(p.shape, generator=gen) for n, p in model.named_parameters()}
    return model, std


def _hand_bma(model, std, x, num_samples, seed, scale=1.0):
    """BMA written out: draws 2k and 2k+1 set every weight to m ± (scale·σ)⊙e (an antithetic pair), with e seeded as
    the posterior seeds it from derive_seed(seed, k)."""
    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = 0
    for s in range(num_samples):
        sign = -1.0 if s % 2 else 1.0
        with torch.no_grad():
            for index, (name, p) in enumerate(model.named_parameters()):
                gen = torch.Generator().manual_seed(derive_seed(derive_seed(seed, s // 2), index))
                p.data = mean[name] + sign * torch.randn(p.shape, generator=gen) * (scale * std[name])
            total = total + model(pixel_values=x).logits.float().softmax(-1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = mean[name]
    return total / num_samples


def test_temperature_zero_is_the_mean_prediction_exactly():
    model, std = _model_and_posterior()
    posterior = DiagonalGaussianPosterior(model, std)
    x = torch.rand(20, 8, 8)
    out = predictive_distribution(model, posterior, {"pixel_values": x}, num_samples=16, seed=3, temperature=0.0)
    with torch.no_grad():
        mean_probs = model(pixel_values=x).logits.softmax(-1)
    assert torch.equal(out.probs, mean_probs)
    assert torch.equal(out.probs, out.mean_probs)
    assert out.mutual_information is None and out.noise_rms is None  # no draws: nothing measured, nothing reported
    # sampling at τ = 0 leaves the weights at the mean
    before = [p.detach().clone() for p in model.parameters()]
    with posterior.sampled(seed=5, scale=0.0):
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_temperature_one_is_the_learned_bma_and_scales_the_draws():
    model, std = _model_and_posterior()
    posterior = DiagonalGaussianPosterior(model, std)
    x = torch.rand(20, 8, 8)
    expected = _hand_bma(model, std, x, num_samples=6, seed=3)
    default = predictive_distribution(model, posterior, {"pixel_values": x}, num_samples=6, seed=3).probs
    torch.testing.assert_close(default, expected, rtol=0, atol=1e-7)
    # a cooler posterior is the BMA of σ scaled by τ, with the same draws e (they come from the cache here)
    half = predictive_distribution(model, posterior, {"pixel_values": x}, num_samples=6, seed=3, temperature=0.5).probs
    torch.testing.assert_close(half, _hand_bma(model, std, x, num_samples=6, seed=3, scale=0.5), rtol=0, atol=1e-6)
    assert not torch.allclose(half, default, atol=1e-3)
    # back to 1: exactly the first prediction (the cached σ⊙e was not scaled in place)
    assert torch.equal(predictive_distribution(model, posterior, {"pixel_values": x}, num_samples=6, seed=3).probs,
                       default)


def test_bad_temperatures_are_refused(tmp_path):
    model, std = _model_and_posterior()
    posterior = DiagonalGaussianPosterior(model, std)
    for bad in (-0.1, float("nan"), float("inf"), "auto"):
        with pytest.raises(ValueError, match="temperature"):
            PosteriorTemperature(bad)
        with pytest.raises(ValueError, match="temperature"):
            temperature_nll(model, posterior, [{"pixel_values": torch.rand(2, 8, 8), "labels": torch.zeros(2)}],
                            (bad,), num_samples=2)
    with pytest.raises(ValueError, match="posterior_temperature"):
        make_args(tmp_path, posterior_temperature=-0.5)
    (args,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--posterior_temperature", "0.25"])
    assert args.posterior_temperature == 0.25
    (args,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(["--output_dir",
                                                                                          str(tmp_path)])
    assert args.posterior_temperature is None  # auto


def test_choose_temperature_takes_the_lowest_nll_and_prefers_the_mean_on_ties():
    assert choose_temperature({0.0: 0.5, 0.5: 0.4, 1.0: 0.6}) == 0.5
    assert choose_temperature({0.0: 0.4, 0.5: 0.4, 1.0: 0.4}) == 0.0  # a tie: the mean, one forward pass
    assert choose_temperature({0.0: 0.4, 0.5: float("nan"), 1.0: 0.6}) == 0.0


def test_nll_differences_within_two_paired_standard_errors_are_a_tie():
    # τ = 0.25 is 0.004 worse than the mean on average, but over 400 examples whose differences vary by ±0.2 that is
    # within 2 standard errors (0.2 / sqrt(400) = 0.01); τ = 1 is 0.05 worse, beyond them
    generator = torch.Generator().manual_seed(0)
    base = torch.rand(400, generator=generator, dtype=torch.float64)
    spread = torch.randn(400, generator=generator, dtype=torch.float64)
    spread = (spread - spread.mean()) / spread.std() * 0.2
    losses = {0.0: base, 0.25: base + 0.004 + spread, 1.0: base + 0.05 + spread / 4}
    nll = {t: float(v.mean()) for t, v in losses.items()}
    se = paired_standard_errors(losses)
    assert se[0.0] == 0.0 and se[0.25] == pytest.approx(0.01, rel=1e-6) and se[1.0] == pytest.approx(0.0025, rel=1e-6)
    assert tied_temperatures(nll, se) == [0.0, 0.25] and choose_temperature(nll, se) == 0.0
    assert tied_temperatures(nll) == [0.0]  # without standard errors only rounding-level differences tie
    losses[0.25] = base - 0.004 + spread  # now τ = 0.25 leads, and the mean ties with it
    nll = {t: float(v.mean()) for t, v in losses.items()}
    assert tied_temperatures(nll, paired_standard_errors(losses)) == [0.0, 0.25]
    assert 0.0 in TEMPERATURE_GRID and 1.0 in TEMPERATURE_GRID


def test_temperature_nll_scores_each_bma_with_common_draws():
    model, std = _model_and_posterior()
    posterior = DiagonalGaussianPosterior(model, std)
    x, y = torch.rand(30, 8, 8), torch.randint(0, 10, (30,))
    batches = [{"pixel_values": x[:16], "labels": y[:16]}, {"pixel_values": x[16:], "labels": y[16:]}]
    nll = temperature_nll(model, posterior, batches, (0.0, 0.5, 1.0), num_samples=6, seed=3)
    rows = torch.arange(30)
    for tau in (0.0, 0.5, 1.0):
        probs = _hand_bma(model, std, x, num_samples=6, seed=3, scale=tau)
        assert nll[tau] == pytest.approx(float(-probs[rows, y].log().mean()), rel=1e-5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short noisy digits run whose BMA is worse than its mean (σ still at its prior value), τ chosen
    automatically."""
    out = tmp_path_factory.mktemp("temperature")
    train, val, processor, transform = noisy_digits_images(120)

    # eval_mc_samples = the selection's draws (temperature.SELECTION_SAMPLES), so evaluate() predicts what it scored
    args = make_args(out, max_steps=30, eval_mc_samples=SELECTION_SAMPLES, beta2=0.999, eval_seed=3,
                     remove_unused_columns=False)
    callback = LabelNoiseCallback(num_samples=4)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.with_transform(transform),
                                 eval_dataset=val.with_transform(transform), processing_class=processor,
                                 callbacks=[callback])
    trainer.train()
    return trainer, val, transform, out


def test_chosen_temperature_is_never_worse_than_mean_or_learned_posterior(run):
    trainer, _, _, _ = run
    held = trainer.posterior_temperature
    report, chosen = held.selection, held.value
    assert report is not None and report["temperature"] == chosen and f"{chosen:g}" in report["nll"]
    assert not held.fixed
    measured = {}
    for tau in (0.0, 1.0, chosen):
        trainer.prepare_predictor(PosteriorTemperature(tau))
        measured[tau] = trainer.evaluate()
    trainer.prepare_predictor(held)
    # evaluate() predicts with τ: its NLL is the one the selection measured, and τ = 0 is the posterior mean's
    for tau in (0.0, 1.0):
        assert measured[tau]["eval_nll"] == pytest.approx(report["nll"][f"{tau:g}"], rel=1e-5)
    assert measured[0.0]["eval_nll"] == pytest.approx(measured[0.0]["eval_mean_nll"], rel=1e-6)
    # the best of the grid, not just 0 and 1, or the smallest τ the validation set cannot tell from it
    best = min(report["nll"], key=report["nll"].get)
    assert chosen == min(report["tied"]) and float(best) in report["tied"]
    margin = TIE_STANDARD_ERRORS * report["standard_error"][f"{chosen:g}"] + 1e-6
    assert measured[chosen]["eval_nll"] <= min(measured[0.0]["eval_nll"], measured[1.0]["eval_nll"]) + margin
    assert trainer.posterior_temperature.value == chosen == trainer.posterior_predictor().temperature
    assert any(entry.get("posterior_temperature") == chosen for entry in trainer.state.log_history)


def test_saved_temperature_is_used_by_the_reloaded_model_and_pipeline(run, tmp_path):
    trainer, val, transform, _ = run
    held = trainer.posterior_temperature
    try:
        # strictly between 0 and 1, so that losing it would show
        trainer.prepare_predictor(0.25)
        trainer.save_model(str(tmp_path))
        expected = np.exp(trainer.predict(val.with_transform(transform)).predictions)
        trainer.prepare_predictor(1.0)
        learned = np.exp(trainer.predict(val.with_transform(transform)).predictions)
    finally:
        trainer.prepare_predictor(held)
    assert not np.allclose(expected, learned, atol=1e-3)
    loaded = VariationalModel.from_pretrained(tmp_path)
    assert loaded.posterior_predictor.temperature == 0.25
    pixels = transform(val[:])["pixel_values"]
    with torch.no_grad():
        np.testing.assert_allclose(loaded(pixel_values=pixels).probs.numpy(), expected, rtol=1e-5, atol=1e-6)
    classify = pipeline("image-classification", model=str(tmp_path))
    piped = classify(val[:6]["image"], top_k=10)
    piped_probs = [[next(r["score"] for r in res if r["label"] == str(k)) for k in range(10)] for res in piped]
    np.testing.assert_allclose(piped_probs, expected[:6], rtol=1e-5, atol=1e-6)
    # the draws of another τ have no BatchNorm statistics of their own in the folder: said, not silently predicted
    with pytest.warns(UserWarning, match="BatchNorm statistics of their own"):
        VariationalModel.from_pretrained(tmp_path, temperature=1.0)


def test_label_noise_export_samples_the_learned_posterior_whatever_tau_was_chosen(run):
    import pyarrow.parquet as pq

    trainer, _, _, out = run
    summary = json.loads((out / "label_noise_summary.json").read_text())
    chosen = trainer.posterior_temperature.value
    # a run where the selection moved τ off 1, so an export at the chosen τ would show
    assert chosen != 1.0
    assert summary["posterior_temperature"] == 1.0 and summary["prediction_posterior_temperature"] == chosen
    exported = np.stack(pq.read_table(out / "label_noise.parquet").column("noise").to_pylist())
    np.testing.assert_allclose(exported, np.stack(trainer.label_noise(num_samples=4)["noise"]), atol=1e-6)
    def at(temperature):
        return compute_label_noise(trainer.model, trainer.posterior(), trainer.train_dataset, num_samples=4,
                                   seed=trainer.args.eval_seed, collate_fn=trainer.data_collator,
                                   temperature=temperature)

    if chosen == 0:  # an export at τ = 0 would be the zero of no draws
        with pytest.raises(ValueError, match="temperature=0 draws nothing"):
            at(chosen)
    else:
        assert not np.allclose(exported, np.stack(at(chosen)["noise"]), atol=1e-4)


def test_model_card_shows_the_temperature_and_its_validation_nll(run):
    trainer, _, _, out = run
    trainer.create_model_card()
    card = (out / "README.md").read_text()
    assert "## Posterior temperature" in card
    report = trainer.posterior_temperature.selection
    for tau in ("0", "1", f"{trainer.posterior_temperature.value:g}"):
        assert f"{report['nll'][tau]:.4f}" in card
    assert "(chosen)" in card


def test_without_eval_data_the_learned_posterior_is_kept(tmp_path):
    data = digits_dataset(96)
    trainer = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, max_steps=4, eval_mc_samples=4),
                                 train_dataset=data)
    trainer.train()
    assert trainer.posterior_temperature == PosteriorTemperature(1.0, fixed=False, selection=None)
    fixed = VariationalTrainer(model=TinyClassifier(), train_dataset=data, eval_dataset=data,
                               args=make_args(tmp_path, max_steps=4, eval_mc_samples=4, posterior_temperature=0.5))
    fixed.train()
    assert fixed.posterior_temperature == PosteriorTemperature(0.5, fixed=True, selection=None)
    assert fixed.posterior_predictor().temperature == 0.5


def test_noise_corrected_nll_is_the_forward_corrected_likelihood():
    """−log (Tᵀ P̂_τ)[y] by hand (Patrini et al. 2017, forward correction); with T = I it is the plain NLL."""
    from varsmooth.corruption.transition import pairflip_transition

    model, std = _model_and_posterior()
    posterior = DiagonalGaussianPosterior(model, std)
    x, y = torch.rand(30, 8, 8), torch.randint(0, 10, (30,))
    batches = [{"pixel_values": x[:16], "labels": y[:16]}, {"pixel_values": x[16:], "labels": y[16:]}]
    T = pairflip_transition(10, 0.3)
    corrected = temperature_nll(model, posterior, batches, (0.0, 1.0), num_samples=4, seed=3, transition=T)
    plain = temperature_nll(model, posterior, batches, (0.0, 1.0), num_samples=4, seed=3)
    identity = temperature_nll(model, posterior, batches, (0.0, 1.0), num_samples=4, seed=3, transition=np.eye(10))
    rows = torch.arange(30)
    for tau in (0.0, 1.0):
        noisy = _hand_bma(model, std, x, num_samples=4, seed=3, scale=tau).double() @ torch.as_tensor(T)
        assert corrected[tau] == pytest.approx(float(-noisy[rows, y].log().mean()), rel=1e-6)
        assert identity[tau] == pytest.approx(plain[tau], rel=1e-9)
        assert corrected[tau] != pytest.approx(plain[tau], rel=1e-3)


def test_noise_corrected_nll_prefers_the_clean_prediction_that_plain_nll_rejects():
    """Noisy labels drawn from T applied to a confident, correct predictor: the plain NLL prefers a smoothed copy of
    it (calibrated to the noisy labels), the forward-corrected NLL the predictor itself, as a proper score should."""
    from types import SimpleNamespace

    from varsmooth.corruption.transition import symmetric_transition

    K, n = 10, 4000
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, K, (n,), generator=gen)
    T = torch.as_tensor(symmetric_transition(K, 0.4))
    noisy = torch.multinomial(T[clean], 1, generator=gen).squeeze(1)
    sharp = torch.full((n, K), 0.01 / (K - 1)).scatter_(1, clean[:, None], 0.99)
    smooth = 0.5 * sharp + 0.5 / K

    class Fixed(torch.nn.Module):  # "τ" picks the predictor: 0 the sharp one, 1 the smoothed one
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, index):
            probs = sharp[index] if float(self.w) == 0.0 else smooth[index]
            return SimpleNamespace(logits=probs.log())

    model = Fixed()
    posterior = DiagonalGaussianPosterior(model, {"w": torch.ones(())})
    import varsmooth.prediction.temperature as temperature

    def fake_draws(model, posterior, batch, num_samples, seed, draw_buffers=None, temperature=1.0):  # τ > 0: smoothed
        if temperature > 0:
            model.w.data.fill_(temperature)
            yield model(batch["index"]).logits.exp()
            model.w.data.fill_(0.0)

    batches = [{"index": torch.arange(n), "labels": noisy}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(temperature, "model_logits", lambda model, batch: model(batch["index"]).logits)
        mp.setattr(temperature, "sampled_probs", fake_draws)
        plain = temperature_nll(model, posterior, batches, (0.0, 1.0), num_samples=1)
        corrected = temperature_nll(model, posterior, batches, (0.0, 1.0), num_samples=1, transition=T)
    assert choose_temperature(plain) == 1.0 and choose_temperature(corrected) == 0.0


@pytest.mark.parametrize("matrix, message", [
    (np.ones((2, 3)) / 3, "square"),
    (np.full((3, 3), 0.5), "rows|summing"),
    (np.array([[1.5, -0.5], [0.0, 1.0]]), "non-negative"),
    (np.full((4, 4), 0.25), "singular"),
])
def test_bad_transition_matrices_are_refused(matrix, message):
    from varsmooth.prediction.temperature import check_transition_matrix

    with pytest.raises(ValueError, match=message):
        check_transition_matrix(matrix)
    with pytest.raises(ValueError, match="10 classes"):
        check_transition_matrix(np.eye(3), num_classes=10)


def test_trainer_chooses_by_the_corrected_nll_and_records_it(tmp_path):
    from safetensors import safe_open

    from varsmooth.corruption.transition import symmetric_transition
    from varsmooth.prediction.temperature import CORRECTED_NLL_CRITERION

    T = symmetric_transition(10, 0.4)
    train, val, processor, transform = noisy_digits_images(60)
    args = make_args(tmp_path, max_steps=10, eval_mc_samples=4, eval_seed=3, remove_unused_columns=False)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.with_transform(transform),
                                 eval_dataset=val.with_transform(transform), processing_class=processor,
                                 eval_noise_transition=T)
    trainer.train()
    report = trainer.posterior_temperature.selection
    assert report["criterion"] == CORRECTED_NLL_CRITERION and np.allclose(report["transition"], T)
    batches = trainer._batchnorm_batches(trainer.model)  # each draw's statistics, from the training examples in order
    expected = temperature_nll(trainer.model, trainer.posterior(), trainer.validation_batches(trainer.eval_dataset),
                               TEMPERATURE_GRID, SELECTION_SAMPLES, 3, transition=T, draw_buffers=lambda tau: (
                                   draw_batchnorm_statistics(trainer.model, trainer.posterior(), lambda: iter(batches),
                                                             SELECTION_SAMPLES, 3, temperature=tau)))
    assert {float(k): v for k, v in report["nll"].items() if float(k) in expected} == pytest.approx(expected, rel=1e-9)
    trainer.save_model()
    trainer.create_model_card()
    assert "noise-corrected validation NLL" in (tmp_path / "README.md").read_text()
    with safe_open(str(tmp_path / "posterior.safetensors"), "pt") as f:
        saved = json.loads(f.metadata()["varsmooth"])["posterior_temperature_selection"]
    assert saved["criterion"] == CORRECTED_NLL_CRITERION and np.allclose(saved["transition"], T)
    with pytest.raises(ValueError, match="square"):
        VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.with_transform(transform),
                           eval_noise_transition=np.eye(3)[:2])
    three = VariationalTrainer(model=tiny_digits_resnet(), train_dataset=train.with_transform(transform),
                               args=make_args(tmp_path / "three", max_steps=1, eval_mc_samples=4,
                                              remove_unused_columns=False),
                               eval_dataset=val.with_transform(transform), eval_noise_transition=np.eye(3))
    with pytest.raises(RuntimeError, match="predicts 10 classes") as failed:
        three.train()
    assert isinstance(failed.value.__cause__, ValueError)
    assert (tmp_path / "three" / "posterior.safetensors").is_file()  # what comes after training never loses the run
