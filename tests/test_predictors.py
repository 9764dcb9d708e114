"""`varsmooth.prediction.predictors`: one predictor per kind of prediction, chosen by `make_predictor`, each measuring
its uncertainty as one measurement (entropy ≥ mutual information, from the same draws)."""

import pytest
import torch

from helpers import TinyClassifier
from varsmooth import DeepEnsemble, TemperatureScaling, VariationalModel
from varsmooth.posterior import DiagonalGaussianPosterior
from varsmooth.prediction.bma import predictive_distribution
from varsmooth.prediction.predictors import PosteriorPredictor, make_predictor
from varsmooth.prediction.temperature import PosteriorTemperature


def _posterior(network: torch.nn.Module) -> DiagonalGaussianPosterior:
    gen = torch.Generator().manual_seed(1)
    std = {n: 0.5 * torch.rand(p.shape, generator=gen) for n, p in network.named_parameters()}
    return DiagonalGaussianPosterior(network, std)


def _bma(network: torch.nn.Module, num_samples: int, temperature: float = 1.0, seed: int = 0,
         posterior: DiagonalGaussianPosterior | None = None) -> PosteriorPredictor:
    return PosteriorPredictor(_posterior(network) if posterior is None else posterior, num_samples, seed,
                              PosteriorTemperature(temperature))


def _dropout_network() -> torch.nn.Module:
    torch.manual_seed(0)
    network = TinyClassifier()
    network.body = torch.nn.Sequential(torch.nn.Dropout(0.5), network.body)
    return network.eval()


@pytest.fixture()
def network():
    torch.manual_seed(0)
    return TinyClassifier().eval()


def test_the_factory_chooses_each_kind_and_describes_it(network):
    assert make_predictor(network, _bma(network, 4, seed=2)).describe() == {
        "kind": "bma", "num_samples": 4, "posterior_temperature": 1.0}
    for bma in (_bma(network, 4, 0.0), _bma(network, 0),
                _bma(network, 4, posterior=DiagonalGaussianPosterior.point_mass(network))):
        assert make_predictor(network, bma).describe() == {"kind": "weights"}
    dropout = _dropout_network()
    assert make_predictor(dropout, _bma(dropout, 0, posterior=DiagonalGaussianPosterior.point_mass(dropout)),
                          mc_dropout_samples=3).describe() == {
        "kind": "mc_dropout", "num_samples": 3}
    ensemble = DeepEnsemble([VariationalModel(network, _posterior(network), num_samples=2),
                             VariationalModel(network, DiagonalGaussianPosterior.point_mass(network), num_samples=0)])
    assert make_predictor(ensemble, _bma(network, 8, posterior=DiagonalGaussianPosterior.point_mass(network))
                          ).describe() == {
        "kind": "ensemble", "members": 2,
        "member_predictions": [{"kind": "bma", "num_samples": 2, "posterior_temperature": 1.0}, {"kind": "weights"}]}


def test_evaluate_reports_the_temperature_and_the_draws_averaged(network):
    assert make_predictor(network, _bma(network, 4, 0.5)).evaluation_entries() == {
        "posterior_temperature": 0.5, "posterior_samples_averaged": 4}
    assert make_predictor(network, _bma(network, 4, 0.0)).evaluation_entries() == {
        "posterior_temperature": 0.0, "posterior_samples_averaged": 0}


def test_at_the_mean_the_uncertainty_is_the_learned_posteriors_bma_while_the_prediction_stays_at_the_mean(network):
    x = {"pixel_values": torch.rand(6, 8, 8)}
    predictor = make_predictor(network, _bma(network, 4, 0.0, seed=3))
    prediction = predictor.predict(network, x)
    assert prediction.mutual_information is None  # nothing drawn, nothing measured
    measured = predictor.uncertainty(network, x, prediction)
    learned = predictive_distribution(network, _posterior(network), x, 4, seed=3)
    assert predictor.uncertainty_temperature == 1.0
    for field in ("probs", "entropy", "mutual_information"):  # entropy and MI of the same draws, τ = 1's
        torch.testing.assert_close(getattr(measured, field), getattr(learned, field), rtol=0, atol=0)
    at_one = make_predictor(network, _bma(network, 4, 1.0, seed=3))
    assert at_one.uncertainty(network, x, prediction) is prediction  # the prediction's own draws, not drawn again
    assert make_predictor(network, _bma(network, 0)).uncertainty_temperature is None


def test_every_kind_reports_a_mutual_information_no_larger_than_the_entropy_beside_it(network):
    x = {"pixel_values": torch.rand(32, 8, 8) * 4}
    dropout = _dropout_network()
    sharpening = TemperatureScaling(0.05)  # would push a calibrated entropy below the draws' mutual information
    models = [
        VariationalModel(network, _posterior(network), num_samples=6, temperature_scaling=sharpening),
        VariationalModel(network, _posterior(network), num_samples=6, temperature_scaling=sharpening, temperature=0.0),
        VariationalModel(dropout, DiagonalGaussianPosterior.point_mass(dropout), num_samples=0, mc_dropout_samples=6,
                         temperature_scaling=sharpening),
        DeepEnsemble([VariationalModel(network, _posterior(network), num_samples=2),
                      VariationalModel(dropout, DiagonalGaussianPosterior.point_mass(dropout), num_samples=0)],
                     temperature_scaling=sharpening),
    ]
    for model in models:
        scored, measured = model.predict_with_uncertainty(**x)
        torch.testing.assert_close(scored.probs, model(**x).probs)
        assert measured.mutual_information is not None
        assert (measured.mutual_information <= measured.entropy + 1e-6).all()
        assert (scored.entropy < measured.mutual_information).any()  # the calibrated entropy is not the one measured


def test_a_trainer_predicts_an_ensemble_with_its_own_temperature_as_the_ensemble_does(network):
    x = {"pixel_values": torch.rand(5, 8, 8)}
    ensemble = DeepEnsemble([VariationalModel(network, _posterior(network), num_samples=2)],
                            temperature_scaling=TemperatureScaling(2.5))
    predictor = make_predictor(ensemble, _bma(network, 4, posterior=DiagonalGaussianPosterior.point_mass(network)))
    torch.testing.assert_close(predictor.predict(ensemble, x).probs, ensemble(**x).probs, rtol=0, atol=0)
    assert predictor.describe() == ensemble.predictor.describe()  # what a temperature fitted on top would record


def test_a_posterior_prediction_saves_and_loads_with_its_tau_and_draws_and_sigma_holds_none_of_them(network, tmp_path):
    report = {"temperature": 0.25, "nll": {"0": 0.6, "0.25": 0.5, "1": 0.7}, "criterion": "validation NLL"}
    saved = PosteriorPredictor(_posterior(network), 6, 3, PosteriorTemperature.chosen(report))
    saved.save(tmp_path)
    loaded = PosteriorPredictor.load(network, tmp_path)
    assert (loaded.num_samples, loaded.seed, loaded.posterior_temperature) == (6, 3, saved.posterior_temperature)
    assert not {"posterior_temperature", "eval_mc_samples", "eval_seed"} & set(loaded.posterior.metadata)
    x = {"pixel_values": torch.rand(5, 8, 8)}
    torch.testing.assert_close(loaded.predict(network, x).probs, saved.predict(network, x).probs, rtol=0, atol=0)
    # what the caller names replaces what was saved; a τ named is fixed, not chosen
    other = PosteriorPredictor.load(network, tmp_path, num_samples=2, seed=5, temperature=0.5)
    assert (other.num_samples, other.seed, other.posterior_temperature) == (2, 5, PosteriorTemperature(0.5, True))
    # another τ is another prediction: this one is left as it was
    assert saved.drawing(temperature=PosteriorTemperature(1.0)).temperature == 1.0 and saved.temperature == 0.25
