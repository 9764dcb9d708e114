"""The training methods: the baselines (LS, GLS/NLS, GCE, OLS, SAM, Logistic-Normal, ALASCA) against independent
numbers, and inside the Trainer; the method registry (`register_method`, `list_methods`), each method's own config
inside `VariationalTrainingArguments`, the examples' flat method flags, and methods that run without a trainer.

Reference values, worked out from each paper's definitions: Wei et al. 2022, To Smooth or Not? (r_opt for AGNews,
NLS unboundedness); Zhang et al. 2021, Delving Deep into Label Smoothing (OLS; the update example of ankandrew's public
OLS implementation); Foret et al. 2020 (SAM's closed form on a quadratic; pytorch-optimizer's SAM); Ko et al. 2023
(ALASCA); Englesson et al. 2023 (logistic-normal, a dense MVN); Zhang & Sabuncu 2018 (GCE's limits).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import datasets
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    HfArgumentParser,
    ResNetConfig,
    ResNetForImageClassification,
)
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.trainer_pt_utils import LabelSmoother

import varsmooth.methods
from helpers import load_example, make_args
from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.methods import (
    METHODS,
    ALASCAConfig,
    GCEConfig,
    GeneralizedLabelSmoothingConfig,
    IVONConfig,
    LabelSmoothingConfig,
    LogisticNormalConfig,
    MethodConfig,
    MethodContext,
    OnlineLabelSmoothingConfig,
    SAMConfig,
    TrainingMethod,
    get_method_class,
    learns_posterior,
    list_methods,
    optimal_smoothing_rate,
    register_method,
)
from varsmooth.methods.alasca import _pool, alasca_targets, auxiliary_positions
from varsmooth.methods.base import IGNORE_INDEX
from varsmooth.methods.gce import generalized_cross_entropy
from varsmooth.methods.heads import AUX_MODULE_NAME
from varsmooth.methods.label_smoothing import smoothed_cross_entropy
from varsmooth.methods.logistic_normal import logistic_normal_nll, logistic_normal_targets
from varsmooth.methods.sam import sam_perturbation
from varsmooth.presets import FINETUNE_PRESET

K = 10
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


def tiny_resnet(num_labels: int = K) -> ResNetForImageClassification:
    config = ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          num_labels=num_labels)
    return ResNetForImageClassification(config)


def image_data(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(1, 8, 8, generator=g), "labels": i % K} for i in range(n)]


class MLP(nn.Module):
    """No BatchNorm; `**kwargs` makes the Trainer treat it as a model that accepts loss kwargs (like HF models)."""

    def __init__(self, d: int = 6, k: int = 3):
        super().__init__()
        self.body = nn.Linear(d, 8)
        self.classifier = nn.Linear(8, k)

    def forward(self, pixel_values, labels=None, **kwargs):
        return SequenceClassifierOutput(logits=self.classifier(torch.tanh(self.body(pixel_values))))


def vector_data(n: int = 8, d: int = 6, k: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    return [{"pixel_values": x[i], "labels": i % k} for i in range(n)]


def method(name: str, tmp_path, **kw):
    args = VariationalTrainingArguments(output_dir=str(tmp_path), method=name, report_to=[], use_cpu=True,
                                        method_config=kw)
    return get_method_class(name)(args.method_config)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# -- LS / GLS / NLS ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.4, -0.3, -1.0])
def test_smoothed_ce_is_ce_against_the_uniform_over_k_target(rate):
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, -100])
    loss = smoothed_cross_entropy(logits, labels, rate)
    target = (1 - rate) * F.one_hot(labels[:5], 5).float() + rate / 5
    explicit = -(target * F.log_softmax(logits[:5], -1)).sum(-1).mean()
    assert torch.allclose(loss, explicit, atol=1e-6)
    # HF's LabelSmoother implements the same convention, also for r < 0
    hf = LabelSmoother(epsilon=rate)({"logits": logits.unsqueeze(0)}, labels.unsqueeze(0))
    assert torch.allclose(loss, hf, atol=1e-6)
    if rate >= 0:
        assert torch.allclose(loss, F.cross_entropy(logits, labels, label_smoothing=rate), atol=1e-6)


def test_nls_is_unbounded_below_as_in_the_spec():
    # Wei et al. 2022 (NLS is unbounded below): r = -0.5, K = 5, logits s * e_y -> 0.505, -4, -40, -400
    labels = torch.tensor([2])
    values = [smoothed_cross_entropy(s * F.one_hot(labels, 5).float(), labels, -0.5).item() for s in (1, 10, 100, 1000)]
    assert values == pytest.approx([0.505, -4.0, -40.0, -400.0], abs=1e-3)


def test_optimal_smoothing_rate_reproduces_agnews_rates():
    # Wei et al. 2022, To Smooth or Not?, Table 3 (AGNews, K = 4, r* = 0): ε = 0, .1, .2, .3, .4 -> r = 0, -0.15, -0.36,
    # -0.67, -1.14
    rates = [round(optimal_smoothing_rate(eps, 4), 2) for eps in (0.0, 0.1, 0.2, 0.3, 0.4)]
    assert rates == [0.0, -0.15, -0.36, -0.67, -1.14]
    assert optimal_smoothing_rate(0.2, 10, clean_rate=0.4) > 0  # low noise vs (K-1) r*/K = 0.36: keep LS
    with pytest.raises(ValueError, match="no smoothing rate helps"):
        optimal_smoothing_rate(0.75, 4)  # the pole (K-1)/K


def test_gls_warms_up_with_ce_then_switches_and_warns_on_negative_loss(tmp_path, caplog):
    m = method("gls", tmp_path, gls_rate=-0.5, gls_warmup_epochs=1.0)
    logits, labels = 20 * F.one_hot(torch.tensor([1, 2]), 3).float(), torch.tensor([1, 2])
    assert (m.loss(logits, labels, MethodContext(epoch=0.5)).item()
            == pytest.approx(F.cross_entropy(logits, labels).item()))
    with caplog.at_level(logging.INFO, logger="varsmooth.methods.label_smoothing"):
        after = m.loss(logits, labels, MethodContext(epoch=1.0))
    assert after.item() == pytest.approx(smoothed_cross_entropy(logits, labels, -0.5).item()) and after.item() < 0
    assert "warm-up over" in caplog.text and "NLS loss is negative" in caplog.text


def test_invalid_rates_are_refused(tmp_path):
    with pytest.raises(ValueError, match="gls_rate must be < 1"):
        method("gls", tmp_path, gls_rate=1.0)
    with pytest.raises(ValueError, match="smoothing must be in"):
        method("ls", tmp_path, smoothing=-0.2)


# -- GCE -----------------------------------------------------------------------------------------------
def test_gce_limits_and_gradient():
    torch.manual_seed(0)
    logits, labels = torch.randn(8, K, requires_grad=True), torch.arange(8)
    ce = F.cross_entropy(logits, labels)
    assert generalized_cross_entropy(logits, labels, 1e-6).item() == pytest.approx(ce.item(), rel=1e-5)
    p_y = logits.softmax(-1)[torch.arange(8), labels]
    assert torch.allclose(generalized_cross_entropy(logits, labels, 1.0), (1 - p_y).mean())
    # ∂L_q/∂f = p_y^q · ∂CE/∂f (Zhang & Sabuncu 2018): robust losses down-weight unlikely labels
    (grad,) = torch.autograd.grad(generalized_cross_entropy(logits, labels, 0.7), logits)
    ce_grad = (logits.softmax(-1) - F.one_hot(labels, K)) / 8
    assert torch.allclose(grad, p_y.detach().pow(0.7).unsqueeze(1) * ce_grad, atol=1e-6)


# -- OLS -----------------------------------------------------------------------------------------------
def test_ols_update_matches_the_reference_example(tmp_path):
    # ankandrew's OLS implementation, test_update.py: accumulated column-major [[.7,.5,0],[.2,1.3,0],[.1,.2,0]], counts
    # [1,2,0]
    m = method("ols", tmp_path)
    probs = torch.tensor([[0.3, 0.6, 0.1], [0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.2, 0.7, 0.1]])
    labels = torch.tensor([1, 0, 0, 1])
    loss = m.loss(probs.log(), labels, MethodContext())
    assert torch.allclose(m.accumulator.T, torch.tensor([[0.7, 0.5, 0.0], [0.2, 1.3, 0.0], [0.1, 0.2, 0.0]]))
    assert m.counts.tolist() == [1.0, 2.0, 0.0]
    # epoch 0 uses the LS matrix with 0.1 on the other classes; α = 0.5
    s0 = torch.tensor([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.05, 0.9]])
    expected = 0.5 * F.nll_loss(probs.log(), labels) + 0.5 * -(s0[labels] * probs.log()).sum(-1).mean()
    assert torch.allclose(loss, expected)
    m.next_epoch()
    assert torch.allclose(m.soft_labels, torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.65, 0.1], [0.0, 0.0, 0.0]]))
    assert m.counts.sum() == 0 and m.accumulator.abs().sum() == 0
    m.loss(probs.log(), labels, MethodContext(is_training=False))  # evaluation passes do not collect statistics
    assert m.counts.sum() == 0


# -- SAM -----------------------------------------------------------------------------------------------
class Quadratic(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0]))
        self.bn = nn.BatchNorm1d(2)

    def forward(self, pixel_values, labels=None, **kwargs):
        return SequenceClassifierOutput(logits=self.bn(pixel_values))


class QuadraticTrainer(VariationalTrainer):
    A = torch.tensor([[3.0, 1.0], [1.0, 2.0]])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(pixel_values=inputs["pixel_values"]).logits  # runs BatchNorm, adds nothing to the loss
        w = model.w
        return 0.5 * w @ self.A @ w + 0.0 * out.sum()


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_step_on_a_quadratic_matches_closed_form_and_updates_bn_once(tmp_path, adaptive):
    rho, lr = 0.3, 0.1
    data = [{"pixel_values": torch.tensor([float(i), 2.0 * i]), "labels": 0} for i in range(4)]
    args = make_args(tmp_path, method="sam", method_config={"sam_rho": rho, "sam_adaptive": adaptive}, optim="sgd",
                     learning_rate=lr,
                     lr_scheduler_type="constant", max_grad_norm=0.0, max_steps=1, per_device_train_batch_size=4)
    model = Quadratic()
    QuadraticTrainer(model=model, args=args, train_dataset=data).train()
    A, w = QuadraticTrainer.A.double(), torch.tensor([1.0, -2.0], dtype=torch.float64)
    g = A @ w
    eps = rho * w**2 * g / torch.linalg.norm(w.abs() * g) if adaptive else rho * g / torch.linalg.norm(g)
    expected = w - lr * A @ (w + eps)
    assert torch.allclose(model.w.detach().double(), expected, atol=1e-6)
    # running mean updated once with momentum 0.1 (twice would give 0.19 * batch mean)
    assert torch.allclose(model.bn.running_mean, 0.1 * torch.tensor([1.5, 3.0]))
    assert model.bn.num_batches_tracked.item() == 1 and model.bn.momentum == 0.1


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_equals_pytorch_optimizer_sam(tmp_path, adaptive):
    from pytorch_optimizer import SAM

    data = vector_data()
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    args = make_args(tmp_path, method="sam", method_config={"sam_rho": 0.2, "sam_adaptive": adaptive}, optim="sgd",
                     learning_rate=0.5,
                     lr_scheduler_type="constant", max_grad_norm=0.0, max_steps=3, per_device_train_batch_size=8)
    VariationalTrainer(model=model, args=args, train_dataset=data).train()
    x, y = torch.stack([d["pixel_values"] for d in data]), torch.tensor([d["labels"] for d in data])
    opt = SAM(reference.parameters(), torch.optim.SGD, rho=0.2, adaptive=adaptive, lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(reference(x).logits, y).backward()
        opt.first_step(zero_grad=True)
        F.cross_entropy(reference(x).logits, y).backward()
        opt.second_step(zero_grad=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_sam_accumulation_perturbs_each_micro_batch(tmp_path):
    """GA = 2: the step uses mean_k ∇L_k(w + ε̂_k), each ε̂_k from micro-batch k's own gradient."""
    data = vector_data()
    torch.manual_seed(0)
    model = MLP()
    w0 = copy.deepcopy(model)
    args = make_args(tmp_path, method="sam", method_config={"sam_rho": 0.2}, optim="sgd", learning_rate=0.5,
                     lr_scheduler_type="constant",
                     max_grad_norm=0.0, max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     train_sampling_strategy="sequential")
    VariationalTrainer(model=model, args=args, train_dataset=data).train()
    x, y = torch.stack([d["pixel_values"] for d in data]), torch.tensor([d["labels"] for d in data])
    params = list(w0.parameters())
    total = [torch.zeros_like(p) for p in params]
    for xb, yb in ((x[:4], y[:4]), (x[4:], y[4:])):
        probe = copy.deepcopy(w0)
        probe.zero_grad()
        F.cross_entropy(probe(xb).logits, yb).backward()
        eps = sam_perturbation(list(probe.parameters()), 0.2)
        with torch.no_grad():
            for p, e in zip(probe.parameters(), eps):
                p.add_(e)
        probe.zero_grad()
        F.cross_entropy(probe(xb).logits, yb).backward()
        total = [t + p.grad / 2 for t, p in zip(total, probe.parameters())]
    for p, p0, g in zip(model.parameters(), params, total):
        assert torch.allclose(p, p0 - 0.5 * g, atol=1e-6)


def test_non_ivon_accumulation_divides_by_the_accumulation_steps(tmp_path):
    """bs 8 = 2 x 4 with GA for a model that accepts loss kwargs (the Trainer would otherwise skip the 1/GA)."""
    data = vector_data()
    torch.manual_seed(0)
    full, accumulated = MLP(), MLP()
    accumulated.load_state_dict(full.state_dict())
    common = dict(method="ls", optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0,
                  max_steps=1)
    VariationalTrainer(model=full, args=make_args(tmp_path, per_device_train_batch_size=8, **common),
                       train_dataset=data).train()
    VariationalTrainer(model=accumulated,
                       args=make_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                         **common), train_dataset=data).train()
    for p, q in zip(full.parameters(), accumulated.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


# -- Logistic-Normal -----------------------------------------------------------------------------------
def test_logistic_normal_target_constant():
    # Englesson et al. 2023: C = τ log(((1-t)(K+1) + t)/t) = 6.9939 for K = 10, τ = 1, t = 0.01
    target = logistic_normal_targets(torch.tensor([3]), 10, 1.0, 0.01)
    assert target[0, 3].item() == pytest.approx(6.9939, abs=1e-4)
    assert torch.count_nonzero(target).item() == 1


@pytest.mark.parametrize("temperature,min_scale", [(1.0, 0.5), (0.5, 1.0), (0.1, 0.1)])
def test_logistic_normal_loss_equals_dense_multivariate_normal(temperature, min_scale):
    torch.manual_seed(0)
    mean = torch.randn(8, K, dtype=torch.float64, requires_grad=True)
    factor = torch.randn(8, K, dtype=torch.float64, requires_grad=True)
    target = logistic_normal_targets(torch.arange(8), K, temperature, 0.01).double()
    fast = logistic_normal_nll(mean, factor, target, min_scale)
    sqrt_cov = factor.unsqueeze(-1) * factor.unsqueeze(-2) + min_scale * torch.eye(K, dtype=torch.float64)
    dense = -torch.distributions.MultivariateNormal(mean, covariance_matrix=sqrt_cov @ sqrt_cov).log_prob(target)
    assert torch.allclose(fast, dense, rtol=1e-9, atol=1e-8)
    grads_fast = torch.autograd.grad(fast.sum(), (mean, factor))
    grads_dense = torch.autograd.grad(dense.sum(), (mean, factor))
    for a, b in zip(grads_fast, grads_dense):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-8)


# -- ALASCA --------------------------------------------------------------------------------------------
def test_alasca_positions_ema_confidence_and_targets(tmp_path):
    assert auxiliary_positions(4, 3) == [1, 2, 3]  # ResNet-34: after layers 1, 2, 3
    assert auxiliary_positions(12, 3) == [3, 6, 9]
    assert auxiliary_positions(2, 3) == [1]
    m = method("alasca", tmp_path, alasca_warmup_epochs=30)
    m.ema = torch.zeros(4, 3)
    f1, f2 = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]]), torch.tensor([[2.0, -1.0, 1.0]])
    m.update_ema(torch.tensor([0, 2]), f1)
    m.update_ema(torch.tensor([2]), f2)
    assert torch.allclose(m.ema[2], 0.7 * 0.3 * f1[1] + 0.3 * f2[0]) and m.ema[1].abs().sum() == 0
    labels = torch.tensor([1, 2])
    sharpened = F.softmax(m.ema[[0, 2]] * 3, -1)[torch.arange(2), labels]  # τ = 1/3
    conf = m.confidence(torch.tensor([0, 2]), labels, epoch=15)
    assert torch.allclose(conf, 0.5 * sharpened + 0.5)
    assert torch.allclose(m.confidence(torch.tensor([0, 2]), labels, epoch=0), torch.ones(2))
    # the reference target = (1 - α̃)·CE + α̃/(K-1)·Σ_{j≠y} CE_j with α̃ = 1 - conf (Ko et al. 2023)
    logits = torch.randn(2, 3)
    soft_ce = -(alasca_targets(conf, labels, 3) * F.log_softmax(logits, -1)).sum(-1)
    nll = -F.log_softmax(logits, -1)
    alpha = 1 - conf
    others = nll.sum(-1) - nll[torch.arange(2), labels]
    assert torch.allclose(soft_ce, (1 - alpha) * nll[torch.arange(2), labels] + alpha / 2 * others)
    # token features are averaged over the attention mask, feature maps over space
    tokens, mask = torch.randn(2, 4, 5), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert torch.allclose(_pool(tokens, mask), torch.stack([tokens[0].mean(0), tokens[1, :2].mean(0)]))
    maps = torch.randn(2, 5, 3, 3)
    assert torch.allclose(_pool(maps, None), maps.flatten(2).mean(-1))


# -- inside the Trainer --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_trains_and_the_saved_model_reloads_as_a_plain_model(tmp_path, name):
    def train(folder, method_name):
        torch.manual_seed(0)
        model = tiny_resnet()
        args = make_args(folder, method=method_name, max_steps=3, per_device_train_batch_size=4,
                         logging_strategy="steps", logging_steps=1, eval_mc_samples=2,
                         method_config={"alasca_warmup_epochs": 1} if method_name == "alasca" else None)
        trainer = VariationalTrainer(model=model, args=args, train_dataset=image_data(8))
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}  # with the method's heads, if any
        return trainer, model, initial, trainer.train()

    trainer, model, initial, result = train(tmp_path, name)
    assert math.isfinite(result.training_loss)
    trained = {k: v.detach() for k, v in model.named_parameters()}
    heads = {k for k in initial if AUX_MODULE_NAME in k.split(".")}
    moved = {k for k in initial if not torch.equal(trained[k], initial[k])}
    assert moved - heads, "the network's weights did not change"
    # each method's own signature: it is not ERM under another name, its heads (if any) learn, IVON's Hessian
    # moves except with the fixed-Hessian ablation, OLS's soft-label matrix leaves its initial value
    if name != "erm":
        erm = dict(train(tmp_path / "erm", "erm")[1].named_parameters())
        assert any(not torch.equal(trained[k], erm[k]) for k in erm), f"{name} trained exactly like ERM"
    assert bool(heads) == (name in ("alasca", "logistic_normal")) and heads <= moved
    if learns_posterior(name):
        hess, h0 = trainer.ivon.hessian(), trainer.args.method_config.hess_init
        if name == "ivon_fixed_hessian":
            assert torch.all(hess == h0)  # β2 = 1: h stays at h0 exactly
        else:
            assert (hess != h0).float().mean() > 0.9
    if name == "ols":  # 2 steps per epoch: the matrix was swapped in after the first epoch
        start = torch.full((K, K), 0.1 / (K - 1)).fill_diagonal_(0.9)
        assert trainer.method.epoch >= 1 and not torch.allclose(trainer.method.soft_labels, start)
    trainer.save_model()
    saved = safetensors.torch.load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(saved) == set(tiny_resnet().state_dict())  # no auxiliary heads, nothing missing
    reloaded = ResNetForImageClassification.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(reloaded(pixel_values=x).logits, model.eval()(pixel_values=x).logits)
    for k in moved - heads:  # the trained weights, not the initial ones, were saved
        assert torch.equal(saved[k], trained[k]) and not torch.equal(saved[k], initial[k])


def test_alasca_on_a_transformer_uses_hidden_states_and_an_example_index(tmp_path):
    config = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({
        "input_ids": torch.randint(1, 30, (12, 6), generator=g).tolist(),
        "attention_mask": [[1] * 6] * 6 + [[1, 1, 1, 0, 0, 0]] * 6,
        "label": [i % 3 for i in range(12)],
        "text": [f"row {i}" for i in range(12)],  # unused column: removed, the index is kept
    })
    args = make_args(tmp_path, method="alasca", max_steps=6, per_device_train_batch_size=4,
                     method_config={"alasca_warmup_epochs": 1})
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()
    assert trainer.method.positions == [1]
    visited = trainer.method.ema.abs().sum(-1) > 0
    assert visited.all()  # two epochs over 12 rows: every example's EMA was written through its own index
    trainer.save_model()
    reloaded = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    ids = torch.tensor(ds["input_ids"][:2])
    assert torch.equal(reloaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("name", ["alasca", "logistic_normal"])
def test_heads_on_a_timm_model(tmp_path, name):
    """timm through TimmWrapperForImageClassification: hidden states from `forward_intermediates`, head from
    `get_classifier`."""
    from transformers import TimmWrapperForImageClassification

    from example_utils.models import create_image_classifier

    torch.manual_seed(0)
    model = create_image_classifier("resnet10t", {i: str(i) for i in range(3)}, num_channels=1)
    plain_keys = set(model.state_dict())
    data = [{"pixel_values": torch.randn(1, 32, 32), "labels": i % 3} for i in range(8)]
    trainer = VariationalTrainer(model=model,
                                 args=make_args(tmp_path, method=name, max_steps=2, per_device_train_batch_size=4),
                                 train_dataset=data)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        before = model.eval()(pixel_values=x).logits
    assert math.isfinite(trainer.train().training_loss)
    heads = {k for k in initial if AUX_MODULE_NAME in k.split(".")}
    moved = {k for k, v in model.named_parameters() if not torch.equal(v.detach(), initial[k])}
    # the method's heads hang on the timm model, take part in the loss (they learn) and the network learns too
    assert heads and heads <= moved and moved - heads
    if name == "alasca":
        assert trainer.method.positions == [1, 2, 3]  # stem, layer1..layer4: ACs after layers 1-3
        assert len({k.split(".")[1] for k in heads}) == 3  # one auxiliary classifier per position
    else:
        assert {k.split(".")[1] for k in heads} == {"covariance_factor"}
    trainer.save_model()
    saved = safetensors.torch.load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(saved) == plain_keys  # the heads are dropped at save
    reloaded = TimmWrapperForImageClassification.from_pretrained(tmp_path).eval()
    after = model.eval()(pixel_values=x).logits
    assert torch.allclose(reloaded(pixel_values=x).logits, after, atol=1e-6)
    assert not torch.allclose(after, before, atol=1e-4)  # the reload is the trained network, not the initial one


def _state_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name", ["ols", "alasca", "sam", "logistic_normal"])
def test_resume_reproduces_weights_and_method_state(tmp_path, name):
    """6 steps straight vs resumed at step 3 (an epoch boundary) and at step 4 (mid-epoch); 3 steps per epoch."""
    def run(folder, resume=None):
        torch.manual_seed(0)
        model = tiny_resnet()
        args = make_args(folder, method=name, max_steps=6, per_device_train_batch_size=4, save_strategy="steps",
                         save_steps=1, optim="sgd", learning_rate=0.1,
                         method_config={"alasca_warmup_epochs": 1} if name == "alasca" else None)
        trainer = VariationalTrainer(model=model, args=args, train_dataset=image_data(12))
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer.method.state_dict()

    straight, state = run(tmp_path / "a")
    for step in (3, 4):
        resumed, resumed_state = run(tmp_path / f"b{step}", resume=str(tmp_path / "a" / f"checkpoint-{step}"))
        for (n, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
            assert torch.equal(p, q), (step, n)
        assert _state_equal(state, resumed_state), step
    if name == "ols":
        assert state["epoch"] == 1 and state["counts"].sum() > 0  # swapped once, collecting in epoch 1
    if name in ("alasca", "logistic_normal"):
        assert any(k.startswith(AUX_MODULE_NAME) for k, _ in straight.named_parameters())


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
    # the 15 baseline settings moved, unchanged in name, from the training arguments into the configs, as IVON's did
    baseline_configs = {m.config_class for m in listed if not learns_posterior(m.method_class)}
    assert set().union(*(_fields(c) for c in baseline_configs)) == BASELINE_FLAGS
    assert not (BASELINE_FLAGS | _fields(IVONConfig)) & _fields(VariationalTrainingArguments)


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


def test_register_method_refuses_a_duplicate_name_not_a_shared_field_name(monkeypatch):
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

    register_method("clash", Clashing, Other)  # no prefix rule: the examples parse one method's config at a time
    with pytest.raises(TypeError, match="MethodConfig"):
        register_method("toy", dict, ToyMethod)
    register_method("toy", ToyConfig, ToyMethod)
    assert ToyMethod.name == "toy" and varsmooth.methods.base.get_method_config_class("toy") is ToyConfig
    with pytest.raises(ValueError, match="already registered as 'toy'"):
        register_method("toy2", ToyConfig, ToyMethod)
    args = make_args("out", method="toy", method_config={"toy_weight": 2.0})  # a registered method is usable at once
    assert args.method_config == ToyConfig(toy_weight=2.0)


# -- the config inside the training arguments ----------------------------------------------------------
def test_ivon_config_holds_the_settings_the_preset_filled():
    """IVON is configured like the other methods (an `IVONConfig` in `method_config`), whose preset fills the
    settings left unset, and the learning rate and posterior samples of the arguments left unset."""
    args = make_args("out", method_config=IVONConfig(ivon_preset="finetune", ess=123.0, mc_samples=2))
    assert args.method_config == IVONConfig(ess=123.0, hess_init=1e-3, beta2=None, prior_precision=0.0,
                                            clip_radius=1e-3, rescale_lr=False, mc_samples=2, ivon_preset="finetune")
    assert args.learning_rate == FINETUNE_PRESET["learning_rate"] and args.eval_mc_samples == 32
    assert args.method_config.beta1 == 0.9
    again = VariationalTrainingArguments(**{k: v for k, v in args.to_dict().items()
                                            if k in ("output_dir", "method", "method_config",
                                            "use_cpu")})  # a saved config round-trips
    assert again.method_config == args.method_config and again.learning_rate == FINETUNE_PRESET["learning_rate"]
    assert make_args("out", method_config={"ivon_preset": "lora"}).eval_mc_samples == 10
    with pytest.raises(ValueError, match="hess_init must be finite and > 0"):
        make_args("out", method_config={"hess_init": 0.0})
    with pytest.raises(ValueError, match="mc_samples is a number of samples, a whole number"):
        IVONConfig(mc_samples=2.5)


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
    hyper = get_method_class("alasca")(make_args(tmp_path, method="alasca",
                                                 method_config={"alasca_lambda": 1.5}).method_config).hyperparameters()
    assert hyper["method"] == "alasca" and hyper["alasca_lambda"] == 1.5 and hyper["alasca_ema"] == 0.7


def test_training_args_with_a_method_config_round_trip(tmp_path):
    args = make_args(tmp_path, method="alasca",
                     method_config={"alasca_warmup_epochs": 2.0, "alasca_num_classifiers": 1})
    as_json = json.loads(args.to_json_string())
    assert as_json["method_config"] == {"alasca_lambda": 2.0, "alasca_ema": 0.7, "alasca_temperature": 1 / 3,
                                        "alasca_warmup_epochs": 2.0, "alasca_num_classifiers": 1}
    parser = HfArgumentParser(VariationalTrainingArguments)
    (from_json,) = parser.parse_dict({k: as_json[k] for k in ("output_dir", "use_cpu", "method", "method_config")})
    assert from_json.method_config == args.method_config
    (from_flags,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--method", "alasca", "--method_config",
         json.dumps(as_json["method_config"])])
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
        assert example.parse_arguments(["--method", "ls", "--smoothing", "0.3"])[3].method_config == \
            LabelSmoothingConfig(0.3)
        assert example.parse_arguments(["--method", "gce"])[3].method_config == GCEConfig()
        assert example.parse_arguments(["--method", "gce", "--method_config", '{"gce_q": 0.4}'])[3].method_config == \
            GCEConfig(gce_q=0.4)
        with pytest.raises(ValueError, match=r"--sam_rho \(a setting of --method sam, and --method is ls\)"):
            example.parse_arguments(["--method", "ls", "--sam_rho", "0.1"])
        with pytest.raises(ValueError, match=r"--ess \(a setting of --method ivon, and --method is erm\)"):
            example.parse_arguments(["--method", "erm", "--ess", "1e4"])
        ivon = example.parse_arguments(["--ess", "1e4", "--ivon_smoothing", "0.1"])[3].method_config
        assert (ivon.ess, ivon.ivon_smoothing) == (1e4, 0.1)
        with pytest.raises(ValueError, match="either as flags"):
            example.parse_arguments(["--method", "ls", "--smoothing", "0.2", "--method_config", '{"smoothing": 0.5}'])


def test_image_example_reads_method_settings_from_a_config_file(examples, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"method": "gls", "gls_rate": -0.5, "gls_warmup_epochs": 1.0}))
    assert examples[0].parse_arguments([str(path)])[3].method_config == GeneralizedLabelSmoothingConfig(-0.5, 1.0)


# -- methods run without a trainer ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_every_method_loss_runs_on_a_context_alone(tmp_path, name):
    """No trainer exists here: a method that reached into one (`trainer.state`, `trainer._prepare_inputs`) fails."""
    torch.manual_seed(0)
    model = tiny_resnet(3).train()
    config = {"alasca_num_classifiers": 1} if name == "alasca" else None
    method = get_method_class(name)(make_args(tmp_path, method=name, method_config=config).method_config,
                                    num_train_examples=6)
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
    context = MethodContext(gradient_accumulation_steps=2,
                            note_finite=lambda loss, params: noted.append((loss, params)))
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
