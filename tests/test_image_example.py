"""The image example's argument handling (its training runs are tested in test_data.py and test_plots.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from varsmooth.methods import METHODS, TrainingMethod
from varsmooth.presets import FINETUNE_PRESET

from helpers import load_example

example = load_example("train_image_classification")


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
    assert training_args.ivon_preset == "finetune"
    assert training_args.ess == FINETUNE_PRESET["ess"] and training_args.hess_init == FINETUNE_PRESET["hess_init"]
    assert training_args.beta2 == 0.99  # the user's value beats the preset's


@pytest.mark.parametrize("how", ["flags", "json"])
def test_a_chosen_preset_and_a_model_from_scratch_are_left_alone(tmp_path, how):
    scratch_pretrained = {"output_dir": str(tmp_path), "pretrained_weights": "w.pth", "ivon_preset": "scratch"}
    from_scratch = {"output_dir": str(tmp_path)}
    for config in (scratch_pretrained, from_scratch):
        if how == "flags":
            argv = [f"--{key.replace('_', '-') if key == 'ivon_preset' else key}={value}" for key, value in config.items()]
        else:
            path = tmp_path / "config.json"
            path.write_text(json.dumps(config))
            argv = [str(path)]
        training_args = example.parse_arguments(argv)[3]
        assert training_args.ivon_preset == "scratch"
        assert training_args.hess_init != FINETUNE_PRESET["hess_init"]  # the from-scratch value


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
    assert example.parse_arguments(base)[3].learning_rate == 0.2  # IVON's own rate is untouched
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "method": "erm", "learning_rate": 0.01}))
    assert example.parse_arguments([str(path)])[3].learning_rate == 0.01  # a chosen rate is kept, from a file too
    assert example.parse_arguments([*base, "--method", "erm", "--learning_rate", "5e-5"])[3].learning_rate == 5e-5
    # a pretrained model keeps the library's fine-tuning default
    pretrained = example.parse_arguments([*base, "--method", "erm", "--pretrained_weights", "w.pth"])[3]
    assert pretrained.learning_rate == TrainingMethod.default_learning_rate


def test_the_scratch_rates_are_those_the_sweep_chose_on_noisy_validation():
    summary = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "example_learning_rates"
                          / "summary.json").read_text())
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
