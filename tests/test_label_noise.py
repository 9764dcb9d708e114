"""Per-example label noise (Variational Learning Induces Adaptive Label Smoothing (Yang et al. 2025), Eq. 12, 15, 19)
against closed-form theory and numbers computed by Gauss–Hermite quadrature, plus the export path: trainer, callback,
parquet, summary, atomic writes."""

from __future__ import annotations

import copy
import json
import os

import datasets
import numpy as np
import pytest
import torch
import transformers
from numpy.polynomial.hermite import hermgauss
from scipy.special import expit
from transformers import default_data_collator
from transformers.utils import ModelOutput

from helpers import WORKERS, run_script
from varsmooth import DiagonalGaussianPosterior, VariationalTrainer, VariationalTrainingArguments
from varsmooth.label_noise import (
    LabelNoiseCallback,
    compute_label_noise,
    detection_metrics,
    logistic_label_noise,
    logistic_label_noise_peak,
    logistic_label_noise_rms,
    mislabel_detection_report,
    summarize_label_noise,
    write_label_noise,
)
from varsmooth.label_noise.compute import noise_adaptivity
from varsmooth.posterior import derive_seed

# ε(m, v=1) by 64-node Gauss–Hermite quadrature, computed separately and printed to 5 decimals
REFERENCE_EPS = {0.0: 0.0, 0.5: 0.02043, 1.0: 0.03432, 1.5: 0.03905, 2.0: 0.03626, 4.0: 0.01012}
REFERENCE_PEAK = (1.529, 0.039061)


# -- closed-form helper -------------------------------------------------------------------------------------------
def test_gauss_hermite_matches_reference_table():
    for m, eps in REFERENCE_EPS.items():
        assert logistic_label_noise(m, 1.0) == pytest.approx(eps, abs=5e-6)
        assert logistic_label_noise(-m, 1.0) == pytest.approx(-eps, abs=5e-6)  # odd in m
    peak_m, peak = logistic_label_noise_peak(1.0)
    assert peak_m == pytest.approx(REFERENCE_PEAK[0], abs=5e-4)
    assert peak == pytest.approx(REFERENCE_PEAK[1], abs=5e-7)
    # the peak grows and moves out with the variance (Yang et al. 2025, Fig. 2)
    assert logistic_label_noise_peak(0.25) == pytest.approx((1.38, 0.0113), abs=5e-3)
    assert logistic_label_noise_peak(4.0) == pytest.approx((1.85, 0.1062), abs=5e-3)
    # the per-step noise is largest at m = 0 instead (0.2083 for v = 1)
    assert logistic_label_noise_rms(0.0, 1.0) == pytest.approx(0.2083, abs=1e-4)
    assert logistic_label_noise(3.0, 0.0) == 0.0


# -- Monte Carlo estimate through the real code path ---------------------------------------------------------------
class ShiftedLogit(torch.nn.Module):
    """Two-class softmax with logit difference f = mean + offset[replicate].

    With q(offset_r) = N(0, 1) every row sees f ~ N(mean, 1) exactly — Bayesian logistic regression with φᵀφ = 1
    (Yang et al. 2025, Eq. 11) — and the R replicates are R independent draws per posterior sample, so S samples give
    R·S draws per mean in S forward passes.
    """

    def __init__(self, replicates: int):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(replicates))

    def forward(self, replicate, mean):
        f = mean + self.offset[replicate]
        return {"logits": torch.stack([torch.zeros_like(f), f], -1)}


def test_monte_carlo_noise_matches_gauss_hermite():
    R, S = 400, 50  # 20 000 draws of f per mean, common to all means
    grid = np.round(np.arange(-4.0, 4.0001, 0.125), 6)
    means = np.repeat(grid, R)
    data = datasets.Dataset.from_dict(
        {"replicate": np.tile(np.arange(R), len(grid)), "mean": means.astype(np.float32),
         "label": (means > 0).astype(np.int64)}
    )
    model = ShiftedLogit(R)
    posterior = DiagonalGaussianPosterior(model, {"offset": torch.ones(R)})
    noise = compute_label_noise(model, posterior, data, num_samples=S, batch_size=len(data), seed=3)

    eps = np.asarray(noise["noise"])[:, 1].reshape(len(grid), R).mean(1)  # class 1 is the positive class
    exact = logistic_label_noise(grid, 1.0)
    x, w = hermgauss(64)
    second = (w * expit(grid[:, None] + np.sqrt(2.0) * x) ** 2).sum(1) / np.sqrt(np.pi)
    se = np.sqrt((second - (expit(grid) - exact) ** 2) / (R * S))  # sd of σ(f) over the draws / sqrt(draws)
    assert np.all(np.abs(eps - exact) <= 4 * se)
    assert abs(eps[grid == 0.0][0]) <= 4 * se[grid == 0.0][0]
    assert np.all(np.sign(eps[np.abs(grid) >= 0.5]) == np.sign(grid[np.abs(grid) >= 0.5]))

    # the peak: quadratic through the largest grid value and its neighbours
    for sign in (1.0, -1.0):
        side = np.flatnonzero(sign * grid > 0)
        i = side[np.argmax(np.abs(eps[side]))]
        y0, y1, y2 = np.abs(eps[i - 1 : i + 2])
        peak_m = abs(grid[i] + 0.125 * 0.5 * (y0 - y2) / (y0 - 2 * y1 + y2))
        assert peak_m == pytest.approx(REFERENCE_PEAK[0], abs=0.15)
        assert y1 == pytest.approx(REFERENCE_PEAK[1], abs=4 * se[i])

    # per-step noise (Eq. 19 analogue): ‖(−ε_s, ε_s)‖₂ = √2 |ε_s|
    rms = np.sqrt((np.asarray(noise["noise_rms"]) ** 2).reshape(len(grid), R).mean(1))
    np.testing.assert_allclose(rms, np.sqrt(2.0) * logistic_label_noise_rms(grid, 1.0), rtol=0.03)


# -- a small multiclass network -----------------------------------------------------------------------------------
class TinyClassifier(torch.nn.Module):
    def __init__(self, dim: int = 4, num_classes: int = 3, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, num_classes))

    def forward(self, features, labels=None):
        return ModelOutput(logits=self.net(features))


def make_data(n: int = 48, dim: int = 4, num_classes: int = 3, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    clean = rng.integers(0, num_classes, n)
    features = rng.normal(size=(n, dim)).astype(np.float32) + clean[:, None]
    flip = rng.random(n) < 0.25
    label = np.where(flip, (clean + 1 + rng.integers(0, num_classes - 1, n)) % num_classes, clean)
    class_label = datasets.ClassLabel(num_classes=num_classes)
    features_spec = datasets.Features({
        "features": datasets.List(datasets.Value("float32"), length=dim), "label": class_label,
        "clean_label": class_label, "is_corrupted": datasets.Value("bool"), "note": datasets.Value("string"),
    })
    return datasets.Dataset.from_dict(
        {"features": features, "label": label, "clean_label": clean, "is_corrupted": label != clean,
         "note": [f"row {i}" for i in range(n)]},
        features=features_spec,
    )


def random_posterior(model: torch.nn.Module, scale: float = 0.5) -> DiagonalGaussianPosterior:
    gen = torch.Generator().manual_seed(1)
    return DiagonalGaussianPosterior(
        model, {name: scale * torch.rand(p.shape, generator=gen) for name, p in model.named_parameters()}
    )


def test_noise_columns_are_consistent_and_batch_independent():
    torch.manual_seed(0)
    model, data = TinyClassifier(), make_data()
    posterior = random_posterior(model)
    noise = compute_label_noise(model, posterior, data, num_samples=16, batch_size=7)
    table = noise.with_format("numpy")[:]
    labels = np.asarray(data["label"])
    rows = np.arange(len(data))

    assert noise.num_rows == len(data)
    np.testing.assert_array_equal(table["example_index"], rows)
    np.testing.assert_array_equal(table["label"], labels)
    np.testing.assert_array_equal(table["clean_label"], data["clean_label"])
    np.testing.assert_array_equal(table["is_corrupted"], data["is_corrupted"])
    assert "note" not in noise.column_names
    assert noise.features["label"] == data.features["label"]

    eps = table["noise"]
    assert np.abs(eps).max() > 1e-3
    np.testing.assert_allclose(eps.sum(1), 0.0, atol=1e-6)  # Σ_k ε̄_k = 0
    np.testing.assert_allclose(table["smoothed_label"].sum(1), 1.0, atol=1e-6)
    np.testing.assert_allclose(eps, table["mean_probs"] - table["predictive_probs"], atol=1e-7)
    np.testing.assert_allclose(table["smoothed_label"], np.eye(3)[labels] + eps, atol=1e-7)
    np.testing.assert_allclose(table["noise_at_label"], np.abs(eps[rows, labels]), atol=1e-7)
    np.testing.assert_allclose(table["noise_l1"], np.abs(eps).sum(1), rtol=1e-5)
    np.testing.assert_allclose(table["noise_l2"], np.linalg.norm(eps, axis=1), rtol=1e-5)
    np.testing.assert_allclose(table["confidence"], table["predictive_probs"][rows, labels], atol=1e-7)
    np.testing.assert_allclose(table["mean_confidence"], table["mean_probs"][rows, labels], atol=1e-7)
    # p̄ is the prediction at the posterior mean, row by row
    with torch.no_grad():
        direct = model.net(torch.as_tensor(data.with_format("numpy")[:]["features"])).softmax(-1).numpy()
    np.testing.assert_allclose(table["mean_probs"], direct, atol=1e-6)
    # ‖E_s[ε_s]‖ ≤ sqrt(E_s‖ε_s‖²) (Jensen): the mean noise is never larger than the per-step RMS
    assert np.all(table["noise_l2"] <= table["noise_rms"] + 1e-6)

    # the S posterior draws are the same models whatever the batching
    again = compute_label_noise(model, posterior, data, num_samples=16, batch_size=64).with_format("numpy")[:]
    np.testing.assert_allclose(again["noise"], eps, atol=1e-6)
    assert model.training  # restored


def test_point_mass_posterior_is_refused_and_zero_std_gives_zero_noise():
    model, data = TinyClassifier(), make_data(n=20)
    with pytest.raises(ValueError, match="point mass.*zero by definition"):
        compute_label_noise(model, DiagonalGaussianPosterior.point_mass(model), data, num_samples=8)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        compute_label_noise(model, random_posterior(model), data, num_samples=0)
    zero_std = DiagonalGaussianPosterior(model, {n: torch.zeros_like(p) for n, p in model.named_parameters()})
    again = compute_label_noise(model, zero_std, data, num_samples=8).with_format("numpy")[:]
    assert np.all(again["noise_rms"] == 0.0)  # every draw equals the mean
    np.testing.assert_allclose(again["noise"], 0.0, atol=1e-7)  # up to float32 rounding of the average of 8 equal terms


def test_many_classes_keep_magnitudes_and_top_k():
    torch.manual_seed(0)
    model, data = TinyClassifier(num_classes=12), make_data(n=20, num_classes=12)
    posterior = random_posterior(model, scale=1.0)
    full = compute_label_noise(model, posterior, data, num_samples=8).with_format("numpy")[:]
    short = compute_label_noise(model, posterior, data, num_samples=8, max_full_classes=10, top_k=3)
    assert not {"noise", "mean_probs", "predictive_probs", "smoothed_label"} & set(short.column_names)
    short = short.with_format("numpy")[:]
    np.testing.assert_allclose(short["noise_l2"], full["noise_l2"], rtol=1e-6)
    order = np.argsort(-np.abs(full["noise"]), axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.sort(short["noise_topk_indices"], 1), np.sort(order, 1))
    np.testing.assert_allclose(short["noise_topk_values"],
                               np.take_along_axis(full["noise"], short["noise_topk_indices"], 1), atol=1e-7)


def test_input_errors():
    model = TinyClassifier()
    with pytest.raises(ValueError, match="argument of"):
        compute_label_noise(model, random_posterior(model), datasets.Dataset.from_dict({"x": [1.0], "label": [0]}))
    other = TinyClassifier()
    with pytest.raises(ValueError, match="another model"):
        compute_label_noise(model, random_posterior(other), make_data(n=4))
    # rows must come back in dataset order, all of them
    data = make_data(n=30)
    rows = data.select_columns(["features", "label"]).with_format("torch")
    shuffled = torch.utils.data.DataLoader(rows, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0),
                                           collate_fn=default_data_collator)
    with pytest.raises(RuntimeError, match="reorders"):
        compute_label_noise(model, random_posterior(model), data, dataloader=shuffled)
    truncated = torch.utils.data.DataLoader(rows, batch_size=8, drop_last=True, collate_fn=default_data_collator)
    with pytest.raises(RuntimeError, match="24 examples but the dataset has 30"):
        compute_label_noise(model, random_posterior(model), data, dataloader=truncated)


# -- detection metrics --------------------------------------------------------------------------------------------
def test_detection_metrics_by_hand():
    # positives score 0.9, 0.7; negatives 0.8, 0.1 -> 3 of 4 pairs ordered; ranking + - + - gives AP (1 + 2/3)/2
    metrics = detection_metrics(np.array([0.9, 0.8, 0.1, 0.7]), np.array([1, 0, 0, 1]))
    assert metrics == pytest.approx({"auroc": 0.75, "average_precision": (1 + 2 / 3) / 2, "precision_at_k": 0.5})
    columns = {"confidence": np.array([0.1, 0.9, 0.8]), "mean_confidence": np.array([0.2, 0.7, 0.9]),
               "noise_at_label": np.array([0.0, 0.3, 0.1]), "noise_l1": np.array([0.1, 0.2, 0.3]),
               "noise_rms": np.array([0.3, 0.2, 0.1]), "is_corrupted": np.array([True, False, False])}
    report = mislabel_detection_report(columns)
    assert report["num_corrupted"] == 1
    assert report["scores"]["one_minus_confidence"]["auroc"] == 1.0
    assert report["scores"]["noise_at_label"]["auroc"] == 0.0  # reported in its raw orientation, not flipped
    assert report["scores"]["noise_rms"]["precision_at_k"] == 1.0
    assert mislabel_detection_report({**columns, "is_corrupted": np.zeros(3, bool)})["scores"] == {}


def test_detection_metrics_count_ties_half_and_check_their_input():
    # wrong labels score 1, 1; right ones 1, 0: of the 4 pairs 2 are ordered and 2 tied -> (2 + 2/2) / 4
    assert detection_metrics(np.array([1.0, 1.0, 1.0, 0.0]), np.array([1, 1, 0, 0]))["auroc"] == 0.75
    with pytest.raises(ValueError, match="both right and wrong"):
        detection_metrics(np.array([0.2, 0.4]), np.zeros(2, bool))
    with pytest.raises(ValueError, match="same length"):
        detection_metrics(np.array([0.2, 0.4, 0.1]), np.array([True, False]))


# -- export: atomic files --------------------------------------------------------------------------------------------
def test_write_is_atomic(tmp_path, monkeypatch):
    model, data = TinyClassifier(), make_data(n=10)
    noise = compute_label_noise(model, random_posterior(model), data, num_samples=2)
    out = tmp_path / "run"
    parquet, summary = write_label_noise(noise, out)
    before = open(parquet, "rb").read()

    def half_written(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(before[: len(before) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(datasets.Dataset, "to_parquet", half_written)
    with pytest.raises(OSError, match="disk full"):
        write_label_noise(noise, out)
    assert open(parquet, "rb").read() == before  # the previous file is untouched
    assert sorted(os.listdir(out)) == ["label_noise.parquet", "label_noise_summary.json"]  # no temp file left
    with pytest.raises(OSError):
        write_label_noise(noise, tmp_path / "fresh")
    assert os.listdir(tmp_path / "fresh") == []  # nothing half-written under the final name


def test_summary_splits_by_corruption():
    model, data = TinyClassifier(), make_data(n=40)
    noise = compute_label_noise(model, random_posterior(model), data, num_samples=4)
    summary = summarize_label_noise(noise)
    corrupted = np.asarray(data["is_corrupted"])
    assert summary["num_examples"] == 40 and summary["num_classes"] == 3
    assert summary["num_corrupted"] == corrupted.sum()
    assert set(summary["all"]) == {"noise_at_label", "noise_l1", "noise_l2", "noise_rms", "confidence",
                                   "mean_confidence"}
    assert set(summary["detection"]["scores"]) == {
        "one_minus_confidence", "one_minus_mean_confidence", "noise_at_label", "noise_l1", "noise_rms"}
    # every statistic recomputed from the per-example table, for all rows and for each side of the corruption split
    noise = noise.with_format("numpy")[:]
    for part, mask in (("all", np.ones(40, bool)), ("clean", ~corrupted), ("corrupted", corrupted)):
        for name in ("noise_at_label", "noise_l1", "noise_l2", "noise_rms", "confidence", "mean_confidence"):
            values = np.sort(noise[name][mask].astype(np.float64))
            stats = summary[part][name]
            assert stats["mean"] == pytest.approx(values.mean()) and stats["std"] == pytest.approx(values.std())
            assert stats["q00"] == pytest.approx(values[0]) and stats["q100"] == pytest.approx(values[-1])
            # the median of an even count is the mean of the two middle values
            middle = len(values) // 2
            median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
            assert stats["q50"] == pytest.approx(median)
    # AUROC = P(score of a wrong label > score of a right one), ties counting one half (Mann-Whitney)
    for score, values in (("one_minus_confidence", 1 - noise["confidence"]), ("noise_l1", noise["noise_l1"])):
        wrong, right = values[corrupted][:, None], values[~corrupted][None, :]
        auroc = (wrong > right).mean() + 0.5 * (wrong == right).mean()
        assert summary["detection"]["scores"][score]["auroc"] == pytest.approx(auroc)
        top = np.argsort(-values, kind="stable")[: corrupted.sum()]
        assert summary["detection"]["scores"][score]["precision_at_k"] == pytest.approx(corrupted[top].mean())


@pytest.mark.parametrize("v, logits, rho_sign", [
    (1.0, np.linspace(0.05, 1.2, 200), -1),  # every example below Eq. 12's peak (m* = 1.53): noise falls with ambiguity
    (1.0, np.linspace(2.0, 6.0, 200), 1),  # every example above it: noise grows with ambiguity
    (0.25, np.linspace(0.05, 6.0, 400), 1),  # most above it (m* = 1.38)
])
def test_adaptivity_finds_where_the_expected_noise_peaks(v, logits, rho_sign):
    # 2 classes, p̄ = σ(m), ‖ε̄‖₁ = 2|ε(m, v)| by the closed form of Eq. 12: the peak and the correlation's sign follow
    mean_probs = np.stack([expit(-logits), expit(logits)], 1)
    l1 = 2 * np.abs(logistic_label_noise(logits, v))
    table = datasets.Dataset.from_dict({"noise_l1": l1, "mean_probs": mean_probs})
    got = noise_adaptivity(table)
    confidence = expit(logits)
    peak_m, _ = logistic_label_noise_peak(v)
    expected_peak = expit(np.clip(peak_m, logits.min(), logits.max()))  # the peak, or the edge nearest to it
    decile_width = max(np.ptp(b) for b in np.array_split(np.sort(confidence), 10))  # the peak is a decile's median
    assert got["noise_l1_peak_confidence"] == pytest.approx(expected_peak, abs=decile_width)
    assert got["below_noise_peak_share"] == pytest.approx((confidence < got["noise_l1_peak_confidence"]).mean())
    assert got["mean_confidence_median"] == pytest.approx(np.median(confidence))
    assert np.sign(got["noise_l1_entropy_spearman"]) == rho_sign


# -- trainer end to end -------------------------------------------------------------------------------------------
def make_trainer(tmp_path, data, callbacks=None, **overrides):
    args = VariationalTrainingArguments(
        output_dir=str(tmp_path), num_train_epochs=2, per_device_train_batch_size=16, per_device_eval_batch_size=10,
        learning_rate=0.05, method_config={"ess": len(data), "beta2": 0.99}, report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True, eval_mc_samples=4, seed=0, **overrides,
    )
    torch.manual_seed(0)
    return VariationalTrainer(TinyClassifier(), args, train_dataset=data, callbacks=callbacks)


def test_trainer_callback_exports_parquet(tmp_path):
    data = make_data()
    callback = LabelNoiseCallback(num_samples=8, every_n_epochs=1)
    trainer = make_trainer(tmp_path, data, callbacks=[callback])
    assert callback._measure == trainer.label_noise  # connected to this trainer's posterior and batches
    trainer.train()

    files = set(os.listdir(tmp_path))
    assert {"label_noise.parquet", "label_noise_summary.json", "label_noise_epoch1.parquet"} <= files
    assert "label_noise_epoch2.parquet" not in files  # the last epoch is the train-end export
    loaded = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "label_noise.parquet"), split="train", cache_dir=str(tmp_path / "cache")
    )
    expected = {"example_index", "label", "confidence", "mean_confidence", "noise_at_label", "noise_l1", "noise_l2",
                "noise_rms", "mean_probs", "predictive_probs", "noise", "smoothed_label", "clean_label", "is_corrupted"}
    assert set(loaded.column_names) == expected
    assert loaded.num_rows == len(data)
    table = loaded.with_format("numpy")[:]
    np.testing.assert_array_equal(table["example_index"], np.arange(len(data)))
    np.testing.assert_array_equal(table["label"], data["label"])
    np.testing.assert_array_equal(table["clean_label"], data["clean_label"])
    np.testing.assert_array_equal(table["is_corrupted"], data["is_corrupted"])
    # row i is example i: the posterior-mean prediction recomputed row by row
    model = trainer.model.eval()
    with torch.no_grad():
        direct = model.net(torch.as_tensor(data.with_format("numpy")[:]["features"])).softmax(-1).numpy()
    np.testing.assert_allclose(table["mean_probs"], direct, atol=1e-5)
    assert np.abs(table["noise"]).max() > 0  # the learned posterior is not a point mass
    # the file against the posterior written out here from IVON's state: draw s moves weight i to m + σ⊙e with
    # σ = 1/sqrt(ess·(h + δ)) (Yang et al. 2025, Alg. 1) and e ~ N(0, I) from the seed
    # derive_seed(derive_seed(eval_seed, k), i), draws 2k and 2k + 1 moving it by +σ⊙e and −σ⊙e (an antithetic pair)
    names = {id(p): name for name, p in model.named_parameters()}
    weights, stds = [], []
    for group in trainer.ivon.param_groups:
        for p in group["params"]:
            weights.append(names[id(p)])
            stds.append(1.0 / torch.sqrt(group["ess"] * (trainer.ivon.state[p]["hess"] + group["weight_decay"])))
    x = torch.as_tensor(data.with_format("numpy")[:]["features"])
    draws = []
    for s in range(8):
        sample = copy.deepcopy(model)
        params = dict(sample.named_parameters())
        with torch.no_grad():
            for i, (name, std) in enumerate(zip(weights, stds)):
                gen = torch.Generator().manual_seed(derive_seed(derive_seed(trainer.args.eval_seed, s // 2), i))
                params[name].add_((-1.0 if s % 2 else 1.0) * torch.randn(params[name].shape, generator=gen) * std)
            draws.append(sample.net(x).softmax(-1))
    predictive = torch.stack(draws).mean(0).numpy()
    np.testing.assert_allclose(table["predictive_probs"], predictive, atol=1e-5)
    np.testing.assert_allclose(table["noise"], direct - predictive, atol=1e-5)  # ε̄ = p̄ − P̂ (Eq. 15)
    np.testing.assert_allclose(table["confidence"], predictive[np.arange(len(data)), data["label"]], atol=1e-5)

    summary = json.loads((tmp_path / "label_noise_summary.json").read_text())
    assert summary["num_examples"] == len(data) and summary["num_samples"] == 8
    assert summary["global_step"] == trainer.state.global_step
    assert summary["num_corrupted"] == int(np.sum(data["is_corrupted"]))
    assert "auroc" in summary["detection"]["scores"]["one_minus_confidence"]


def test_add_callback_connects_and_a_plain_trainer_is_refused(tmp_path):
    data = make_data(n=16)
    trainer = make_trainer(tmp_path / "variational", data)
    callback = LabelNoiseCallback(num_samples=2)
    trainer.add_callback(callback)  # added after construction: bound all the same
    trainer.add_callback(LabelNoiseCallback)  # a class: Trainer instantiates it, and it is bound too
    assert callback._measure == trainer.label_noise == trainer.callback_handler.callbacks[-1]._measure
    trainer.train()
    assert (tmp_path / "variational" / "label_noise.parquet").is_file()

    plain = transformers.Trainer(TinyClassifier(), trainer.args, train_dataset=data,
                                 callbacks=[LabelNoiseCallback(num_samples=2)])
    with pytest.raises(RuntimeError, match="not connected to a posterior"):  # nothing to measure: fail before training
        plain.train()


@pytest.mark.slow
def test_ddp_export_is_one_file_in_dataset_order(tmp_path):
    run_script(WORKERS / "label_noise_ddp_worker.py", str(tmp_path / "out"), timeout=180)
    ddp = datasets.Dataset.from_parquet(str(tmp_path / "out" / "label_noise.parquet")).with_format("numpy")[:]
    single = datasets.Dataset.from_parquet(str(tmp_path / "out" / "single_process.parquet")).with_format("numpy")[:]
    assert len(ddp["example_index"]) == 23
    np.testing.assert_array_equal(ddp["example_index"], np.arange(23))
    assert np.abs(single["noise"]).max() > 0
    for name in ("label", "clean_label", "mean_probs", "noise", "noise_rms", "confidence"):
        np.testing.assert_allclose(ddp[name], single[name], atol=1e-6, err_msg=name)
