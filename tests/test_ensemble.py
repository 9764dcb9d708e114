"""Deep ensembles (Lakshminarayanan et al. 2017): N models predicting as the average of their predictive
distributions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from helpers import TinyClassifier, make_args
from varsmooth import DeepEnsemble, TemperatureScaling, VariationalModel, VariationalTrainer, classification_metrics
from varsmooth.outputs import entropy
from varsmooth.posterior import DiagonalGaussianPosterior, derive_seed
from varsmooth.prediction.ensemble import ENSEMBLE_CONFIG_FILE
from varsmooth.temperature_scaling import TEMPERATURE_SCALING_FILE

VOCAB, LENGTH, CLASSES = 40, 8, 3


def tiny_bert(seed: int, num_labels: int = CLASSES, id2label=None) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=num_labels,
                        id2label=id2label or {i: f"class_{i}" for i in range(num_labels)})
    return BertForSequenceClassification(config).eval()


def tiny_tokenizer(folder) -> BertTokenizer:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, VOCAB)]) + "\n")
    return BertTokenizer(path, do_lower_case=True)


def with_posterior(network: torch.nn.Module, scale: float, num_samples: int) -> VariationalModel:
    gen = torch.Generator().manual_seed(7)
    std = {n: scale * (0.5 + torch.rand(p.shape, generator=gen)) for n, p in network.named_parameters()}
    return VariationalModel(network, DiagonalGaussianPosterior(network, std, {"eval_mc_samples": num_samples}),
                            num_samples=num_samples, seed=3)


def point(network: torch.nn.Module) -> VariationalModel:
    return VariationalModel(network, DiagonalGaussianPosterior.point_mass(network), num_samples=0)


def _hand_draws(network, std, x, num_samples, seed):
    """The softmax of each posterior draw m ± σ⊙e (antithetic pairs), e seeded as the posterior seeds it."""
    mean = {n: p.detach().clone() for n, p in network.named_parameters()}
    draws = []
    with torch.no_grad():
        for s in range(num_samples):
            sign = -1.0 if s % 2 else 1.0
            for index, (name, p) in enumerate(network.named_parameters()):
                gen = torch.Generator().manual_seed(derive_seed(derive_seed(seed, s // 2), index))
                p.data = mean[name] + sign * torch.randn(p.shape, generator=gen) * std[name]
            draws.append(network(pixel_values=x).logits.softmax(-1))
        for name, p in network.named_parameters():
            p.data = mean[name]
    return draws


def test_a_one_member_ensemble_is_the_member():
    torch.manual_seed(0)
    member = with_posterior(TinyClassifier().eval(), 0.2, 5)
    x = torch.rand(9, 8, 8)
    expected, got = member(pixel_values=x), DeepEnsemble([member])(pixel_values=x,
                                                                   labels=torch.zeros(9, dtype=torch.long))
    for field in ("logits", "probs", "entropy", "mutual_information", "mean_probs"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=0, atol=1e-6)
    assert expected.mutual_information.min() > 0  # a member with draws, so passing MI through is tested


def test_the_ensemble_averages_the_members_predictions_exactly():
    networks = []
    for seed in range(3):
        torch.manual_seed(seed)
        networks.append(TinyClassifier().eval())
    bayesian = with_posterior(networks[2], 0.2, 4)
    ensemble = DeepEnsemble([point(networks[0]), point(networks[1]), bayesian])
    x = torch.rand(11, 8, 8)
    out = ensemble(pixel_values=x)
    with torch.no_grad():
        singles = [networks[0](pixel_values=x).logits.softmax(-1), networks[1](pixel_values=x).logits.softmax(-1)]
    draws = _hand_draws(networks[2], bayesian.posterior.std, x, 4, 3)
    member_probs = singles + [torch.stack(draws).mean(0)]
    expected = torch.stack(member_probs).mean(0)
    torch.testing.assert_close(out.probs, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits.exp(), expected, rtol=1e-5, atol=1e-6)
    # every single model's entropy: one per point member, the mean over its draws for the Bayesian one
    single_entropy = (entropy(singles[0]) + entropy(singles[1]) + torch.stack([entropy(d) for d in draws]).mean(0)) / 3
    torch.testing.assert_close(out.entropy, entropy(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.mutual_information, entropy(expected) - single_entropy, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        mean_expected = torch.stack([n(pixel_values=x).logits.softmax(-1) for n in networks]).mean(0)
    torch.testing.assert_close(out.mean_probs, mean_expected, rtol=1e-5, atol=1e-6)


def test_mismatched_members_are_refused():
    with pytest.raises(ValueError, match="member 1 has num_labels=4 but member 0 has num_labels=3"):
        DeepEnsemble([point(tiny_bert(0)), point(tiny_bert(1, num_labels=4))])
    swapped = {0: "class_1", 1: "class_0", 2: "class_2"}
    with pytest.raises(ValueError, match="member 1 has id2label=.*same labels in the same order"):
        DeepEnsemble([point(tiny_bert(0)), point(tiny_bert(1, id2label=swapped))])
    # without configs the outputs tell
    ensemble = DeepEnsemble([point(TinyClassifier(num_classes=10)), point(TinyClassifier(num_classes=5))])
    with pytest.raises(ValueError, match="different shapes"):
        ensemble(pixel_values=torch.rand(2, 8, 8))
    with pytest.raises(ValueError, match="at least one member"):
        DeepEnsemble([])
    with pytest.raises(TypeError, match="VariationalModel"):
        DeepEnsemble([TinyClassifier()])


SENTENCES = ["w5 w6 w7", "w9 w9 w12 w30", "w33", "w20 w21 w22 w23 w24", "w7 w8"]

LOAD_AND_PREDICT = """
import json, sys, torch
from varsmooth import DeepEnsemble, VariationalModel, pipeline
from transformers import BertTokenizer
folder = sys.argv[1]
model = VariationalModel.from_pretrained(folder)
assert isinstance(model, DeepEnsemble), type(model)
tokens = BertTokenizer.from_pretrained(folder)(json.loads(sys.argv[2]), padding=True, return_tensors="pt")
with torch.no_grad():
    out = model(**tokens)
classify = pipeline("text-classification", model=folder)
piped = [classify(s, top_k=None, return_uncertainty=True) for s in json.loads(sys.argv[2])]
print(json.dumps({"probs": out.probs.tolist(), "mutual_information": out.mutual_information.tolist(), "piped": piped}))
"""


@pytest.fixture()
def saved_ensemble(tmp_path):
    members = [with_posterior(tiny_bert(0), 0.05, 3), point(tiny_bert(1)), point(tiny_bert(2))]
    ensemble = DeepEnsemble(members, temperature_scaling=TemperatureScaling(1.7, prediction={"kind": "ensemble"}))
    folder = tmp_path / "ensemble"
    ensemble.save_pretrained(folder)
    tokenizer = tiny_tokenizer(tmp_path / "vocab")
    tokenizer.save_pretrained(folder)
    return ensemble, tokenizer, folder


@pytest.mark.slow
def test_save_then_load_in_a_new_process_predicts_the_same(saved_ensemble):
    ensemble, tokenizer, folder = saved_ensemble
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["member-0", "member-1", "member-2"]
    assert (folder / ENSEMBLE_CONFIG_FILE).is_file() and (folder / TEMPERATURE_SCALING_FILE).is_file()
    tokens = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = ensemble(**tokens)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, str(folder), json.dumps(SENTENCES)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(loaded["probs"], expected.probs.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded["mutual_information"], expected.mutual_information.numpy(), rtol=1e-4, atol=1e-6)
    for row, piped in enumerate(loaded["piped"]):  # one sentence at a time, no padding: the same prediction
        scores = {p["label"]: p["score"] for p in piped["predictions"]}
        np.testing.assert_allclose([scores[f"class_{k}"] for k in range(CLASSES)], expected.probs[row].numpy(),
                                   rtol=1e-4, atol=1e-6)
    # the temperature was applied: the uncalibrated average differs
    raw = DeepEnsemble.from_pretrained(folder, temperature_scaling=False)
    with torch.no_grad():
        assert not torch.allclose(raw(**tokens).probs, expected.probs, atol=1e-3)


def test_a_changed_member_or_unfinished_save_is_refused(saved_ensemble):
    _, _, folder = saved_ensemble
    point(tiny_bert(5)).save_pretrained(folder / "member-1")  # another model saved over a member
    with pytest.raises(ValueError, match="member-1 holds other weights than the member saved with the ensemble"):
        VariationalModel.from_pretrained(folder)
    import shutil

    shutil.rmtree(folder / "member-1")
    with pytest.raises(ValueError, match="member-1 is missing"):
        VariationalModel.from_pretrained(folder)
    os.remove(folder / "varsmooth_manifest.json")
    with pytest.raises(ValueError, match="save did not finish"):
        VariationalModel.from_pretrained(folder)


def test_a_smaller_ensemble_saved_over_a_larger_one_removes_the_extra_members(saved_ensemble):
    ensemble, _, folder = saved_ensemble
    DeepEnsemble(list(ensemble.members)[:2]).save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["member-0", "member-1"]
    assert not (folder / TEMPERATURE_SCALING_FILE).exists()  # the old temperature was for three members
    assert len(DeepEnsemble.from_pretrained(folder).members) == 2


def test_the_trainer_evaluates_an_ensemble_of_output_folders_and_fits_its_temperature(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path / "vocab")
    folders = []
    for seed in range(2):
        folder = tmp_path / f"run-{seed}"
        tiny_bert(seed).save_pretrained(folder)
        folders.append(folder)
    with pytest.warns(UserWarning, match="No posterior.safetensors"):
        ensemble = DeepEnsemble.from_members(folders)
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(5, VOCAB, 6)) for _ in range(40)]
    encoded = tokenizer(texts, padding="max_length", max_length=10)
    val = datasets.Dataset.from_dict({"text": texts, **encoded, "label": rng.integers(0, CLASSES, 40).tolist()})
    args = make_args(tmp_path / "eval", method="erm", per_device_eval_batch_size=16)
    trainer = VariationalTrainer(model=ensemble, args=args, eval_dataset=val)
    metrics = trainer.evaluate()  # the "text" column is dropped by the members' signature, as for one model
    tokens = {k: torch.tensor(encoded[k]) for k in encoded}
    with torch.no_grad():
        expected = torch.stack([VariationalModel(m.model, m.posterior, 0)(**tokens).probs
                                for m in ensemble.members]).mean(0)
    reference = classification_metrics(expected.numpy(), np.asarray(val["label"]))
    for name in ("accuracy", "nll", "ece", "brier"):
        assert metrics[f"eval_{name}"] == pytest.approx(reference[name], rel=1e-5, abs=1e-7)
    scaling = trainer.fit_temperature_scaling()
    assert scaling.prediction["kind"] == "ensemble" and scaling.nll_calibrated <= scaling.nll_uncalibrated
    assert trainer.evaluate()["eval_nll"] == pytest.approx(scaling.nll_calibrated, rel=1e-5)
    ensemble.temperature_scaling = scaling
    with pytest.raises(ValueError, match="already applies a temperature"):
        trainer.fit_temperature_scaling()
    ensemble.save_pretrained(tmp_path / "saved")
    assert DeepEnsemble.from_pretrained(tmp_path / "saved").temperature_scaling == scaling
