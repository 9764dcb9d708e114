"""Uncertainty metrics (issue 22) against hand computations, closed forms and scikit-learn, and their use by
`evaluate()` and the model card."""

from __future__ import annotations

import itertools
import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import VariationalTrainer
from varsmooth.metrics import (
    adaptive_calibration_error,
    aurc,
    auroc,
    classification_metrics,
    classwise_calibration_error,
    expected_calibration_error,
    fpr_at_tpr,
    ood_metrics,
    optimal_aurc,
    reliability_diagram,
    risk_coverage_curve,
    uncertainty_scores,
)


def _random_probs(n=300, k=4, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2
    return np.exp(logits) / np.exp(logits).sum(1, keepdims=True), rng.integers(0, k, n)


# -- reliability diagram and calibration errors ------------------------------------------------------------------
def test_reliability_diagram_bins_by_hand():
    probs = np.array([[0.6, 0.4], [0.4, 0.6], [0.9, 0.1], [0.05, 0.95], [0.3, 0.7]])
    labels = np.array([0, 0, 0, 1, 1])  # confidences 0.6 (right), 0.6 (wrong), 0.9, 0.95, 0.7 (right)
    d = reliability_diagram(probs, labels, n_bins=10)
    np.testing.assert_allclose(d["edges"], np.linspace(0, 1, 11))
    assert d["count"].tolist() == [0, 0, 0, 0, 0, 2, 1, 0, 1, 1]  # (0.5, 0.6], (0.6, 0.7], (0.8, 0.9], (0.9, 1]
    np.testing.assert_allclose(d["confidence"][[5, 6, 8, 9]], [0.6, 0.7, 0.9, 0.95])
    np.testing.assert_allclose(d["accuracy"][[5, 6, 8, 9]], [0.5, 1.0, 1.0, 1.0])
    assert np.isnan(d["accuracy"][0]) and np.isnan(d["confidence"][0])
    expected = (2 * 0.1 + 1 * 0.3 + 1 * 0.1 + 1 * 0.05) / 5
    assert expected_calibration_error(probs, labels, 10) == pytest.approx(expected)


def test_adaptive_bins_hold_equal_mass_by_hand():
    conf = np.array([0.9, 0.55, 0.8, 0.6, 0.99, 0.7])
    probs = np.stack([conf, 1 - conf], 1)
    labels = np.array([0, 1, 0, 0, 1, 0])  # right: 0.9, 0.8, 0.6, 0.7; wrong: 0.55, 0.99
    d = reliability_diagram(probs, labels, n_bins=3, adaptive=True)
    assert d["count"].tolist() == [2, 2, 2]  # {0.55, 0.6}, {0.7, 0.8}, {0.9, 0.99}
    np.testing.assert_allclose(d["edges"], [0.55, 0.7, 0.9, 0.99])
    np.testing.assert_allclose(d["confidence"], [0.575, 0.75, 0.945])
    np.testing.assert_allclose(d["accuracy"], [0.5, 1.0, 0.5])
    expected = (abs(0.5 - 0.575) + abs(1 - 0.75) + abs(0.5 - 0.945)) / 3
    assert adaptive_calibration_error(probs, labels, 3) == pytest.approx(expected)
    # one example per bin: the mean |1[correct] − confidence|
    correct = probs.argmax(1) == labels
    assert adaptive_calibration_error(probs, labels, 6) == pytest.approx(np.abs(correct - conf).mean())


def test_adaptive_and_equal_width_differ_where_confidences_crowd():
    # 90 examples at confidence 0.97-0.99 and 10 at 0.5: equal-width bins lump the 90, equal-mass bins split them
    rng = np.random.default_rng(1)
    conf = np.r_[rng.uniform(0.97, 0.99, 90), np.full(10, 0.5)]
    probs = np.stack([conf, 1 - conf], 1)
    labels = (rng.uniform(size=100) > np.r_[np.full(90, 0.9), np.full(10, 0.5)]).astype(int)
    d = reliability_diagram(probs, labels, 10, adaptive=True)
    assert d["count"].tolist() == [10] * 10
    assert reliability_diagram(probs, labels, 10)["count"].max() == 90


def test_classwise_ece_by_hand():
    probs = np.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    labels = np.array([0, 2, 2])
    # 2 bins per class, (0, 0.5] and (0.5, 1]: per class Σ_bins |Σ hits − Σ p| / N
    class0 = abs(0 - (0.2 + 0.1)) + abs(1 - 0.7)          # bin 0 holds 0.2, 0.1 (no hit); bin 1 holds 0.7 (hit)
    class1 = abs(0 - (0.2 + 0.5 + 0.1))                    # 0.5 is in (0, 0.5]
    class2 = abs(1 - (0.1 + 0.3)) + abs(1 - 0.8)
    expected = (class0 + class1 + class2) / 3 / 3
    assert classwise_calibration_error(probs, labels, n_bins=2) == pytest.approx(expected)
    # one-hot predictions of the true class are perfectly calibrated
    assert classwise_calibration_error(np.eye(3)[labels], labels) == 0.0


def test_metrics_skip_ignored_labels_and_refuse_bad_bins():
    probs, labels = _random_probs()
    masked = labels.copy()
    masked[::3] = -100
    keep = masked != -100
    assert classification_metrics(probs, masked) == classification_metrics(probs[keep], labels[keep])
    with pytest.raises(ValueError, match="n_bins must be a positive integer"):
        reliability_diagram(probs, labels, n_bins=0)
    with pytest.raises(ValueError, match="n_bins"):
        classwise_calibration_error(probs, labels, n_bins=2.5)


def test_classification_metrics_reports_the_new_metrics():
    probs, labels = _random_probs()
    before = probs.copy()
    m = classification_metrics(probs, labels)
    assert m["adaptive_ece"] == adaptive_calibration_error(probs, labels)
    assert m["classwise_ece"] == classwise_calibration_error(probs, labels)
    assert m["aurc"] == aurc(probs.max(1), probs.argmax(1) == labels)
    np.testing.assert_array_equal(probs, before)  # inputs are not modified


# -- selective prediction ---------------------------------------------------------------------------------------
def test_risk_coverage_by_hand():
    conf = np.array([0.9, 0.5, 0.8, 0.3])
    correct = np.array([True, False, False, True])  # order 0.9 ✓, 0.8 ✗, 0.5 ✗, 0.3 ✓
    coverage, risk = risk_coverage_curve(conf, correct)
    np.testing.assert_allclose(coverage, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(risk, [0, 1 / 2, 2 / 3, 2 / 4])
    assert aurc(conf, correct) == pytest.approx((0 + 1 / 2 + 2 / 3 + 1 / 2) / 4)


def _closed_form_optimal_aurc(n: int, m: int) -> float:
    """(1/N)·[m − (N − m)(H_N − H_{N−m})], H the harmonic numbers (Geifman et al. 2019, §5), in exact arithmetic."""
    harmonic = lambda j: sum(Fraction(1, i) for i in range(1, j + 1))  # noqa: E731
    return float((m - (n - m) * (harmonic(n) - harmonic(n - m))) / n)


@pytest.mark.parametrize("n,m", [(10, 3), (57, 20), (8, 0), (5, 5)])
def test_aurc_of_a_perfect_ranking_is_its_closed_form(n, m):
    rng = np.random.default_rng(n)
    correct = np.r_[np.ones(n - m, bool), np.zeros(m, bool)]
    conf = np.r_[rng.uniform(0.6, 1.0, n - m), rng.uniform(0.0, 0.5, m)]  # every error below every right answer
    perm = rng.permutation(n)
    assert aurc(conf[perm], correct[perm]) == pytest.approx(_closed_form_optimal_aurc(n, m), abs=1e-12)
    assert optimal_aurc(correct[perm]) == pytest.approx(_closed_form_optimal_aurc(n, m), abs=1e-12)
    # the reverse ranking (errors first) is the worst
    assert aurc(-conf[perm], correct[perm]) >= aurc(rng.uniform(size=n), correct[perm]) - 1e-12


def test_ties_are_averaged_over_their_order():
    conf = np.array([0.9, 0.7, 0.7, 0.7, 0.2, 0.2])
    correct = np.array([1, 0, 1, 1, 0, 1], bool)
    # brute force: the mean risk curve over every order of the tied examples
    groups = [[0], [1, 2, 3], [4, 5]]
    curves = []
    for order in itertools.product(*(itertools.permutations(g) for g in groups)):
        ranked = correct[list(itertools.chain(*order))]
        curves.append(np.cumsum(~ranked) / np.arange(1, 7))
    _, risk = risk_coverage_curve(conf, correct)
    np.testing.assert_allclose(risk, np.mean(curves, 0))
    # a constant score knows nothing: the error rate at every coverage
    _, flat = risk_coverage_curve(np.full(6, 0.5), correct)
    np.testing.assert_allclose(flat, np.full(6, 2 / 6))
    assert aurc(np.full(6, 0.5), correct) == pytest.approx(2 / 6)


def test_selective_inputs_are_checked():
    with pytest.raises(ValueError, match="same shape"):
        aurc(np.ones(3), np.ones(4, bool))
    with pytest.raises(ValueError, match="booleans"):
        aurc(np.ones(3), np.array([0.2, 1, 0]))
    with pytest.raises(ValueError, match="NaN"):
        aurc(np.array([0.1, np.nan]), np.array([True, False]))


# -- OOD detection ----------------------------------------------------------------------------------------------
def _fpr_by_definition(scores_in, scores_out, tpr):
    """Fraction of `scores_out` ≥ t at the largest t among the scores that keeps a fraction ≥ `tpr` of `scores_in`
    (exact fractions: 19/20 is 0.95)."""
    target = Fraction(str(tpr))
    kept = [t for t in np.r_[scores_in, scores_out] if Fraction(int((scores_in >= t).sum()), len(scores_in)) >= target]
    return (scores_out >= max(kept)).mean()


@pytest.mark.parametrize("seed", range(6))
def test_auroc_and_fpr_at_tpr_by_brute_force(seed):
    """AUROC = P(score_in > score_out) + ½ P(tie) over all pairs, and FPR at TPR by its definition, on small arrays
    with and without ties; the numbers the hand-written rank statistic gave before scikit-learn computed them."""
    rng = np.random.default_rng(seed)
    n_in, n_out = rng.integers(1, 40, 2)
    if seed % 2:  # integer scores: many ties within and across the sets
        scores_in, scores_out = rng.integers(0, 8, n_in).astype(float), rng.integers(0, 6, n_out).astype(float)
    else:
        scores_in, scores_out = rng.normal(size=n_in), rng.normal(0.5, size=n_out)
    diff = scores_in[:, None] - scores_out[None, :]
    assert auroc(scores_in, scores_out) == pytest.approx((diff > 0).mean() + 0.5 * (diff == 0).mean(), abs=1e-12)
    for tpr in (0.95, 0.5, 0.8, 0.3, 1.0):
        assert fpr_at_tpr(scores_in, scores_out, tpr) == _fpr_by_definition(scores_in, scores_out, tpr)
    assert fpr_at_tpr(scores_in, scores_out) == fpr_at_tpr(scores_in, scores_out, 0.95)


def test_fpr_at_tpr_reads_points_inside_straight_roc_segments():
    # the ROC points (0, 0), (1/3, 1/3), (2/3, 2/3), (1, 1) are collinear: the TPR-1/3 point is inside a segment
    assert fpr_at_tpr(np.array([3.0, 2.0, 1.0]), np.array([3.0, 2.0, 1.0]), 1 / 3) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="tpr must lie"):
        fpr_at_tpr(np.ones(3), np.ones(3), 0.0)
    with pytest.raises(ValueError, match="NaN"):
        auroc(np.array([np.nan, 1.0]), np.ones(2))
    with pytest.raises(ValueError, match="scores_out contains infinite"):
        fpr_at_tpr(np.ones(2), np.array([-np.inf, 1.0]))


def test_auroc_extremes_and_symmetry():
    assert auroc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert auroc(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 0.0
    assert auroc(np.ones(5), np.ones(7)) == 0.5
    assert fpr_at_tpr(np.arange(100.0), np.arange(100.0) - 1000) == 0.0
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(0.5, size=40)
    assert auroc(a, b) == pytest.approx(1 - auroc(b, a))


def test_uncertainty_scores_by_definition():
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    s = uncertainty_scores(probs, logits, mutual_information=np.array([0.1, 0.4]))
    np.testing.assert_allclose(s["max_prob"], probs.max(1))
    np.testing.assert_allclose(s["entropy"], [(probs[0] * np.log(probs[0])).sum(), -math.log(3)])
    np.testing.assert_allclose(s["mutual_information"], [-0.1, -0.4])
    np.testing.assert_allclose(s["energy"], [math.log(math.e ** 2 + 1 + math.e ** -1), math.log(3)])


def test_ood_metrics_names_and_separation():
    rng = np.random.default_rng(0)
    confident = np.eye(4)[rng.integers(0, 4, 100)] * 0.9 + 0.025
    unsure = rng.dirichlet(np.ones(4) * 5, 80)
    m = ood_metrics(confident, unsure)
    assert set(m) == {"ood_max_prob_auroc", "ood_max_prob_fpr95", "ood_entropy_auroc", "ood_entropy_fpr95"}
    assert m["ood_max_prob_auroc"] == 1.0 and m["ood_max_prob_fpr95"] == 0.0
    # logits = log p + c: the energy score logsumexp is c, whatever the probabilities
    full = ood_metrics(confident, unsure, logits_in=np.log(confident) - 1.0, logits_out=np.log(unsure) + 2.0,
                       mutual_information_in=np.zeros(100), mutual_information_out=np.ones(80))
    assert full["ood_mutual_information_auroc"] == 1.0
    assert full["ood_energy_auroc"] == 0.0 and full["ood_energy_fpr95"] == 1.0
    with pytest.raises(ValueError, match="both"):
        ood_metrics(confident, unsure, logits_in=np.log(confident))


# -- in the trainer and the card --------------------------------------------------------------------------------
def test_evaluate_reports_the_new_metrics_and_the_card_shows_the_diagram(tmp_path):
    train, test = digits_dataset(200), digits_dataset(120, seed=1)
    args = make_args(tmp_path, method="erm", max_steps=5, learning_rate=0.05, eval_mc_samples=0)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=train)
    trainer.train()
    metrics = trainer.evaluate(test)
    probs = np.exp(trainer.predict(test).predictions)
    labels = np.asarray(test["label"])
    assert metrics["eval_adaptive_ece"] == pytest.approx(adaptive_calibration_error(probs, labels), abs=1e-6)
    assert metrics["eval_classwise_ece"] == pytest.approx(classwise_calibration_error(probs, labels), abs=1e-6)
    assert metrics["eval_aurc"] == pytest.approx(aurc(probs.max(1), probs.argmax(1) == labels), abs=1e-6)
    diagram = reliability_diagram(probs, labels)
    np.testing.assert_array_equal(trainer.reliability_diagram["count"], diagram["count"])
    trainer.save_model()
    trainer.create_model_card()
    picture = tmp_path / "reliability_diagram.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (tmp_path / "README.md").read_text()
    assert "![reliability_diagram.png](reliability_diagram.png)" in card
    assert "reliability_diagram.png" in json.loads((tmp_path / "varsmooth_manifest.json").read_text())["files"]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


# -- how many posterior samples ---------------------------------------------------------------------------------
def test_posterior_samples_curve_matches_the_bma_of_each_s(tmp_path):
    from varsmooth.evaluation import ood_evaluation, posterior_samples_curve
    from varsmooth.prediction.bma import predictive_distribution

    train, test = digits_dataset(160), digits_dataset(64, seed=1)
    args = make_args(tmp_path, max_steps=6, eval_mc_samples=3, beta2=0.99, posterior_temperature=1.0)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=train)
    trainer.train()
    rows = posterior_samples_curve(trainer, test, sample_counts=(1, 4))
    assert [r["num_samples"] for r in rows] == [1, 4] and all(r["seconds"] > 0 for r in rows)
    assert trainer.args.eval_mc_samples == 3  # restored
    posterior, labels = trainer.posterior(), np.asarray(test["label"])
    for row in rows:  # the BMA over the first S draws, computed directly
        out = predictive_distribution(trainer.model, posterior, {"pixel_values": test[:]["pixel_values"]},
                                      row["num_samples"], trainer.args.eval_seed)
        expected = classification_metrics(out.probs.numpy(), labels)
        for key in ("accuracy", "nll", "ece", "aurc"):
            assert row[key] == pytest.approx(expected[key], abs=1e-5)
    assert rows[0]["nll"] != pytest.approx(rows[1]["nll"], abs=1e-6)  # the samples change the prediction
    # OOD detection of the trainer's BMA (3 draws), digits against uniform noise images
    noise = test.with_format(None).map(lambda row, i: {"pixel_values": np.random.default_rng(i).uniform(0, 1, (8, 8))},
                                       with_indices=True).with_format("torch")
    metrics = ood_evaluation(trainer, test, noise)
    outs = [predictive_distribution(trainer.model, posterior, {"pixel_values": d[:]["pixel_values"]}, 3,
                                    trainer.args.eval_seed)
            for d in (test, noise)]
    expected = ood_metrics(outs[0].probs.numpy(), outs[1].probs.numpy(), logits_in=outs[0].mean_logits.numpy(),
                           logits_out=outs[1].mean_logits.numpy(),
                           mutual_information_in=outs[0].mutual_information.numpy(),
                           mutual_information_out=outs[1].mutual_information.numpy())
    assert metrics.keys() == expected.keys() and len(metrics) == 8
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-3), key
    with pytest.raises(ValueError, match="positive integers"):
        posterior_samples_curve(trainer, test, sample_counts=(0, 2))
    erm = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path / "erm", method="erm", max_steps=2),
                             train_dataset=train)
    erm.train()
    with pytest.raises(ValueError, match="no posterior to sample"):
        posterior_samples_curve(erm, test)


def test_reliability_picture_draws_the_bins(tmp_path, monkeypatch):
    from varsmooth import figures as plots

    figures = []
    save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, out, name: figures.append(fig) or save(fig, out, name))
    probs, labels = _random_probs(200, 3, seed=4)
    diagram = reliability_diagram(probs, labels, n_bins=10)
    path = plots.plot_reliability_diagram(diagram, tmp_path)
    assert path == str(tmp_path / "reliability_diagram.png") and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    top, bottom = figures[0].axes
    filled = diagram["count"] > 0
    accuracy_bars = top.containers[0]
    np.testing.assert_allclose([bar.get_height() for bar in accuracy_bars], diagram["accuracy"][filled])
    np.testing.assert_allclose([bar.get_x() for bar in accuracy_bars], diagram["edges"][:-1][filled])
    np.testing.assert_allclose(sum(bar.get_height() for bar in bottom.containers[0]), 1.0)
    assert f"ECE {100 * expected_calibration_error(probs, labels, 10):.2f} %" in top.get_title()
    with pytest.raises(ValueError, match="no examples"):
        plots.plot_reliability_diagram({**diagram, "count": np.zeros(10, int)}, tmp_path)
