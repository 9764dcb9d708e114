"""VariationalTrainingArguments: the TrainingArguments defaults it overrides, and presets that never override the
user."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from helpers import TinyClassifier, digits_dataset, make_args, reference_ivon_loop
from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.methods import IVONConfig, MethodConfig
from varsmooth.presets import FINETUNE_PRESET, SCRATCH_PRESET

PRESET_FIELDS = ("hess_init", "prior_precision", "rescale_lr")  # β2 is not filled: it follows the run (hessian_window)


def _parse(*flags: str) -> VariationalTrainingArguments:
    (args,) = HfArgumentParser(VariationalTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", *flags])
    return args


def _ivon(*flags: str) -> IVONConfig:
    (config,) = HfArgumentParser(IVONConfig).parse_args_into_dataclasses(list(flags))
    return config


def test_finetune_preset_keeps_values_the_user_gave_even_when_they_equal_the_scratch_defaults():
    """`--beta2 0.99999` is the scratch default; the finetune preset used to replace it by 0.999."""
    config = _ivon("--ivon_preset", "finetune", "--beta2", "0.99999", "--hess_init", "0.5", "--prior_precision", "2e-4",
                   "--rescale_lr", "true")
    assert (config.beta2, config.hess_init, config.prior_precision, config.rescale_lr) == (0.99999, 0.5, 2e-4, True)
    # what the user left unset comes from the preset, the learning rate (an argument of every method) too
    args = VariationalTrainingArguments(output_dir="out", use_cpu=True, method_config=config)
    assert (config.ess, config.clip_radius, args.learning_rate) == (FINETUNE_PRESET["ess"],
                                                                    FINETUNE_PRESET["clip_radius"],
                                                                    FINETUNE_PRESET["learning_rate"])
    assert args.method_config == config and args.method_config is not config  # a copy
    # and the scratch preset keeps a value equal to the finetune one
    scratch = _ivon("--ivon_preset", "scratch", "--beta2", "0.999", "--rescale_lr", "false")
    assert (scratch.beta2, scratch.rescale_lr, scratch.hess_init) == (0.999, False, SCRATCH_PRESET["hess_init"])


@pytest.mark.parametrize("preset", ["scratch", "finetune"])
def test_preset_fields_are_concrete_after_post_init_and_serialise(preset):
    args = VariationalTrainingArguments(output_dir="out", use_cpu=True, method_config={"ivon_preset": preset})
    expected = FINETUNE_PRESET if preset == "finetune" else SCRATCH_PRESET
    config = args.method_config
    for name in PRESET_FIELDS:
        value = getattr(config, name)
        assert value == expected[name] and type(value) is type(SCRATCH_PRESET[name]), name
    as_json = json.loads(args.to_json_string())
    assert as_json["method_config"] == dataclasses.asdict(config)
    assert args.to_dict()["max_grad_norm"] == 0.0
    assert config.beta2 is None and as_json["method_config"]["beta2"] is None
    assert as_json["method_config"]["hessian_window"] == 0.1
    # the resolved values parse back to the same arguments (e.g. a config file written from to_dict())
    (again,) = HfArgumentParser(VariationalTrainingArguments).parse_dict(
        {"output_dir": "out", "use_cpu": True, "method_config": as_json["method_config"]})
    assert again.method_config == config and again.learning_rate == args.learning_rate


def test_ivon_settings_are_not_fields_of_the_arguments_nor_of_another_method():
    """Each IVON setting is declared once, in IVONConfig: not a field of the arguments, and refused in the config of
    another method, which would not use it."""
    fields = {f.name for f in dataclasses.fields(VariationalTrainingArguments)}
    assert not fields & {f.name for f in dataclasses.fields(IVONConfig)}
    with pytest.raises(TypeError, match="ess"):
        VariationalTrainingArguments(output_dir="out", use_cpu=True, ess=1e4)
    with pytest.raises(ValueError, match=r"\['ess'\], which method='erm'"):
        VariationalTrainingArguments(output_dir="out", use_cpu=True, method="erm", method_config={"ess": 1e4})
    assert VariationalTrainingArguments(output_dir="out", use_cpu=True, method="erm").method_config == MethodConfig()


def test_max_grad_norm_defaults_to_no_clipping_unlike_training_arguments():
    assert TrainingArguments(output_dir="out", use_cpu=True).max_grad_norm == 1.0
    assert VariationalTrainingArguments(output_dir="out", use_cpu=True).max_grad_norm == 0.0
    assert _parse().max_grad_norm == 0.0 and _parse("--method", "erm").max_grad_norm == 0.0
    assert _parse("--max_grad_norm", "1.0").max_grad_norm == 1.0


#: IVON's settings of `_train_three_steps` as `reference_ivon_loop` takes them (ess: the 64 training examples)
REFERENCE_IVON = dict(lr=0.2, hess_init=0.5, beta1=0.9, beta2=0.999, wd=2e-4, ess=64, seed=0)


def _train_three_steps(tmp_path, **args_kw):
    """The trainer after 3 sequential steps of 16 of 64 digits, the model it started from, and its batches per step
    (for `reference_ivon_loop`)."""
    ds = digits_dataset(64)
    torch.manual_seed(0)
    model = TinyClassifier()
    init = copy.deepcopy(model)
    args = make_args(tmp_path, learning_rate=0.2, beta2=0.999, lr_scheduler_type="constant", max_steps=3,
                     train_sampling_strategy="sequential", per_device_train_batch_size=16, **args_kw)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    x, y = ds[:]["pixel_values"], ds[:]["label"]
    return trainer, init, lambda step: [(x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16])]


def _max_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def test_default_run_trains_on_unclipped_gradients(tmp_path):
    """With the defaults, IVON sees each sample's raw gradient: the trainer matches the unclipped hand-written loop,
    and a loop clipping at the stock 1.0 would have ended elsewhere (the sample gradients here have norm > 1)."""
    trainer, init, batches = _train_three_steps(tmp_path)
    unclipped, _ = reference_ivon_loop(init, batches, 3, clip_norm=0.0, **REFERENCE_IVON)
    clipped, _ = reference_ivon_loop(init, batches, 3, clip_norm=1.0, **REFERENCE_IVON)
    assert _max_diff(trainer.model, unclipped) < 1e-6
    assert _max_diff(clipped, unclipped) > 1e-3


@pytest.mark.parametrize("path", [dict(ivon_compiled=True), dict(ivon_compiled=False), dict(ivon_foreach=False)],
                         ids=["compiled", "foreach", "reference"])
def test_ivon_code_path_reaches_the_optimizer_and_each_path_matches_the_hand_written_loop(tmp_path, path):
    """`--ivon_compiled` and `--ivon_foreach` parse as HF's optional booleans do and pick IVON's code path (compiled
    kernels, foreach ops or the for-loop reference); on the CPU all draw the noise from the same generator and train
    as the ivon-opt reference loop, as the default path does (`test_default_run_trains_on_unclipped_gradients`)."""
    assert _ivon().ivon_compiled is None and _ivon("--ivon_compiled", "false").ivon_compiled is False
    assert _ivon().ivon_foreach is None and _ivon("--ivon_foreach", "false").ivon_foreach is False
    trainer, init, batches = _train_three_steps(tmp_path, **path)
    compiles = path.get("ivon_compiled", True) and path.get("ivon_foreach") is not False
    assert trainer.ivon.compiled is path.get("ivon_compiled") and trainer.ivon.foreach is path.get("ivon_foreach")
    assert trainer.ivon._dispatch.compiles is compiles
    ref, _ = reference_ivon_loop(init, batches, 3, **REFERENCE_IVON)
    assert _max_diff(trainer.model, ref) < 1e-6
    x, y = (torch.cat(t) for t in zip(*(batches(step)[0] for step in range(3))))
    losses = [torch.nn.functional.cross_entropy(m(x).logits, y).item() for m in (init, trainer.model)]
    assert losses[1] < losses[0]  # it trains: the mean's loss on the batches it saw fell
