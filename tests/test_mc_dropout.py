"""MC-dropout prediction (Gal & Ghahramani 2016): dropout layers on, everything else in evaluation mode."""

import itertools

import numpy as np
import pytest
import torch
from transformers import ResNetConfig, ResNetForImageClassification
from transformers.modeling_outputs import SequenceClassifierOutput

from helpers import digits_dataset, make_args
from varsmooth import VariationalModel, VariationalTrainer, VariationalTrainingArguments, mc_dropout_predictive
from varsmooth.posterior import DiagonalGaussianPosterior
from varsmooth.prediction.bma import predictive_distribution
from varsmooth.prediction.mc_dropout import OUTPUT_DROPOUT_KEY, add_output_dropout


class DropoutLinear(torch.nn.Module):
    """softmax(W · dropout(x) + b): small enough to enumerate every dropout mask."""

    def __init__(self, in_features: int = 4, num_classes: int = 3, p: float = 0.5):
        super().__init__()
        self.dropout = torch.nn.Dropout(p)
        self.linear = torch.nn.Linear(in_features, num_classes)

    def forward(self, pixel_values, labels=None):
        return SequenceClassifierOutput(logits=self.linear(self.dropout(pixel_values.flatten(1))))


class NormDropoutClassifier(torch.nn.Module):
    """Linear → BatchNorm → tanh → Dropout → Linear, as a digits classifier."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.body = torch.nn.Linear(64, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.dropout = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, pixel_values, labels=None):
        return SequenceClassifierOutput(
            logits=self.head(self.dropout(torch.tanh(self.norm(self.body(pixel_values.flatten(1)))))))


def resnet() -> ResNetForImageClassification:
    """A small ResNet, which has no dropout layers."""
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16],
                                                     depths=[1, 1], layer_type="basic", num_labels=10)).eval()


def _exact_dropout_expectation(model: DropoutLinear, x: torch.Tensor) -> torch.Tensor:
    """E_m[softmax(W (m ⊙ x) / (1 − p) + b)] over every Bernoulli(1 − p) mask m, weighted by its probability."""
    p = model.dropout.p
    d = x.shape[1]
    total = torch.zeros(x.shape[0], model.linear.out_features, dtype=torch.float64)
    w, b = model.linear.weight.double(), model.linear.bias.double()
    for bits in itertools.product((0.0, 1.0), repeat=d):
        kept = torch.tensor(bits, dtype=torch.float64)
        weight = float(np.prod([(1 - p) if k else p for k in bits]))
        total += weight * ((x.double() * kept / (1 - p)) @ w.T + b).softmax(-1)
    return total


def test_dropout_zero_draws_equal_the_deterministic_prediction():
    torch.manual_seed(0)
    model = DropoutLinear(p=0.0).eval()
    x = torch.randn(6, 4)
    out = mc_dropout_predictive(model, {"pixel_values": x, "labels": torch.zeros(6, dtype=torch.long)}, num_samples=5)
    expected = model(x).logits.softmax(-1)
    torch.testing.assert_close(out.probs, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(out.mean_probs, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.mutual_information, torch.zeros(6), rtol=0, atol=1e-6)
    assert not model.training and not model.dropout.training  # modes restored


def test_many_draws_approach_the_exact_expectation_over_masks():
    torch.manual_seed(0)
    model = DropoutLinear(p=0.5).eval()
    with torch.no_grad():
        model.linear.weight.mul_(3.0)  # large enough that the masks matter
    x = torch.randn(5, 4)
    exact = _exact_dropout_expectation(model, x).float()
    deterministic = model(x).logits.softmax(-1)
    assert (exact - deterministic).abs().max() > 0.05  # the test could not tell dropout on from off otherwise
    num_samples = 4000
    out = mc_dropout_predictive(model, {"pixel_values": x}, num_samples=num_samples, seed=1)
    # the standard error of a mean of S probabilities is at most 0.5/sqrt(S)
    assert (out.probs - exact).abs().max() < 4 * 0.5 / num_samples ** 0.5
    torch.testing.assert_close(out.mean_probs, deterministic)
    # mutual information: H[P̂] − mean of the draws' entropies, positive when the masks disagree
    assert (out.mutual_information > 0).all()


def test_batchnorm_stays_in_evaluation_mode_and_the_global_rng_is_untouched():
    torch.manual_seed(0)
    model = NormDropoutClassifier(p=0.0)
    with torch.no_grad():  # running statistics far from any batch's, so that batch statistics would show
        model.norm.running_mean.fill_(3.0)
        model.norm.running_var.fill_(0.25)
    model.eval()
    x = torch.rand(16, 8, 8)
    running = model.norm.running_mean.clone()
    expected = model(x).logits.softmax(-1)
    rng = torch.get_rng_state()
    out = mc_dropout_predictive(model, {"pixel_values": x}, num_samples=3)
    torch.testing.assert_close(out.probs, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(model.norm.running_mean, running, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    model.dropout.p = 0.3
    mc_dropout_predictive(model, {"pixel_values": x}, num_samples=3)
    torch.testing.assert_close(model.norm.running_mean, running, rtol=0, atol=0)
    assert not any(m.training for m in model.modules())
    # draws are reproducible for a seed and differ between seeds
    a = mc_dropout_predictive(model, {"pixel_values": x}, num_samples=3, seed=5).probs
    torch.testing.assert_close(mc_dropout_predictive(model, {"pixel_values": x}, num_samples=3, seed=5).probs, a,
                               rtol=0, atol=0)
    assert not torch.allclose(mc_dropout_predictive(model, {"pixel_values": x}, num_samples=3, seed=6).probs, a)


def test_a_model_without_dropout_is_refused():
    from helpers import TinyClassifier

    with pytest.raises(ValueError, match="no dropout layers"):
        mc_dropout_predictive(TinyClassifier().eval(), {"pixel_values": torch.rand(2, 8, 8)}, num_samples=2)
    with pytest.raises(ValueError, match="mc_dropout_samples.*IVON"):
        VariationalTrainingArguments(output_dir="unused", method="ivon", mc_dropout_samples=4, use_cpu=True,
                                     report_to=[])
    with pytest.raises(ValueError, match="mc_dropout_samples must be >= 0"):
        VariationalTrainingArguments(output_dir="unused", method="erm", mc_dropout_samples=-1, use_cpu=True,
                                     report_to=[])


def test_trainer_evaluates_by_mc_dropout(tmp_path):
    train, val = digits_dataset(160, seed=0), digits_dataset(64, seed=1)
    torch.manual_seed(0)
    model = NormDropoutClassifier(p=0.3)
    args = make_args(tmp_path, method="erm", max_steps=20, learning_rate=0.05, optim="sgd", mc_dropout_samples=16,
                     per_device_eval_batch_size=64)  # one batch: the masks are those of one call on the whole set
    trainer = VariationalTrainer(model=model, args=args, train_dataset=train, eval_dataset=val)
    trainer.train()
    metrics = trainer.evaluate()
    log_probs = trainer.predict(val).predictions
    model.eval()
    batch = {"pixel_values": val[:]["pixel_values"]}
    expected = mc_dropout_predictive(model, batch, num_samples=16, seed=trainer.args.eval_seed)
    np.testing.assert_allclose(np.exp(log_probs), expected.probs.numpy(), rtol=1e-5, atol=1e-6)
    labels = val[:]["label"].numpy()
    assert metrics["eval_nll"] == pytest.approx(float(-expected.logits[np.arange(64), labels].mean()), rel=1e-5)
    deterministic = predictive_distribution(model, DiagonalGaussianPosterior.point_mass(model), batch, 0)
    assert not np.allclose(np.exp(log_probs), deterministic.probs.numpy(), atol=1e-3)
    # a VariationalModel predicts the same with mc_dropout_samples
    wrapped = VariationalModel(model, DiagonalGaussianPosterior.point_mass(model), seed=trainer.args.eval_seed,
                               mc_dropout_samples=16)
    torch.testing.assert_close(wrapped(**batch).probs, expected.probs)


def test_output_dropout_gives_a_network_without_dropout_an_mc_dropout_prediction_that_survives_a_reload(tmp_path):
    plain, model = resnet(), add_output_dropout(resnet(), 0.5)
    assert model.state_dict().keys() == plain.state_dict().keys()  # no weights: the saved model is the plain network
    x = torch.rand(6, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain(x).logits, rtol=0, atol=0)  # evaluation mode: no dropout
        features = []
        plain.classifier[-1].register_forward_pre_hook(lambda module, args: features.append(args[0]))
        plain(x)
        torch.manual_seed(4)
        with_dropout = model.classifier[-1](torch.nn.functional.dropout(features[0], 0.5, training=True))
        model.get_submodule(OUTPUT_DROPOUT_KEY).train()
        torch.manual_seed(4)
        # dropout on the output layer's input
        torch.testing.assert_close(model(x).logits, with_dropout, rtol=1e-6, atol=1e-6)
        model.eval()
    with pytest.raises(ValueError, match="only once"):
        add_output_dropout(model, 0.1)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        add_output_dropout(resnet(), 1.0)
    expected = VariationalModel(model, DiagonalGaussianPosterior.point_mass(model), seed=2,
                                mc_dropout_samples=8)(pixel_values=x)
    assert (expected.mutual_information > 0).all()
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="No posterior"):
        loaded = VariationalModel.from_pretrained(tmp_path, mc_dropout_samples=8, seed=2)
    torch.testing.assert_close(loaded(pixel_values=x).probs, expected.probs, rtol=1e-6, atol=1e-7)


def test_a_deep_copy_of_a_model_with_output_dropout_uses_its_own_dropout():
    import copy

    original = add_output_dropout(resnet(), 0.5)
    clone = copy.deepcopy(original)
    clone.get_submodule(OUTPUT_DROPOUT_KEY).train()  # only the copy's dropout is on
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        assert not torch.allclose(clone(x).logits, original(x).logits)
        original.get_submodule(OUTPUT_DROPOUT_KEY).train()
        clone.eval()
        torch.manual_seed(1)
        a = original(x).logits
        torch.manual_seed(1)
        assert not torch.equal(a, clone(x).logits)  # the clone's hook does not reach the original's dropout
