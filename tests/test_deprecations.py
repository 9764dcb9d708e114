"""The names of the previous release still work for one release, each with a FutureWarning naming its replacement."""

from __future__ import annotations

import importlib
import sys

import pytest

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import VariationalTrainer


@pytest.mark.parametrize("old, new, name", [
    ("varsmooth.calibration", "varsmooth.temperature_scaling", "TemperatureScaling"),
    ("varsmooth.posterior.noise", "varsmooth.posterior.seeds", "derive_seed"),
    ("varsmooth.posterior.mc_dropout", "varsmooth.mc_dropout", "add_output_dropout"),
])
def test_a_renamed_module_warns_and_gives_the_same_objects(old, new, name):
    sys.modules.pop(old, None)  # the warning is given when the module is first imported
    with pytest.warns(FutureWarning, match=f"{old} is deprecated.*use {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_moved_names_warn_and_are_the_new_objects():
    import varsmooth.mc_dropout
    import varsmooth.posterior

    with pytest.warns(FutureWarning, match="varsmooth.posterior.mc_dropout_predictive is deprecated.*varsmooth.mc_dropout"):
        moved = varsmooth.posterior.mc_dropout_predictive
    assert moved is varsmooth.mc_dropout.mc_dropout_predictive
    with pytest.raises(AttributeError):
        varsmooth.posterior.no_such_name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = digits_dataset(64)
    trainer = VariationalTrainer(TinyClassifier(), make_args(tmp_path_factory.mktemp("run"), max_steps=2, eval_mc_samples=2),
                                 train_dataset=data, eval_dataset=data)
    trainer.train()
    return trainer


def test_functions_that_took_the_trainer_warn_and_call_its_method(trained):
    from varsmooth.calibration import fit_trainer_temperature_scaling
    from varsmooth.hub import RunRecord
    from varsmooth.posterior.temperature import select_trainer_temperature, validation_batches

    with pytest.warns(FutureWarning, match=r"trainer.select_posterior_temperature\(eval_dataset\)"):
        report = select_trainer_temperature(trained)
    assert report == trained.posterior_temperature_report and report["temperature"] == trained.posterior_temperature
    with pytest.warns(FutureWarning, match=r"trainer.validation_batches\(eval_dataset\)"):
        batches = list(validation_batches(trained, trained.eval_dataset))
    assert sum(len(b["labels"]) for b in batches) == 64
    with pytest.warns(FutureWarning, match=r"trainer.fit_temperature_scaling\(eval_dataset\)"):
        scaling = fit_trainer_temperature_scaling(trained)
    assert scaling is trained.temperature_scaling and scaling.num_examples == 64
    with pytest.warns(FutureWarning, match=r"trainer.run_record"):
        record = RunRecord.from_trainer(trained)
    assert record == trained.run_record()
    with pytest.warns(FutureWarning, match="RunRecord.learns_posterior"):
        assert record.uses_ivon is True


def test_metrics_evaluation_names_warn_and_score_like_their_new_home(trained):
    import varsmooth.evaluation
    import varsmooth.metrics

    with pytest.warns(FutureWarning, match="varsmooth.metrics.predictive_outputs is deprecated.*varsmooth.evaluation"):
        old = varsmooth.metrics.predictive_outputs(trained, trained.eval_dataset)
    new = varsmooth.evaluation.predictive_outputs(trained, trained.eval_dataset)
    assert old.keys() == new.keys() and all((old[k] == new[k]).all() for k in old)


def test_a_method_built_from_the_training_arguments_warns_and_takes_their_config(tmp_path):
    from varsmooth.methods import get_method_class

    args = make_args(tmp_path, method="sam", method_config={"sam_rho": 0.3})
    with pytest.warns(FutureWarning, match=r"SAMMethod\(args\) is deprecated.*args.method_config"):
        method = get_method_class("sam")(args)
    assert method.config == args.method_config and method.config is not args.method_config


def test_the_optimizers_noise_seed_is_now_sample_seed():
    """`noise_seed` also named the label corruption's seed (`--noise_seed`); the optimizer's is `sample_seed`."""
    import torch

    from varsmooth import VariationalIVON

    weights = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.warns(FutureWarning, match=r"VariationalIVON\(noise_seed=\) is deprecated.*sample_seed="):
        old = VariationalIVON(weights, lr=0.1, ess=10.0, noise_seed=7)
    assert old.sample_seed == 7 == VariationalIVON(weights, lr=0.1, ess=10.0, sample_seed=7).sample_seed
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['seed'\]"):
        VariationalIVON(weights, lr=0.1, ess=10.0, seed=7)
