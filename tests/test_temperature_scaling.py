"""Post-hoc temperature scaling (Guo et al. 2017): fit by validation NLL, apply to any prediction, save with the
model."""

import contextlib
import json
import os

import numpy as np
import pytest
import torch
from transformers import ResNetForImageClassification

from helpers import TinyClassifier, make_args, noisy_digits_images, tiny_digits_resnet
from varsmooth import TemperatureScaling, VariationalModel, VariationalTrainer, pipeline
from varsmooth.files import read_manifest
from varsmooth.outputs import VariationalClassifierOutput
from varsmooth.temperature_scaling import TEMPERATURE_SCALING_FILE


def _numpy_nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    """−log softmax(z/T)_y written out in float64, independently of the module."""
    z = logits.astype(np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-log_p[np.arange(len(labels)), labels].mean())


def _calibrated_sample(n: int, k: int = 10, seed: int = 0, scale: float = 2.0):
    """Logits z and labels drawn from softmax(z): a perfectly calibrated model by construction."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, scale, (n, k))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labels = np.array([rng.choice(k, p=row) for row in p])
    return z, labels


def test_temperature_one_is_the_identity():
    torch.manual_seed(0)
    logits = torch.randn(7, 5) * 3
    log_probs = logits.log_softmax(-1)
    probs = log_probs.exp()
    out = VariationalClassifierOutput(logits=log_probs, probs=probs, mean_logits=logits, mean_probs=probs,
                                      entropy=-(probs * log_probs).sum(-1), mutual_information=torch.full((7,), 0.25))
    calibrated = TemperatureScaling(1.0).calibrate(out)
    torch.testing.assert_close(calibrated.logits, log_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(calibrated.probs, probs, rtol=0, atol=1e-7)
    torch.testing.assert_close(calibrated.entropy, out.entropy, rtol=0, atol=1e-6)
    # on raw logits too: log-softmax only shifts them
    torch.testing.assert_close(TemperatureScaling(1.0).calibrate_log_probs(logits), log_probs, rtol=0, atol=1e-6)
    # a temperature ≠ 1 is softmax(z / T), and leaves the draws' disagreement and the mean prediction alone
    scaled = TemperatureScaling(2.5).calibrate(out)
    torch.testing.assert_close(scaled.probs, (logits / 2.5).softmax(-1), rtol=0, atol=1e-6)
    assert scaled.mutual_information is out.mutual_information and scaled.mean_probs is out.mean_probs


@pytest.mark.parametrize("scale", [0.2, 1.0, 5.0])
def test_fitted_temperature_never_raises_the_validation_nll_and_is_the_minimum(scale):
    z, labels = _calibrated_sample(400, seed=1)
    logits = z * scale  # under-confident (0.2), calibrated (1), over-confident (5)
    original = logits.copy()
    fitted = TemperatureScaling.fit(logits, labels)
    np.testing.assert_array_equal(logits, original)  # input untouched
    t = fitted.temperature
    at_one, at_t = _numpy_nll(logits, labels, 1.0), _numpy_nll(logits, labels, t)
    assert fitted.nll_uncalibrated == pytest.approx(at_one, rel=1e-9)
    assert fitted.nll_calibrated == pytest.approx(at_t, rel=1e-9)
    assert at_t <= at_one
    # a minimum: neighbouring temperatures are not better (the NLL is convex in 1/T)
    for factor in (0.97, 1.03):
        assert _numpy_nll(logits, labels, t * factor) >= at_t - 1e-12
    assert fitted.num_examples == 400


def test_an_over_confident_model_gets_temperature_five():
    """Logits 5·z of a model calibrated at z: the population NLL (a proper scoring rule) is minimised exactly at
    T = 5, where softmax(5z / T) is the distribution the labels were drawn from."""
    z, labels = _calibrated_sample(20000, seed=2)
    fitted = TemperatureScaling.fit(5.0 * z, labels)
    assert fitted.temperature == pytest.approx(5.0, rel=0.03)
    assert fitted.nll_calibrated < fitted.nll_uncalibrated - 0.5


def test_ignore_index_and_bad_inputs():
    z, labels = _calibrated_sample(300, seed=3)
    padded = np.concatenate([z * 5, 100 * np.ones((5, 10))])
    with_ignored = np.concatenate([labels, np.full(5, -100)])
    assert (TemperatureScaling.fit(padded, with_ignored).temperature
            == pytest.approx(TemperatureScaling.fit(z * 5, labels).temperature, rel=1e-6))
    with pytest.raises(ValueError, match="no labelled"):
        TemperatureScaling.fit(z, np.full(len(z), -100))
    with pytest.raises(ValueError, match=r"Labels must lie in \[0, 10\)"):
        TemperatureScaling.fit(z, labels + 10)
    with pytest.raises(ValueError, match="finite number > 0"):
        TemperatureScaling(0.0)


def test_save_load_round_trip_and_stale_file_refused(tmp_path):
    torch.manual_seed(0)
    model = TinyClassifier()
    scaling = TemperatureScaling(2.0, nll_uncalibrated=1.2, nll_calibrated=0.9, num_examples=50,
                                 prediction={"kind": "weights"})
    path = scaling.save(tmp_path, model)
    assert os.path.basename(path) == TEMPERATURE_SCALING_FILE
    assert TemperatureScaling.load(tmp_path, model) == scaling
    assert TemperatureScaling.load(tmp_path / "elsewhere", model) is None  # nothing saved there
    with torch.no_grad():
        model.head.bias[0] += 1e-3  # other weights: a later run saved into the folder
    with pytest.raises(ValueError, match="other weights"):
        TemperatureScaling.load(tmp_path, model)
    (tmp_path / TEMPERATURE_SCALING_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid temperature-scaling file"):
        TemperatureScaling.load(tmp_path, model)


# -- in the trainer ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["erm", "ivon"])
def fitted_run(request, tmp_path_factory):
    """A short noisy digits run (ERM or IVON with BMA) with temperature scaling fitted when training ends."""
    out = tmp_path_factory.mktemp(f"ts-{request.param}")
    train, val, processor, transform = noisy_digits_images(150)

    # IVON at τ = 1: temperature scaling then calibrates an average over the posterior (τ's choice is tested apart)
    method_kw = (dict(eval_mc_samples=6, beta2=0.999, posterior_temperature=1.0) if request.param == "ivon"
                 else dict(learning_rate=0.05, optim="sgd"))
    args = make_args(out, method=request.param, max_steps=40, temperature_scaling=True, remove_unused_columns=False,
                     per_device_eval_batch_size=32, **method_kw)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=train.with_transform(transform),
                                 eval_dataset=val.with_transform(transform), processing_class=processor)
    trainer.train()
    return trainer, val, transform, out


def test_trainer_fits_temperature_at_train_end_and_evaluate_applies_it(fitted_run):
    trainer, val, transform, _ = fitted_run
    scaling = trainer.temperature_scaling
    assert scaling is not None and scaling.temperature != 1.0 and scaling.num_examples == len(val)
    calibrated = trainer.evaluate()
    trainer.temperature_scaling = None
    try:
        raw = trainer.evaluate()
        raw_log_probs = trainer.predict(val.with_transform(transform)).predictions
    finally:
        trainer.temperature_scaling = scaling
    # the fit scored exactly the prediction evaluate() makes, on the same examples
    assert raw["eval_nll"] == pytest.approx(scaling.nll_uncalibrated, rel=1e-5)
    assert calibrated["eval_nll"] == pytest.approx(scaling.nll_calibrated, rel=1e-5)
    assert calibrated["eval_nll"] < raw["eval_nll"]
    assert calibrated["eval_accuracy"] == raw["eval_accuracy"]  # a rescaling keeps the argmax
    labels = np.asarray(val["label"])
    assert scaling.nll_calibrated == pytest.approx(_numpy_nll(raw_log_probs, labels, scaling.temperature), rel=1e-5)
    expected_kind = "bma" if trainer.args.method == "ivon" else "weights"
    assert scaling.prediction["kind"] == expected_kind
    assert any(entry.get("temperature_scaling") == scaling.temperature for entry in trainer.state.log_history)


def test_saved_temperature_is_applied_by_from_pretrained_and_pipeline_and_refused_when_stale(fitted_run, tmp_path):
    trainer, val, transform, _ = fitted_run
    trainer.save_model(str(tmp_path))
    assert TEMPERATURE_SCALING_FILE in read_manifest(tmp_path)["files"]
    saved = json.loads((tmp_path / TEMPERATURE_SCALING_FILE).read_text())
    assert saved["temperature"] == trainer.temperature_scaling.temperature
    expected = np.exp(trainer.predict(val.with_transform(transform)).predictions)
    loaded = VariationalModel.from_pretrained(tmp_path)
    assert loaded.temperature_scaling == trainer.temperature_scaling
    pixels = transform(val[:])["pixel_values"]
    with torch.no_grad():
        np.testing.assert_allclose(loaded(pixel_values=pixels).probs.numpy(), expected, rtol=1e-5, atol=1e-6)
        uncalibrated = VariationalModel.from_pretrained(tmp_path,
                                                        temperature_scaling=False)(pixel_values=pixels).probs.numpy()
    assert not np.allclose(uncalibrated, expected, atol=1e-3)
    classify = pipeline("image-classification", model=str(tmp_path))
    piped = classify(val[:5]["image"], top_k=10)
    piped_probs = [[next(r["score"] for r in res if r["label"] == str(k)) for k in range(10)] for res in piped]
    np.testing.assert_allclose(piped_probs, expected[:5], rtol=1e-5, atol=1e-6)

    # other weights written over the folder's (same file size): the manifest's hash refuses them first; without the
    # manifest, the temperature is refused by its own fingerprint
    other = tmp_path / "other"
    tiny_digits_resnet().save_pretrained(other)
    os.replace(other / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"SHA-256 .*\['model.safetensors'\]"):
        VariationalModel.from_pretrained(tmp_path)
    os.remove(tmp_path / "varsmooth_manifest.json")
    with pytest.raises(ValueError, match=f"{TEMPERATURE_SCALING_FILE} was fitted for other weights"):
        TemperatureScaling.load(tmp_path, ResNetForImageClassification.from_pretrained(tmp_path))
    if trainer.args.method == "erm":  # (an IVON folder's posterior is refused first, for the same reason)
        with pytest.raises(ValueError, match=f"{TEMPERATURE_SCALING_FILE} was fitted for other weights"):
            VariationalModel.from_pretrained(tmp_path)


def test_a_later_save_without_temperature_removes_the_file(fitted_run, tmp_path):
    trainer, _, _, _ = fitted_run
    trainer.save_model(str(tmp_path))
    scaling = trainer.temperature_scaling
    trainer.temperature_scaling = None
    try:
        trainer.save_model(str(tmp_path))
    finally:
        trainer.temperature_scaling = scaling
    assert not (tmp_path / TEMPERATURE_SCALING_FILE).exists()


def test_temperature_scaling_without_eval_dataset_is_refused_before_training(tmp_path):
    from helpers import digits_dataset

    args = make_args(tmp_path, method="erm", max_steps=2, temperature_scaling=True)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=digits_dataset(32))
    with pytest.raises(ValueError, match="eval_dataset"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_the_pipelines_uncertainty_is_one_measurement_of_the_uncalibrated_draws(fitted_run, tmp_path):
    """The entropy, expected entropy and mutual information a pipeline reports come from the same draws (the τ = 1 BMA
    for a model predicting at its posterior mean), uncalibrated, so the mutual information never exceeds the entropy;
    the scores stay the calibrated prediction at the chosen τ."""
    trainer, val, transform, _ = fitted_run
    trainer.save_model(str(tmp_path))
    ivon = trainer.args.method == "ivon"
    images, pixels = val[:8]["image"], transform(val[:8])["pixel_values"]
    measured = VariationalModel.from_pretrained(tmp_path, temperature_scaling=False)
    assert measured.posterior_predictor.temperature == 1.0  # the run's τ
    with torch.no_grad():
        draws = measured(pixel_values=pixels)
    for temperature in (None, 0.0):
        with pytest.warns(UserWarning) if temperature == 0.0 and ivon else contextlib.nullcontext():
            classify = pipeline("image-classification", model=str(tmp_path), temperature=temperature)
            scored = VariationalModel.from_pretrained(tmp_path, temperature=temperature)
        with torch.no_grad():
            expected_scores = scored(pixel_values=pixels).probs.numpy()
        for row, image in enumerate(images):
            answer = classify(image, return_uncertainty=True, top_k=10)
            scores = [next(p["score"] for p in answer["predictions"] if p["label"] == str(k)) for k in range(10)]
            np.testing.assert_allclose(scores, expected_scores[row], rtol=1e-5, atol=1e-6)
            assert answer["entropy"] == pytest.approx(draws.entropy[row].item(), rel=1e-5, abs=1e-6)
            if not ivon:  # no draws: the entropy of the prediction, nothing else measured
                assert (answer["mutual_information"] is answer["expected_entropy"] is answer["uncertainty_temperature"]
                        is None)
                continue
            assert answer["uncertainty_temperature"] == 1.0
            assert answer["mutual_information"] == pytest.approx(draws.mutual_information[row].item(), rel=1e-5,
                                                                 abs=1e-6)
            assert answer["expected_entropy"] == pytest.approx(answer["entropy"] - answer["mutual_information"])
            assert 0 <= answer["mutual_information"] <= answer["entropy"]
