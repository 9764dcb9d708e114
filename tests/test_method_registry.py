"""The method registry (`register_method`, `list_methods`), each method's own config inside
`VariationalTrainingArguments`, the examples' flat method flags, and methods that run without a trainer."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import HfArgumentParser, ResNetConfig, ResNetForImageClassification

import varsmooth.methods
from helpers import load_example, make_args
from varsmooth import VariationalTrainingArguments
from varsmooth.methods import (
    METHODS, ALASCAConfig, GCEConfig, GeneralizedLabelSmoothingConfig, IVONConfig, LabelSmoothingConfig,
    LogisticNormalConfig, MethodConfig, MethodContext, OnlineLabelSmoothingConfig, SAMConfig, TrainingMethod,
    get_method_class, learns_posterior, list_methods, method_config_classes, method_config_from_flags, register_method,
)
from varsmooth.methods.base import IGNORE_INDEX
from varsmooth.methods.sam import sam_perturbation

#: written out by hand: every method and its config class
EXPECTED_CONFIGS = {
    "alasca": ALASCAConfig, "erm": MethodConfig, "gce": GCEConfig, "gls": GeneralizedLabelSmoothingConfig,
    "ivon": IVONConfig, "ivon_fixed_hessian": IVONConfig, "logistic_normal": LogisticNormalConfig,
    "ls": LabelSmoothingConfig, "ols": OnlineLabelSmoothingConfig, "sam": SAMConfig,
}
#: the baselines' settings, which used to be fields of VariationalTrainingArguments (and stay the examples' flags)
BASELINE_FLAGS = {
    "smoothing", "gls_rate", "gls_warmup_epochs", "ols_alpha", "sam_rho", "sam_adaptive", "gce_q", "ln_temperature",
    "ln_min_scale", "ln_target_smoothing", "alasca_lambda", "alasca_ema", "alasca_temperature", "alasca_warmup_epochs",
    "alasca_num_classifiers",
}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# -- registry ------------------------------------------------------------------------------------------
def test_list_methods_describes_every_method_with_its_config_and_paper():
    listed = list_methods()
    assert [m.name for m in listed] == sorted(EXPECTED_CONFIGS)
    assert {m.name: m.config_class for m in listed} == EXPECTED_CONFIGS
    for m in listed:
        assert m.method_class is get_method_class(m.name) and m.method_class.name == m.name
        assert m.summary and "\n" not in m.summary
        assert (m.paper is None) == (m.name == "erm"), m.name  # every method but plain ERM cites its paper
    assert "Wei et al. 2022" in METHODS["gls"].paper and "Ko et al. 2023" in METHODS["alasca"].paper
    # the 15 baseline settings moved, unchanged in name, from the training arguments into the configs
    assert set().union(*(_fields(c) for c in method_config_classes())) == BASELINE_FLAGS
    assert not BASELINE_FLAGS & _fields(VariationalTrainingArguments)


def test_each_listed_method_prints_one_line_with_its_description_settings_and_paper():
    """README: `list_methods()` "describes each": what it does, its main settings with their defaults, its paper."""
    for m in list_methods():
        line = str(m)
        assert "\n" not in line and line.startswith(f"{m.name}: {m.summary}")
        assert m.settings["learning_rate"] == m.method_class.default_learning_rate
        for name in _fields(m.config_class):  # every setting of its config, with the config's default
            assert m.settings[name] == getattr(m.config_class(), name), (m.name, name)
            assert f"{name}={getattr(m.config_class(), name)}" in line
        if learns_posterior(m.method_class):
            assert {"ivon_preset", "ess", "hess_init", "prior_precision", "mc_samples"} <= set(m.settings)
        else:  # the rate a network trained from scratch gets in the image example
            assert m.settings["scratch_learning_rate"] == m.method_class.scratch_learning_rate
        assert (m.paper is None) == ("Paper:" not in line)
    assert "gce_q=0.7" in str(METHODS["gce"]) and "learning_rate=0.2" in str(METHODS["ivon"])


def test_register_method_refuses_a_duplicate_name_and_a_colliding_field(monkeypatch):
    monkeypatch.setattr(varsmooth.methods.base, "METHODS", dict(METHODS))  # registrations here do not leak

    @dataclasses.dataclass
    class ToyConfig(MethodConfig):
        toy_weight: float = 1.0

    class ToyMethod(TrainingMethod):
        """A toy."""

    with pytest.raises(ValueError, match="named 'ls' is already registered"):
        register_method("ls", ToyConfig, ToyMethod)
    assert varsmooth.methods.base.METHODS["ls"].method_class.__name__ == "LabelSmoothingMethod"  # unchanged

    @dataclasses.dataclass
    class Clashing(MethodConfig):
        sam_rho: float = 0.1

    class Other(TrainingMethod):
        """Another toy."""

    with pytest.raises(ValueError, match=r"\['sam_rho'\].*prefix"):
        register_method("clash", Clashing, Other)
    with pytest.raises(TypeError, match="MethodConfig"):
        register_method("toy", dict, ToyMethod)
    register_method("toy", ToyConfig, ToyMethod)
    assert ToyMethod.name == "toy" and varsmooth.methods.base.get_method_config_class("toy") is ToyConfig
    with pytest.raises(ValueError, match="already registered as 'toy'"):
        register_method("toy2", ToyConfig, ToyMethod)
    args = make_args("out", method="toy", method_config={"toy_weight": 2.0})  # a registered method is usable at once
    assert args.method_config == ToyConfig(toy_weight=2.0)


# -- the config inside the training arguments ----------------------------------------------------------
def test_ivon_config_is_the_arguments_own_fields_after_the_preset():
    """IVON is configured like the other methods (an `IVONConfig` in `method_config`), built from the arguments'
    fields once the preset filled those left unset; a method_config that disagrees with them is refused."""
    args = make_args("out", ivon_preset="finetune", ess=123.0, mc_samples=2)
    assert args.method_config == IVONConfig(learning_rate=0.3, ess=123.0, hess_init=1e-3, beta2=None, prior_precision=0.0,
                                            clip_radius=1e-3, rescale_lr=False, mc_samples=2, eval_mc_samples=args.eval_mc_samples,
                                            ivon_preset="finetune")
    assert args.method_config.eval_mc_samples == 32 and args.beta1 == args.method_config.beta1 == 0.9
    again = VariationalTrainingArguments(**{k: v for k, v in args.to_dict().items() if k in ("output_dir", "method", "method_config",
                                            "ivon_preset", "ess", "mc_samples", "use_cpu")})  # a saved config round-trips
    assert again.method_config == args.method_config
    with pytest.raises(ValueError, match="method='ivon' takes its settings from the arguments' own fields.*set those fields"):
        make_args("out", ess=123.0, method_config={"ess": 5.0})
    with pytest.raises(ValueError, match="hess_init must be finite and > 0"):
        make_args("out", hess_init=0.0)


def test_unknown_or_invalid_config_fields_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"\['rho'\].*method='sam' \(SAMConfig\).*sam_adaptive, sam_rho"):
        make_args(tmp_path, method="sam", method_config={"rho": 0.1})
    with pytest.raises(ValueError, match=r"\['sam_rho'\].*method='ls'.*smoothing"):
        make_args(tmp_path, method="ls", method_config={"sam_rho": 0.1})
    with pytest.raises(ValueError, match=r"\['smoothing'\].*method='ivon' \(IVONConfig\)"):
        make_args(tmp_path, method="ivon", method_config={"smoothing": 0.1})
    with pytest.raises(TypeError, match="SAMConfig, but method='ls' is configured by LabelSmoothingConfig"):
        make_args(tmp_path, method="ls", method_config=SAMConfig())
    with pytest.raises(ValueError, match="gce_q must be in"):
        make_args(tmp_path, method="gce", method_config={"gce_q": 0.0})
    with pytest.raises(ValueError, match="JSON object"):
        make_args(tmp_path, method="gce", method_config="gce_q=0.5")


def test_method_config_defaults_copies_and_reaches_the_method(tmp_path):
    assert make_args(tmp_path, method="sam").method_config == SAMConfig(sam_rho=0.05, sam_adaptive=False)
    given = SAMConfig(sam_rho=0.3)
    args = make_args(tmp_path, method="sam", method_config=given)
    method = get_method_class("sam")(args.method_config)
    method.config.sam_rho = 1.0
    assert given.sam_rho == 0.3 and args.method_config.sam_rho == 0.3  # the user's object is never changed
    hyper = get_method_class("alasca")(make_args(tmp_path, method="alasca", method_config={"alasca_lambda": 1.5}).method_config).hyperparameters()
    assert hyper["method"] == "alasca" and hyper["alasca_lambda"] == 1.5 and hyper["alasca_ema"] == 0.7


def test_training_args_with_a_method_config_round_trip(tmp_path):
    args = make_args(tmp_path, method="alasca", method_config={"alasca_warmup_epochs": 2.0, "alasca_num_classifiers": 1})
    as_json = json.loads(args.to_json_string())
    assert as_json["method_config"] == {"alasca_lambda": 2.0, "alasca_ema": 0.7, "alasca_temperature": 1 / 3,
                                        "alasca_warmup_epochs": 2.0, "alasca_num_classifiers": 1}
    parser = HfArgumentParser(VariationalTrainingArguments)
    (from_json,) = parser.parse_dict({k: as_json[k] for k in ("output_dir", "use_cpu", "method", "method_config")})
    assert from_json.method_config == args.method_config
    (from_flags,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--method", "alasca", "--method_config", json.dumps(as_json["method_config"])])
    assert from_flags.method_config == args.method_config
    assert VariationalTrainingArguments(**args.to_dict()).method_config == args.method_config
    replaced = dataclasses.replace(args, method="gce", method_config=None)
    assert replaced.method_config == GCEConfig()
    # what Trainer saves as training_args.bin
    torch.save(args, tmp_path / "training_args.bin")
    assert torch.load(tmp_path / "training_args.bin", weights_only=False).method_config == args.method_config
    assert "alasca_warmup_epochs" in str(args.to_sanitized_dict()["method_config"])  # what TensorBoard records


# -- the examples' flags -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def examples():
    return load_example("train_image_classification"), load_example("train_text_classification")


def test_examples_keep_the_flat_method_flags(examples):
    for example in examples:
        assert example.parse_arguments(["--method", "sam", "--sam_rho", "0.2", "--sam_adaptive"])[3].method_config == \
            SAMConfig(sam_rho=0.2, sam_adaptive=True)
        assert example.parse_arguments(["--method", "ls", "--smoothing", "0.3"])[3].method_config == LabelSmoothingConfig(0.3)
        assert example.parse_arguments(["--method", "gce"])[3].method_config == GCEConfig()
        assert example.parse_arguments(["--method", "gce", "--method_config", '{"gce_q": 0.4}'])[3].method_config == \
            GCEConfig(gce_q=0.4)
        with pytest.raises(ValueError, match=r"--sam_rho \(method 'sam'\) given, but --method is 'ls'.*--smoothing"):
            example.parse_arguments(["--method", "ls", "--sam_rho", "0.1"])
        with pytest.raises(ValueError, match="either as flags"):
            example.parse_arguments(["--method", "ls", "--smoothing", "0.2", "--method_config", '{"smoothing": 0.5}'])


def test_image_example_reads_method_settings_from_a_config_file(examples, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"method": "gls", "gls_rate": -0.5, "gls_warmup_epochs": 1.0}))
    assert examples[0].parse_arguments([str(path)])[3].method_config == GeneralizedLabelSmoothingConfig(-0.5, 1.0)


def test_method_config_from_flags_without_its_flags_keeps_method_config():
    configs = [cls() for cls in method_config_classes()]
    assert method_config_from_flags("sam", configs, {"method", "learning_rate"}) is None
    assert method_config_from_flags("ivon", configs, {"method", "ess"}) is None
    with pytest.raises(ValueError, match=r"--gce_q \(method 'gce'\).*--method is 'ivon', whose flags are: none"):
        method_config_from_flags("ivon", configs, {"gce_q"})


# -- methods run without a trainer ---------------------------------------------------------------------
def _tiny_resnet() -> ResNetForImageClassification:
    config = ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          num_labels=3)
    return ResNetForImageClassification(config)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_every_method_loss_runs_on_a_context_alone(tmp_path, name):
    """No trainer exists here: a method that reached into one (`trainer.state`, `trainer._prepare_inputs`) fails."""
    torch.manual_seed(0)
    model = _tiny_resnet().train()
    config = {"alasca_num_classifiers": 1} if name == "alasca" else None
    method = get_method_class(name)(make_args(tmp_path, method=name, method_config=config).method_config, num_train_examples=6)
    method.attach(model)
    x, labels = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, IGNORE_INDEX])
    logits = model(pixel_values=x).logits
    context = MethodContext(step=3, epoch=1.5, is_training=True, example_index=torch.tensor([5, 0, 2, 4]))
    loss = method.loss(logits, labels, context)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert model.classifier[-1].weight.grad.abs().sum() > 0
    if name in ("erm", "ivon", "ivon_fixed_hessian", "sam"):  # cross-entropy, without its ignored label
        assert torch.allclose(loss, F.cross_entropy(logits[:3], labels[:3]))
    if name == "alasca":  # the EMA rows of this batch's examples were written, through the context's indices
        assert (method.ema.abs().sum(-1) > 0).tolist() == [True, False, True, False, False, True]


def test_sam_training_step_runs_on_a_context_alone():
    """SAM's two passes with its own loss and plain autograd: the gradient is ∇L(w + ε̂), w is unchanged, and the
    loss and complete gradients are noted for the finiteness check."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    method = get_method_class("sam")(make_args("out", method="sam", method_config={"sam_rho": 0.3}).method_config)
    w0 = [p.detach().clone() for p in model.parameters()]
    noted = []
    context = MethodContext(gradient_accumulation_steps=2, note_finite=lambda loss, params: noted.append((loss, params)))
    logged = method.training_step(model, {"input": x, "labels": y}, context)
    assert len(noted) == 1 and noted[0][1] == list(model.parameters())
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    eps = sam_perturbation(list(reference.parameters()), 0.3)
    with torch.no_grad():
        for p, e in zip(reference.parameters(), eps):
            p.add_(e)
    reference.zero_grad()
    loss_at_w = F.cross_entropy(model(x), y)
    (F.cross_entropy(reference(x), y) / 2).backward()
    for p, q, w in zip(model.parameters(), reference.parameters(), w0):
        assert torch.equal(p.detach(), w)
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    assert torch.allclose(logged, loss_at_w.detach() / 2)


def test_no_method_module_touches_a_trainer():
    """Static guard beside the runtime one: the methods package never names a trainer nor reads a private attribute
    of another object (only `self._...`)."""
    folder = Path(varsmooth.methods.__file__).parent
    offences = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id.lower().endswith("trainer"):  # not TrainerCallback
                offences.append(f"{path.name}:{node.lineno} {node.id}")
            if isinstance(node, ast.Attribute):
                if node.attr.lower().endswith("trainer"):
                    offences.append(f"{path.name}:{node.lineno} .{node.attr}")
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                if private and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    offences.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not offences, offences
