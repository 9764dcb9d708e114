"""The model card: JSON that parses, Hub ids only in `datasets:`, a license, both predictions with the better named, and
every line true for the method that wrote it (ERM: no posterior; IVON at τ = 0: the mean, and why)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import LabelNoiseCallback, PosteriorTemperature, VariationalTrainer
from varsmooth.corruption import corrupt_labels
from varsmooth.hub import RunRecord, build_model_card
from varsmooth.hub.card import is_hub_dataset_id


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("card")
    train = corrupt_labels(digits_dataset(160).with_format(None), "symmetric", 0.4, seed=0).with_format("torch")
    # τ fixed at 1: the card shows both predictions whatever the selection would choose (τ = 0 is tested apart)
    args = make_args(out, max_steps=6, eval_mc_samples=4, beta2=0.99, posterior_temperature=1.0,
                     logging_strategy="steps", logging_steps=4)  # the last log is not the end of training
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=train,
                                 eval_dataset=digits_dataset(64, seed=1), callbacks=[LabelNoiseCallback(num_samples=4)])
    trainer.train()
    trainer.evaluate()
    return trainer, out


def _card(trainer, **kwargs):
    return build_model_card(trainer.run_record(**kwargs), trainer.model, trainer.args.output_dir)


def _card_with_summary(trainer, folder, summary) -> str:
    """The card's text for the run's files with `summary` as its label_noise_summary.json (written into `folder`)."""
    (folder / "label_noise_summary.json").write_text(json.dumps(summary))
    original = trainer.args.output_dir
    trainer.args.output_dir = str(folder)
    try:
        return _parts(_card(trainer))[0]
    finally:
        trainer.args.output_dir = original


def _parts(card):
    text = str(card)
    meta = yaml.safe_load(text.split("---")[1])
    return text, meta


def test_every_json_block_parses_and_keeps_the_detection_section(run):
    trainer, out = run
    summary_text = (out / "label_noise_summary.json").read_text()
    assert len(json.dumps(json.loads(summary_text), indent=2)) > 3000  # longer than the old cut
    text, _ = _parts(_card(trainer))
    blocks = re.findall(r"```json\n(.*?)\n```", text, flags=re.S)
    assert len(blocks) == 2
    parsed = [_strict_json(block) for block in blocks]
    summary = json.loads(summary_text)
    assert parsed[0] == summary["detection"] and parsed[1] == summary  # whole, not a prefix
    assert "auroc" in parsed[0]["scores"]["one_minus_confidence"]


def test_non_finite_summary_values_become_null(run, tmp_path):
    trainer, out = run
    summary = json.loads((out / "label_noise_summary.json").read_text())
    summary["detection"]["scores"]["one_minus_confidence"]["auroc"] = float("nan")  # e.g. no corrupted example
    text = _card_with_summary(trainer, tmp_path, summary)
    detection = _strict_json(re.findall(r"```json\n(.*?)\n```", text, flags=re.S)[0])
    assert detection["scores"]["one_minus_confidence"]["auroc"] is None


def test_only_hub_dataset_ids_go_into_the_metadata(run, tmp_path):
    trainer, _ = run
    folder = tmp_path / "my_digits"
    folder.mkdir()
    for local in (str(folder), "/tmp/does/not/exist", "./data"):
        text, meta = _parts(_card(trainer, dataset=local))
        assert "datasets" not in meta, local
        assert local not in text, local  # the path of the training machine is not published
    assert "`my_digits` (local data)" in _parts(_card(trainer, dataset=str(folder)))[0]
    text, meta = _parts(_card(trainer, dataset="user/noisy-digits"))
    assert meta["datasets"] == ["user/noisy-digits"]
    assert "https://huggingface.co/datasets/user/noisy-digits" in text
    # dataset_tags (transformers' name for the metadata ids) win over the display name, and are filtered too
    _, meta = _parts(_card(trainer, dataset=str(folder), dataset_tags=["user/noisy-digits", str(folder)]))
    assert meta["datasets"] == ["user/noisy-digits"]


def test_hub_dataset_id_rule():
    assert is_hub_dataset_id("cifar10") and is_hub_dataset_id("user/name")
    assert not any(is_hub_dataset_id(p) for p in ("/tmp/x", "./data", "a/b/c", "~/x", "two words", "."))


def test_license_defaults_to_unknown_and_follows_the_user(run):
    trainer, _ = run
    text, meta = _parts(_card(trainer))
    assert meta["license"] == "unknown" and "pass `license=`" in text
    text, meta = _parts(_card(trainer, license="apache-2.0"))
    assert meta["license"] == "apache-2.0" and "pass `license=`" not in text


def _table_nll(text: str) -> tuple[float, float]:
    (bma, mean), = re.findall(r"\| Negative log-likelihood \| ([\d.]+) \| ([\d.]+) \|", text)
    return float(bma), float(mean)


@pytest.mark.parametrize("nll,mean_nll", [(0.91, 0.57), (0.52, 0.60), (None, None)])
def test_both_predictions_and_the_better_one_named(run, nll, mean_nll):
    trainer, _ = run
    entry = next(e for e in reversed(trainer.state.log_history) if "eval_nll" in e)
    if nll is not None:  # the default run (BMA NLL 0.91 vs 0.57 at the mean), and the other way round
        trainer.state.log_history.append({**entry, "eval_nll": nll, "eval_mean_nll": mean_nll})
    try:
        text, meta = _parts(_card(trainer))
    finally:
        if nll is not None:
            trainer.state.log_history.pop()
    bma, mean = _table_nll(text)
    if bma == mean:  # e.g. a chosen posterior temperature near 0: the sentence must not name a winner the table lacks
        assert f"both predictions have the same negative log-likelihood ({bma:.4f})" in text
        return
    (better, first, second), = re.findall(
        r"the \*\*(posterior-averaged|posterior-mean)\*\* prediction is the better one "
        r"by negative log-likelihood \(lower is better\): ([\d.]+) vs ([\d.]+)", text)
    assert better == ("posterior-averaged" if bma < mean else "posterior-mean")
    assert (float(first), float(second)) == ((bma, mean) if bma < mean else (mean, bma))
    assert float(first) < float(second)
    # the metadata lists both predictions, the better one first
    names = [m["name"] for r in meta["model-index"][0]["results"] for m in r["metrics"] if m["type"] == "nll"]
    assert names == (["Negative log-likelihood (posterior-averaged)",
                      "Negative log-likelihood (posterior mean)"][::1 if bma < mean else -1])


def test_the_card_lists_only_the_pictures_the_save_recorded(run):
    trainer, out = run
    trainer.save_model()
    # a stray file beside the model is neither pushed nor described
    (out / "someone_elses_plot.png").write_bytes(b"\x89PNG")
    text, _ = _parts(_card(trainer))
    assert "someone_elses_plot.png" not in text
    recorded = json.loads((out / "varsmooth_manifest.json").read_text())["files"]
    # still described
    assert "label_noise.parquet" in recorded and "per-example label noise of the training set" in text


def test_the_card_names_the_task_and_auto_class_the_model_reloads_with(tmp_path):
    """One rule tells image from text classifiers: the card's pipeline task and Auto class are those
    `VariationalModel.from_pretrained` loads the saved model with, also for a class whose name does not say it."""
    from transformers import ResNetConfig, ResNetForImageClassification

    from varsmooth import VariationalModel

    class Digits(ResNetForImageClassification):  # an image classifier by its configuration only
        pass

    model = Digits(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8], depths=[1], num_labels=3))
    record = RunRecord(method="erm", learns_posterior=False, hyperparameters={}, repo_id="user/digits",
                       model_name="digits")
    text, meta = _parts(build_model_card(record, model, tmp_path))
    assert meta["pipeline_tag"] == "image-classification"
    assert "AutoModelForImageClassification.from_pretrained" in text
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="No posterior.safetensors"):
        reloaded = VariationalModel.from_pretrained(tmp_path)
    assert isinstance(reloaded.model, ResNetForImageClassification)


def test_the_card_reports_max_steps_and_what_the_posterior_learned(run):
    trainer, out = run
    text, _ = _parts(_card(trainer))
    assert "| max_steps | 6 |" in text and "| epochs |" not in text  # --max_steps overrides the epochs
    # IVON's settings under the names the arguments (and the CLI) take: weight_decay is refused with IVON
    assert (f"| prior_precision | {trainer.args.method_config.prior_precision} |" in text
            and "| weight_decay |" not in text)
    assert f"| learning_rate | {trainer.args.learning_rate} |" in text and "| lr |" not in text
    # the Hessian's movement and σ of the saved posterior, at the end of training (step 6; the last log was at step 4)
    from varsmooth.posterior.diagnostics import hessian_change

    assert any(e.get("step") == 4 and "hess_median" in e for e in trainer.state.log_history)
    change = hessian_change(trainer.ivon)
    assert "At step 6 of training, IVON's Hessian" in text
    assert f"The median relative change |h − h0|/h0 over the weights is {change:.1%}" in text
    sigma = trainer.hessian_summary()["posterior_std_median"]
    assert f"σ = 1/sqrt(ess·(h + δ)) had median {sigma:.4g}" in text
    args = trainer.args
    sigma0 = 1 / (trainer.ivon.param_groups[0]['ess']
                  * (args.method_config.hess_init + args.method_config.prior_precision)) ** 0.5
    assert f"σ0 = {sigma0:.4g}" in text
    assert ("hardly moved" in text) == (change < 0.1)
    summary = json.loads((out / "label_noise_summary.json").read_text())
    assert f"|ε̄|₁ has mean {summary['all']['noise_l1']['mean']:.3g}" in text
    assert "Predictions average the softmax over 4 samples of that posterior" in text
    assert "whose mean is the model's weights (`model.safetensors`)" in text  # a full model's (an adapter's: test_lora)


@pytest.mark.parametrize("rho, says",
                         [(0.3, "it is larger for ambiguous examples"), (0.07, "it is *not* clearly larger"),
                                       (-0.6, "it is *not* larger")])
def test_the_card_says_whether_this_runs_label_noise_is_larger_for_ambiguous_examples(run, tmp_path, rho, says):
    trainer, out = run
    summary = json.loads((out / "label_noise_summary.json").read_text())
    adaptivity = summary["adaptivity"]  # measured by the export
    assert set(adaptivity) == {"noise_l1_q90_over_q10", "noise_l1_entropy_spearman", "mean_confidence_median",
                               "noise_l1_peak_confidence", "below_noise_peak_share"}
    adaptivity["noise_l1_entropy_spearman"] = rho
    text = _card_with_summary(trainer, tmp_path, summary)
    assert f"On this run {says}" in text and f"Spearman ρ = {rho:.2f}" in text
    # where it is not, the card says where the noise peaks and how many examples sit on its ambiguous side
    why = (f"largest where the posterior mean predicts with confidence ≈ {adaptivity['noise_l1_peak_confidence']:.2f}"
           f" and smaller for less confident predictions")
    assert (why in text) == (rho < 0.3)
    assert ((f"{adaptivity['below_noise_peak_share']:.0%} of the examples are predicted less confidently" in text)
            == (rho < 0.3))
    assert ("the card says larger from ρ = 0.3 on" in text) == (0 < rho < 0.3)


def test_a_card_at_the_posterior_mean_says_so_and_why(run):
    trainer, _ = run
    report = {"temperature": 0.0, "nll": {"0": 0.512, "0.5": 0.534, "1": 0.601}, "num_samples": 4,
              "criterion": "noise-corrected validation NLL"}
    saved = trainer.posterior_temperature, trainer.args.posterior_temperature
    trainer.prepare_predictor(PosteriorTemperature.chosen(report))
    trainer.args.posterior_temperature = None
    try:
        text, meta = _parts(_card(trainer))
        assert ("Predictions are made at the posterior mean, without averaging: the posterior temperature τ = 0 was "
                "chosen" in text)
        assert ("noise-corrected validation NLL on the validation split (0.5120, against 0.5340 at τ = 0.5, 0.6010 at "
                "τ = 1)" in text)
        assert "because the posterior mean scored best by" in text and "tie with it" not in text
        # a tie the validation split cannot resolve is said as a tie, the best named whichever it is
        for nll, verdict in (({"0": 0.512, "0.5": 0.514, "1": 0.601}, "scored best (τ = 0.5 tie with it"),
                             ({"0": 0.514, "0.5": 0.512, "1": 0.601}, "tied with the best (τ = 0.5 tie with it")):
            trainer.prepare_predictor(PosteriorTemperature.chosen({**report, "nll": nll, "tied": [0.0, 0.5]}))
            assert verdict in _parts(_card(trainer))[0]
        assert "posterior-averaged" not in text and "average the softmax" not in text
        names = {m["name"] for r in meta["model-index"][0]["results"] for m in r["metrics"]}
        assert "Negative log-likelihood (posterior mean)" in names and not any("averaged" in n for n in names)
        # no draws asked for at all
        trainer.args.eval_mc_samples = 0
        trainer.prepare_predictor(PosteriorTemperature(1.0))
        text, _ = _parts(_card(trainer))
        assert "without averaging: `eval_mc_samples=0` was set" in text and "posterior-averaged" not in text
    finally:
        trainer.args.posterior_temperature, trainer.args.eval_mc_samples = saved[1], 4
        trainer.prepare_predictor(saved[0])


def test_a_baseline_card_describes_the_baseline(tmp_path):
    """ERM learns no posterior: no posterior column, file or sentence; its learning rate is in the table."""
    train = corrupt_labels(digits_dataset(96).with_format(None), "symmetric", 0.4, seed=0).with_format("torch")
    args = make_args(tmp_path, method="erm", learning_rate=1e-3, num_train_epochs=2)
    trainer = VariationalTrainer(model=TinyClassifier(), args=args, train_dataset=train,
                                 eval_dataset=digits_dataset(32, seed=1))
    trainer.train()
    trainer.save_model()
    trainer.evaluate()
    text, meta = _parts(_card(trainer))
    for claim in ("posterior-averaged", "posterior mean", "posterior.safetensors", "σ", "VariationalModel"):
        assert claim not in text, claim
    assert "It learns no posterior over the weights" in text
    assert "with the `erm` method (Empirical risk minimisation" in text and "made at the trained weights" in text
    assert "| learning_rate | 0.001 |" in text and "| epochs | 2 |" in text
    assert "| metric | trained weights |" in text
    names = {m["name"] for r in meta["model-index"][0]["results"] for m in r["metrics"]}
    assert "Accuracy" in names and "Negative log-likelihood" in names
