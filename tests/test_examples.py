"""The example scripts as a new user runs them: `--help`, reproducible runs, resuming, the flags of Hugging Face's
example scripts (`--do_train/--do_eval`, `--train_dir`, `--*_column_name`, `--train_val_split`,
`--overwrite_output_dir`) and a 2-process CPU launch (gloo); and the image example's argument handling: the preset of a
pretrained model, config files, a from-scratch model's learning rate, logging steps (more of its training runs:
test_data.py, test_plots.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import PIL.Image
import pytest
import torch
import yaml
from safetensors.torch import load_file

from example_utils.data import train_eval_splits
from example_utils.models import create_image_classifier
from example_utils.script import checkpoint_to_resume
from helpers import WORKERS, load_example, make_args, run_script
from varsmooth.corruption import CorruptionArguments
from varsmooth.methods import METHODS, TrainingMethod
from varsmooth.presets import FINETUNE_PRESET, choose_preset

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
#: a few steps of the image example on 64 digits
TINY_IMAGE = ["--max_train_samples", "64", "--max_eval_samples", "32", "--per_device_train_batch_size", "16",
              "--eval_mc_samples", "2", "--label_noise_samples", "0", "--disable_tqdm", "true", "--use_cpu", "true"]
example = load_example("train_image_classification")


def _image(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples" / "train_image_classification.py"), *TINY_IMAGE,
                           *flags],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def _metric_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"eval_')]


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_every_example_prints_its_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                            env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--output_dir" in result.stdout
    assert "%%" not in result.stdout  # help texts with a percent sign are escaped for argparse, and printed once
    if script.name == "train_image_classification.py":
        assert "worse 40 %" in result.stdout


@pytest.mark.slow
def test_the_moons_example_runs_and_its_label_noise_peaks_at_the_boundary(tmp_path):
    """The script as its docstring runs it: IVON trains the MLP, and the exported |ε̄_y| is larger where the posterior
    mean is unsure (|p̄ − 0.5| < 0.2) than elsewhere, with both pictures written."""
    result = subprocess.run([sys.executable, str(REPO / "examples" / "moons.py"), "--output_dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{\n"):result.stdout.index("\n}") + 2])
    assert report["train_accuracy"] > 0.9 and report["num_near_boundary"] > 0
    assert report["noise_at_label_near_boundary"] > 1.5 * report["noise_at_label_far_from_boundary"] > 0
    assert (tmp_path / "moons_label_noise.png").is_file() and (tmp_path / "label_noise_vs_mean.png").is_file()


@pytest.mark.slow
def test_the_same_command_twice_gives_the_same_run(tmp_path):
    runs = [_image("--max_steps", "3", "--output_dir", str(tmp_path / name)) for name in ("a", "b")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (first,), (second,) = (_metric_lines(run.stdout) for run in runs)
    timing = ("_runtime", "_samples_per_second", "_steps_per_second")  # of the eval_* and test_* scores alike
    assert ({k: v for k, v in first.items() if not k.endswith(timing)}
            == {k: v for k, v in second.items() if not k.endswith(timing)})
    assert "test_accuracy" in first and "eval_accuracy" in first
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "40 % of the training labels" in runs[0].stderr  # the log's percent sign is not doubled


@pytest.mark.slow
def test_resume_from_checkpoint_continues_at_the_saved_step_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    flags = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--eval_strategy", "no",
             "--logging_strategy", "steps", "--logging_steps", "1"]
    whole = _image(*flags, "--output_dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed = _image(*flags, "--output_dir", str(tmp_path / "resumed"),
                     "--resume_from_checkpoint", str(tmp_path / "whole" / "checkpoint-3"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [line for line in resumed.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(losses) == 3  # steps 4-6 only: it did not restart at step 0
    state = json.loads((tmp_path / "resumed" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    for name in ("model.safetensors", "posterior.safetensors"):
        a, b = (load_file(tmp_path / run / name) for run in ("whole", "resumed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    (whole_metrics,), (resumed_metrics,) = _metric_lines(whole.stdout), _metric_lines(resumed.stdout)
    assert whole_metrics["eval_accuracy"] == resumed_metrics["eval_accuracy"]
    assert whole_metrics["eval_nll"] == resumed_metrics["eval_nll"]


@pytest.mark.slow
def test_last_checkpoint_is_found_and_a_used_output_dir_refused(tmp_path):
    args = make_args(tmp_path / "out")
    assert checkpoint_to_resume(args) is None  # no folder yet
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-10").mkdir()
    assert checkpoint_to_resume(args) == str(tmp_path / "out" / "checkpoint-10")
    args.overwrite_output_dir = True
    assert checkpoint_to_resume(args) is None
    args.resume_from_checkpoint = str(tmp_path / "out" / "checkpoint-7")  # a typo is an error, not a fresh start
    with pytest.raises(FileNotFoundError, match="checkpoint-7"):
        checkpoint_to_resume(args)
    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_text("an earlier run")
    with pytest.raises(ValueError, match="overwrite_output_dir"):
        checkpoint_to_resume(make_args(used))
    refused = _image("--max_steps", "1", "--output_dir", str(used))
    assert refused.returncode != 0 and "--overwrite_output_dir" in refused.stderr
    assert (used / "model.safetensors").read_text() == "an earlier run"


@pytest.mark.slow
def test_do_train_and_do_eval_choose_what_runs(tmp_path):
    evaluated = _image("--do_eval", "--output_dir", str(tmp_path / "eval"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "train_runtime" not in evaluated.stdout and len(_metric_lines(evaluated.stdout)) == 1
    assert not (tmp_path / "eval" / "model.safetensors").exists()
    trained = _image("--do_train", "--eval_strategy", "no", "--max_steps", "2", "--output_dir", str(tmp_path / "train"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "train_runtime" in trained.stdout and not _metric_lines(trained.stdout)
    assert ((tmp_path / "train" / "model.safetensors").is_file()
            and not (tmp_path / "train" / "eval_results.json").exists())


@pytest.mark.slow
def test_do_predict_logging_steps_and_tensorboard_as_in_hugging_faces_examples(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the `tensorboard` or `test` extra)")
    out = tmp_path / "out"
    # τ fixed at the learned posterior: the prediction averages draws, so the file has their mutual information
    result = _image("--max_steps", "4", "--logging_steps", "2", "--do_train", "--do_eval", "--do_predict",
                    "--report_to", "tensorboard", "--posterior_temperature", "1", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    # the explicit --logging_steps is honoured (the example's own default logs once an epoch: 4 steps here)
    assert len([line for line in result.stdout.splitlines() if line.startswith("{'loss'")]) == 2
    assert list(out.rglob("events.out.tfevents.*"))  # tensorboard got the logs
    lines = (out / "predict_results.txt").read_text().splitlines()
    header, rows = lines[0].split("\t"), [line.split("\t") for line in lines[1:]]
    assert header == ["index", "prediction", "label", "confidence", "entropy", "mutual_information"]
    (metrics,) = _metric_lines(result.stdout)
    assert len(rows) == 32  # --max_eval_samples of the test split
    assert metrics["test_accuracy"] == pytest.approx(np.mean([r[1] == r[2] for r in rows]), abs=1e-4)
    confidence, entropy = (np.array([float(r[i]) for r in rows]) for i in (3, 4))
    assert np.all(confidence >= 0.1 - 1e-6) and np.all((entropy >= 0) & (entropy <= np.log(10) + 1e-6))
    mutual_information = np.array([float(r[5]) for r in rows])
    assert (np.all((mutual_information >= -1e-6) & (mutual_information <= entropy + 1e-6))
            and mutual_information.max() > 0)


def test_predict_results_keep_the_mutual_information_column_without_draws(tmp_path):
    """A prediction without draws (here a method without a posterior) states the mutual information as n/a: the
    file's columns do not depend on τ or the method."""
    from example_utils.script import write_predictions
    from helpers import TinyClassifier, digits_dataset
    from varsmooth import VariationalTrainer

    trainer = VariationalTrainer(model=TinyClassifier(), args=make_args(tmp_path, method="erm"))
    test = digits_dataset(8)
    lines = Path(write_predictions(trainer, test, [int(y) for y in test["label"]],
                                   [str(i) for i in range(10)])).read_text().splitlines()
    assert lines[0].split("\t") == ["index", "prediction", "label", "confidence", "entropy", "mutual_information"]
    assert [line.split("\t")[5] for line in lines[1:]] == ["n/a"] * 8


def test_do_predict_is_refused_before_training_without_a_test_split_or_across_processes():
    from types import SimpleNamespace

    from example_utils.script import train_evaluate_and_share

    def train(**kwargs):
        pytest.fail("trained before refusing")

    trainer = SimpleNamespace(args=SimpleNamespace(do_predict=True, do_train=True, do_eval=True, world_size=1),
                              train=train)
    with pytest.raises(ValueError, match="has none"):
        train_evaluate_and_share(trainer, None, None, "data")
    trainer.args.world_size = 2  # each process would write its shard of the test split
    with pytest.raises(ValueError, match="single process"):
        train_evaluate_and_share(trainer, None, ["a test split"], "data")


@pytest.mark.slow
def test_push_to_hub_without_the_hub_says_what_failed_and_how_to_push_later(tmp_path):
    result = _image("--max_steps", "1", "--push_to_hub", "--output_dir", str(tmp_path / "out"))  # HF_HUB_OFFLINE=1
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: push_to_hub: could not create the Hub repository 'out'")
    assert "Hub is unreachable" in last and "token" in last and "huggingface_hub.upload_folder(" in last
    assert "shareable_files" in last


def test_noise_type_none_is_accepted_and_keeps_the_labels():
    example = load_example("train_image_classification")
    noise_args = example.parse_arguments(["--noise_type", "none", "--use_cpu", "true"])[2]
    assert noise_args.noise_type == "none"
    data = datasets.Dataset.from_dict({"label": [0, 1, 2, 0]})
    kept, report = noise_args.apply(data)
    assert report is None and kept["label"] == [0, 1, 2, 0]
    assert CorruptionArguments(noise_type="none").apply(data)[1] is None


def _image_folder(root: Path, per_class: int) -> None:
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            PIL.Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / name / f"{i}.png")


def test_image_folders_column_names_and_the_validation_split(tmp_path):
    example = load_example("train_image_classification")
    _image_folder(tmp_path / "train", 5)
    _image_folder(tmp_path / "val", 2)
    data_args = example.parse_arguments(["--train_dir", str(tmp_path / "train"), "--validation_dir",
                                         str(tmp_path / "val"), "--use_cpu", "true"])[1]
    data, embedded, _ = example.load_data(data_args, seed=0)
    assert not embedded and (len(data["train"]), len(data["validation"])) == (10, 4) and "test" not in data
    assert data["train"].features["label"].names == ["cat", "dog"]
    # an image folder with a validation/ sub-folder (HF's layout) is evaluated on it, not on a part of train
    (tmp_path / "both").mkdir()
    shutil.copytree(tmp_path / "train", tmp_path / "both" / "train")
    shutil.copytree(tmp_path / "val", tmp_path / "both" / "validation")
    data_args = example.parse_arguments(["--dataset_name", str(tmp_path / "both"), "--use_cpu", "true"])[1]
    data, _, _ = example.load_data(data_args, seed=0)
    assert (len(data["train"]), len(data["validation"])) == (10, 4)
    # the old flag names stay as aliases of HF's
    data_args = example.parse_arguments(["--image_column", "img", "--label_column", "y", "--use_cpu", "true"])[1]
    assert (data_args.image_column_name, data_args.label_column_name) == ("img", "y")
    data_args = example.parse_arguments(["--image_column_name", "img", "--train_val_split", "0.5", "--use_cpu",
                                         "true"])[1]
    assert data_args.image_column_name == "img" and data_args.train_val_split == 0.5


def test_train_eval_splits_follow_hf_conventions():
    labels = datasets.ClassLabel(names=["a", "b"])
    split = lambda n: datasets.Dataset.from_dict({"label": [i % 2 for i in range(n)]},  # noqa: E731
                                                 features=datasets.Features({"label": labels}))
    raw = datasets.DatasetDict(train=split(20), validation=split(6), test=split(8))
    both = train_eval_splits(raw)  # the dataset's validation split, as HF's examples evaluate; test scored apart
    assert (len(both["train"]), len(both["validation"]), len(both["test"])) == (20, 6, 8)
    chosen = train_eval_splits(raw, eval_split="test")  # the user's choice: then no separate test split
    assert len(chosen["validation"]) == 8 and "test" not in chosen
    # no validation split: it is held out of train, never taken from test (choices made on it would score themselves)
    held_out = train_eval_splits(datasets.DatasetDict(train=split(20), test=split(8)), train_val_split=0.25,
                                 stratify_by_column="label")
    assert (len(held_out["train"]), len(held_out["validation"]), len(held_out["test"])) == (15, 5, 8)
    assert sorted(held_out["validation"]["label"]) in ([0, 0, 1, 1, 1], [0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match="eval_split"):
        train_eval_splits(raw, eval_split="dev")
    with pytest.raises(ValueError, match="train_val_split"):
        train_eval_splits(datasets.DatasetDict(train=split(20)), train_val_split=0.0)


@pytest.mark.slow
def test_the_default_run_chooses_on_noisy_validation_and_scores_the_clean_test_split_apart(tmp_path):
    example = load_example("train_image_classification")
    data_args = example.parse_arguments(["--use_cpu", "true"])[1]
    data, embedded, _ = example.load_data(data_args, seed=0)
    assert embedded and set(data) == {"train", "validation", "test"}
    assert abs(len(data["validation"]) - 0.2 * (len(data["train"]) + len(data["validation"]))) <= 1  # --train_val_split
    # enough examples for the learned posterior to train (on 64 the default's σ stays at chance level)
    result = _image("--output_dir", str(tmp_path / "out"), "--max_train_samples", "400", "--num_train_epochs", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = _metric_lines(result.stdout)
    scores = {split: json.loads((tmp_path / "out" / f"{split}_results.json").read_text()) for split in ("eval", "test")}
    assert line["test_accuracy"] == pytest.approx(scores["test"]["test_accuracy"], abs=1e-4)  # printed to 4 decimals
    assert line["eval_accuracy"] == pytest.approx(scores["eval"]["eval_accuracy"], abs=1e-4)
    # the validation labels carry the training noise (40 %): its accuracy is far below the clean test split's
    assert line["eval_accuracy"] < line["test_accuracy"] - 0.1
    card = (tmp_path / "out" / "README.md").read_text()
    assert "On the test set" in card
    # the embedded digits are no Hub dataset: named in the text, not linked from the `datasets:` metadata
    assert "datasets" not in yaml.safe_load(card.split("---")[1]) and "scikit-learn's 8x8 digits" in card
    # τ is scored against the clean labels through the injected noise's transition matrix (forward correction)
    assert "noise-corrected validation NLL" in card


def test_text_example_column_names_files_and_train_val_split(tmp_path):
    example = load_example("train_text_classification")
    from transformers import HfArgumentParser

    rows = "sentence,y\n" + "".join(f"{'good' if i % 2 else 'bad'} film {i},{'pos' if i % 2 else 'neg'}\n"
                                    for i in range(20))
    (tmp_path / "train.csv").write_text(rows)
    (tmp_path / "dev.csv").write_text(rows[: rows.index("film 6")].rsplit("\n", 1)[0] + "\n")
    parser = HfArgumentParser(example.DataArguments)
    (data_args,) = parser.parse_args_into_dataclasses(
        ["--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "dev.csv"),
         "--text_column_name", "sentence", "--label_column", "y"])
    data = example.load_data(data_args, seed=0)
    assert (len(data["train"]), len(data["validation"])) == (20, 6) and "test" not in data
    assert data["train"].features["y"].names == ["neg", "pos"]
    # --test_file is a test split of its own (scored once, as test_*), not another name for the validation file
    (data_args,) = parser.parse_args_into_dataclasses(
        ["--train_file", str(tmp_path / "train.csv"), "--test_file", str(tmp_path / "dev.csv"),
         "--text_column_name", "sentence", "--label_column", "y"])
    assert data_args.validation_file is None
    data = example.load_data(data_args, seed=0)
    assert (len(data["train"]), len(data["validation"]), len(data["test"])) == (16, 4, 6)
    (data_args,) = parser.parse_args_into_dataclasses(
        ["--train_file", str(tmp_path / "train.csv"), "--text_column", "sentence", "--label_column_name", "y",
         "--train_val_split", "0.3"])
    data = example.load_data(data_args, seed=0)
    assert (len(data["train"]), len(data["validation"])) == (14, 6)


# -- several processes -------------------------------------------------------------------------------------------
def _launch(example: str, dump: Path, *flags: str) -> subprocess.CompletedProcess:
    """The README's CPU launch: `accelerate launch --multi_gpu --num_processes 2 ... --use_cpu true`."""
    return run_script(WORKERS / "example_ddp_worker.py", example, str(dump), "--use_cpu", "true", "--disable_tqdm",
                      "true", *flags, launcher="accelerate", env={"HF_HUB_OFFLINE": "1"}, timeout=400)


def _check_one_ddp_run(result: subprocess.CompletedProcess, dump: Path, out: Path) -> None:
    ranks = [torch.load(dump / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in ranks[0]["params"])
    assert torch.equal(ranks[0]["hess"], ranks[1]["hess"])
    (printed,) = _metric_lines(result.stdout)  # one set of metrics, from the main process
    saved = json.loads((out / "eval_results.json").read_text())
    assert saved["eval_accuracy"] == pytest.approx(printed["eval_accuracy"], abs=1e-4)
    weights = load_file(out / "model.safetensors")  # the folder holds the replicas' weights
    for name, value in ranks[0]["params"].items():
        if name in weights:
            assert torch.equal(weights[name], value), name
    assert not [name for name in os.listdir(out) if name.startswith(".tmp-")]


@pytest.mark.slow
def test_two_process_cpu_launch_of_the_image_example(tmp_path):
    out = tmp_path / "out"
    result = _launch("train_image_classification", tmp_path, *TINY_IMAGE[:-4], "--label_noise_samples", "4",
                     "--num_train_epochs", "1", "--output_dir", str(out))
    _check_one_ddp_run(result, tmp_path, out)
    assert (out / "label_noise.parquet").is_file() and (out / "README.md").is_file()


@pytest.mark.slow
def test_two_process_cpu_launch_of_the_text_example(tmp_path):
    words = ["good", "great", "fine", "bad", "awful", "dull"]
    lines = [f"{int(i % 6 < 3)} the film was {words[i % 6]} ." for i in range(64)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:48]) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(lines[48:]) + "\n")
    out = tmp_path / "out"
    result = _launch("train_text_classification", tmp_path, "--model_name_or_path", "none",
                     "--train_file", str(tmp_path / "train.txt"), "--test_file", str(tmp_path / "test.txt"),
                     "--noise_type", "symmetric", "--noise_rate", "0.2", "--num_train_epochs", "1",
                     "--per_device_train_batch_size", "8", "--eval_mc_samples", "2", "--output_dir", str(out))
    _check_one_ddp_run(result, tmp_path, out)


@pytest.mark.slow
def test_a_multi_process_launch_that_does_not_distribute_is_refused(tmp_path):
    """Without `--use_cpu` on a machine without GPUs, the processes would each train their own model."""
    result = run_script(REPO / "examples" / "train_image_classification.py", *TINY_IMAGE[:-2], "--max_steps", "1",
                        "--output_dir", str(tmp_path / "out"), env={"HF_HUB_OFFLINE": "1"}, check=False)
    assert result.returncode != 0
    assert "--use_cpu true" in result.stderr and "not in distributed mode" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_readme_is_a_front_page():
    """Studies and tables live in benchmarks/README.md; the front page stays short enough to read."""
    assert len((REPO / "README.md").read_bytes()) <= 15_000


def test_ci_runs_the_readme_commands_verbatim():
    readme = (REPO / "README.md").read_text()
    commands = [block.strip() for block in readme.split("```bash\n")[1:3]]
    commands = [block.split("\n```")[0].strip() for block in commands]
    assert "accelerate launch examples/train_image_classification.py" in commands[0] and "pytest" in commands[1]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[0] in ci and commands[1] in ci
    assert all('".[test,pretrained]"' in command for command in commands)  # what the defaults need


# -- the image example's arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["flags", "json", "yaml"])
def test_a_pretrained_model_switches_to_the_finetune_preset_whatever_the_config_source(tmp_path, how):
    config = {"output_dir": str(tmp_path), "use_cpu": True, "pretrained_weights": "weights.pth", "beta2": 0.99}
    if how == "flags":
        argv = ["--output_dir", str(tmp_path), "--use_cpu", "--pretrained_weights", "weights.pth", "--beta2=0.99"]
    else:
        path = tmp_path / f"config.{how}"
        path.write_text(json.dumps(config) if how == "json" else yaml.safe_dump(config))
        argv = [str(path)]
    model_args, _, _, training_args = example.parse_arguments(argv)
    assert model_args.pretrained_weights == "weights.pth"
    ivon = training_args.method_config
    assert ivon.ivon_preset == "finetune" and training_args.learning_rate == example.IVON_PRETRAINED_RATE
    assert ivon.ess == FINETUNE_PRESET["ess"] and ivon.hess_init == FINETUNE_PRESET["hess_init"]
    assert ivon.beta2 == 0.99  # the user's value beats the preset's


@pytest.mark.parametrize("how", ["flags", "json"])
def test_a_chosen_preset_and_a_model_from_scratch_are_left_alone(tmp_path, how):
    scratch_pretrained = {"output_dir": str(tmp_path), "pretrained_weights": "w.pth", "ivon_preset": "scratch"}
    from_scratch = {"output_dir": str(tmp_path)}
    for config in (scratch_pretrained, from_scratch):
        if how == "flags":
            argv = [f"--{key.replace('_', '-') if key == 'ivon_preset' else key}={value}"
                    for key, value in config.items()]
        else:
            path = tmp_path / "config.json"
            path.write_text(json.dumps(config))
            argv = [str(path)]
        ivon = example.parse_arguments(argv)[3].method_config
        if config is scratch_pretrained:
            assert ivon.ivon_preset == "scratch"
            assert ivon.hess_init != FINETUNE_PRESET["hess_init"]  # the from-scratch value
        else:  # left to the trainer, which chooses scratch for the example's ResNet built from a config
            assert ivon.ivon_preset is None
            assert choose_preset(create_image_classifier(None, {0: "a", 1: "b"}, num_channels=1))[0] == "scratch"


def test_a_config_file_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "learning_rat": 0.1}))
    with pytest.raises(ValueError, match="learning_rat"):
        example.parse_arguments([str(path)])


def test_a_model_from_scratch_gets_its_methods_scratch_rate_unless_a_rate_is_given(tmp_path):
    """TrainingArguments' 5e-5 is a fine-tuning rate: a from-scratch ResNet hardly trains with it."""
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true"]
    for method in ("erm", "ls", "gce", "sam"):
        training_args = example.parse_arguments([*base, "--method", method])[3]
        assert training_args.learning_rate == METHODS[method].method_class.scratch_learning_rate
        assert training_args.learning_rate != TrainingMethod.default_learning_rate
    assert example.parse_arguments(base)[3].learning_rate is None  # IVON's: its preset's, once the model is known
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "method": "erm", "learning_rate": 0.01}))
    assert example.parse_arguments([str(path)])[3].learning_rate == 0.01  # a chosen rate is kept, from a file too
    path.write_text(json.dumps({"output_dir": str(tmp_path), "method": "erm"}))
    chosen = example.parse_arguments([str(path)])[3].learning_rate  # the script's choice, a number from a file too
    assert chosen == METHODS["erm"].method_class.scratch_learning_rate and isinstance(chosen, float)
    assert example.parse_arguments([*base, "--method", "erm", "--learning_rate", "5e-5"])[3].learning_rate == 5e-5
    # a pretrained model keeps the library's fine-tuning default
    pretrained = example.parse_arguments([*base, "--method", "erm", "--pretrained_weights", "w.pth"])[3]
    assert pretrained.learning_rate == TrainingMethod.default_learning_rate


def test_the_scratch_rates_are_those_the_sweep_chose_on_noisy_validation():
    summary = json.loads((REPO / "benchmarks" / "results" / "example_learning_rates" / "summary.json").read_text())
    chosen = summary["chosen_by_noisy_validation_nll"]
    assert {key.split("/")[0] for key in chosen} == {"erm", "ls", "gce", "sam"}
    for key, rate in chosen.items():
        assert METHODS[key.split("/")[0]].method_class.scratch_learning_rate == rate, key


def test_logging_steps_given_alone_logs_every_that_many_steps(tmp_path):
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true"]
    assert str(example.parse_arguments(base)[3].logging_strategy) in ("epoch", "IntervalStrategy.EPOCH")
    args = example.parse_arguments([*base, "--logging_steps", "7"])[3]
    assert str(args.logging_strategy) in ("steps", "IntervalStrategy.STEPS") and args.logging_steps == 7
    args = example.parse_arguments([*base, "--logging_steps", "7", "--logging_strategy", "epoch"])[3]
    assert str(args.logging_strategy) in ("epoch", "IntervalStrategy.EPOCH")  # an explicit strategy wins


# -- issue 42: the examples' data loading names the file or flag at fault and the fix --------------------------------
@pytest.mark.parametrize("flag, meant", [("--evaluation_strategy", "--eval_strategy"), ("--no_cuda", "--use_cpu"),
                                         ("--num_train_epoch", "--num_train_epochs"),
                                         ("--lerning_rate", "--learning_rate")])
def test_an_unknown_flag_is_named_with_the_one_meant(tmp_path, flag, meant):
    with pytest.raises(ValueError, match=rf"Unknown flag in the command line: {flag} \(did you mean {meant}\?\)"):
        example.parse_arguments([flag, "1", "--use_cpu", "true"])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({flag[2:]: 1, "use_cpu": True}))
    with pytest.raises(ValueError, match=rf"Unknown flag in {config}: {flag} \(did you mean {meant}\?\)"):
        example.parse_arguments([str(config)])
    with pytest.raises(ValueError, match=r"Unknown flags in the command line: --frobnicate, --zzz\. Fix the name"):
        example.parse_arguments(["--zzz", "1", "--frobnicate", "2"])


@pytest.mark.parametrize("flag", ["--train_dir", "--validation_dir"])
def test_a_missing_image_folder_is_named_before_anything_loads(tmp_path, flag):
    _image_folder(tmp_path / "train", 2)
    flags = {"--train_dir": str(tmp_path / "train"), flag: str(tmp_path / "typo")}
    data_args = example.parse_arguments([*(x for kv in flags.items() for x in kv), "--use_cpu", "true"])[1]
    with pytest.raises(FileNotFoundError,
                       match=rf"{flag} {tmp_path / 'typo'}: no such folder.*one sub-folder per class"):
        example.load_data(data_args, seed=0)


@pytest.mark.slow
def test_images_of_mixed_sizes_without_image_size_are_refused_before_training(tmp_path):
    from example_utils.data import check_image_sizes

    _image_folder(tmp_path / "train", 3)
    odd = tmp_path / "train" / "dog" / "big.png"
    PIL.Image.fromarray(np.zeros((12, 10), dtype=np.uint8)).save(odd)
    data = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "train"))
    with pytest.raises(ValueError, match=r"Images of different sizes: .*(big.png is 10x12|is 8x8).*--image_size"):
        check_image_sizes(data, "image")
    os.remove(odd)
    check_image_sizes(datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "train")), "image")  # one size
    run = _image("--train_dir", str(tmp_path / "train"), "--output_dir", str(tmp_path / "out"), "--max_steps", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    PIL.Image.fromarray(np.zeros((12, 10), dtype=np.uint8)).save(odd)
    refused = _image("--train_dir", str(tmp_path / "train"), "--output_dir", str(tmp_path / "out2"), "--max_steps", "1")
    assert refused.returncode != 0 and "--image_size" in refused.stderr and "big.png" in refused.stderr
    assert not (tmp_path / "out2" / "model.safetensors").exists()


def _text_data_args(**files: str):
    from transformers import HfArgumentParser

    text = load_example("train_text_classification")
    flags = [x for name, path in files.items() for x in (f"--{name}", path)]
    return text, HfArgumentParser(text.DataArguments).parse_args_into_dataclasses(flags)[0]


@pytest.mark.parametrize("name, content, message", [
    ("train.csv", 'text,label\n"an unclosed quote,1\nfine,0\n',
     r"--train_file .*train.csv cannot be read as csv .*header row"),
    ("train.jsonl", '{"text": "good", "label": 1}\n{"text": "bad", "label": \n',
     r"--train_file .*train.jsonl cannot be read as json .*one JSON object per line"),
    ("train.csv", "text,label\ngood,1\n,0\nbad,0\n",
     r"--train_file .*train.csv has 1 empty 'text' cells \(rows \[1\]\).*Fill those cells or drop"),
    ("train.csv", "text,label\ngood,pos\nbad,\nugly,neg\nfine,pos\n",
     r"--train_file .*train.csv has 1 empty 'label' cells \(rows \[1\]\)"),
    ("train.jsonl", '{"text": "good", "label": 1}\n{"text": "  ", "label": 0}\n{"text": null, "label": 0}\n',
     r"--train_file .*train.jsonl has 2 empty 'text' cells \(rows \[1, 2\]\)"),
])
def test_a_malformed_or_incomplete_text_file_is_named_with_the_fix(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    text, data_args = _text_data_args(train_file=str(tmp_path / name))
    with pytest.raises(ValueError, match=message):
        text.load_data(data_args, seed=0)


@pytest.mark.parametrize("flag", ["train_file", "validation_file"])
@pytest.mark.parametrize("suffix", [".csv", ".txt"])
def test_a_missing_text_file_is_named_by_its_flag(tmp_path, flag, suffix):
    (tmp_path / f"train{suffix}").write_text("text,label\ngood,1\n" if suffix == ".csv" else "1 good\n0 bad\n")
    files = {"train_file": str(tmp_path / f"train{suffix}"), flag: str(tmp_path / f"typo{suffix}")}
    text, data_args = _text_data_args(**files)
    with pytest.raises(FileNotFoundError, match=rf"--{flag} {tmp_path / ('typo' + suffix)}: no such file"):
        text.load_data(data_args, seed=0)


@pytest.mark.slow
def test_an_output_folder_that_cannot_be_written_fails_before_training(tmp_path):
    from example_utils.script import check_output_dir_writable

    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(PermissionError,
                       match=rf"--output_dir {tmp_path / 'a_file' / 'out'} cannot be written.*Choose a folder"):
        check_output_dir_writable(str(tmp_path / "a_file" / "out"))
    refused = _image("--output_dir", str(tmp_path / "a_file" / "out"), "--max_steps", "1")
    assert refused.returncode != 0 and "cannot be written" in refused.stderr
    assert "{'loss'" not in refused.stdout and "train_runtime" not in refused.stdout  # not a step was trained
    check_output_dir_writable(str(tmp_path / "new" / "out"))  # to be created: its writable parent is enough
    assert not (tmp_path / "new").exists()  # nothing was created


@pytest.mark.slow
def test_the_text_example_loads_a_hub_model_with_hugging_faces_model_flags(tmp_path):
    """`--cache_dir`, `--model_revision` and `--token` (the flags of Hugging Face's run_classification.py) reach every
    download of the model and its tokenizer from the (stand-in) Hub, and the files land in the cache folder given."""
    from hub_stand_in import run_hub_worker

    hub, results = run_hub_worker("example_hub_flags_worker.py", tmp_path)
    # the example's requests: the worker's own (pushing the model) go with the environment's token
    asked = [d for d in hub.downloads if d[0] == "offline-user/tiny-bert" and d[3] == "Bearer hf_flag_token"]
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {file for _, _, file, _ in asked}
    assert {revision for _, revision, file, _ in asked if file is None} == {"v1"}  # looked up, then fetched
    assert not [d for d in hub.downloads if d[2] in ("config.json", "model.safetensors") and d not in asked]
    assert "models--offline-user--tiny-bert" in results["cached"]
    assert "model.safetensors" in results["saved"]
    assert results["token_saved"] == []  # the token reaches the Hub, never the saved run (card, arguments, config)


@pytest.mark.parametrize("name", ["train_text_classification", "train_image_classification"])
def test_both_examples_take_hugging_faces_model_and_split_flags(name):
    """The flags of Hugging Face's run_classification.py / run_image_classification.py parse into the fields the
    examples load with (their Hub use: test_the_text_example_loads_a_hub_model_with_hugging_faces_model_flags)."""
    example = load_example(name)
    model_args, data_args = example.parse_arguments([
        "--cache_dir", "/tmp/hf-cache", "--model_revision", "v2", "--token", "hf_x", "--trust_remote_code", "true",
        "--ignore_mismatched_sizes", "false", "--train_split_name", "training", "--validation_split_name", "dev",
        "--use_cpu", "true"])[:2]
    assert model_args.from_pretrained_kwargs() == {"cache_dir": "/tmp/hf-cache", "revision": "v2", "token": "hf_x",
                                                   "trust_remote_code": True}
    assert model_args.load_dataset_kwargs() == {"cache_dir": "/tmp/hf-cache", "token": "hf_x"}
    assert model_args.ignore_mismatched_sizes is False
    assert (data_args.train_split, data_args.eval_split) == ("training", "dev")


def test_ignore_mismatched_sizes_false_keeps_a_checkpoints_head_of_other_classes_refused(tmp_path):
    """--ignore_mismatched_sizes false (HF's default) refuses a checkpoint whose head has other classes, where the
    examples' default builds a new head for the data's."""
    from transformers import BertConfig, BertForSequenceClassification

    from example_utils.models import create_text_classifier
    from test_lora import tiny_tokenizer

    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    tiny_tokenizer(tmp_path)
    two = {0: "neg", 1: "pos"}
    model, _ = create_text_classifier(str(tmp_path), two)
    assert model.classifier.out_features == 2
    with pytest.raises(RuntimeError, match="size mismatch|ignore_mismatched_sizes"):
        create_text_classifier(str(tmp_path), two, ignore_mismatched_sizes=False)


def test_image_processor_name_brings_that_processor_to_any_model(tmp_path):
    """--image_processor_name (run_image_classification.py's) loads the named processor, even for a model (a small
    ResNet built from a config) that would otherwise get the plain resize + normalise one."""
    from transformers import ViTImageProcessor

    example = load_example("train_image_classification")
    ViTImageProcessor(size={"height": 40, "width": 40}, image_mean=[0.1], image_std=[0.2]).save_pretrained(tmp_path)
    named = example.parse_arguments(["--image_processor_name", str(tmp_path), "--use_cpu", "true"])[0]
    assert example.build_processor(named, num_channels=1, image_size=8).size == {"height": 40, "width": 40}
    plain = example.parse_arguments(["--use_cpu", "true"])[0]
    assert example.build_processor(plain, num_channels=1, image_size=8).size == {"height": 8, "width": 8}
