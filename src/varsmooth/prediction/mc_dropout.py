"""MC-dropout prediction (Gal & Ghahramani 2016, "Dropout as a Bayesian Approximation", Eq. 7): the baseline
approximation of a posterior for networks trained without IVON (so it is not in `varsmooth.posterior`, which holds
IVON's).

P̂(y|x) = (1/S) Σ_s softmax(f(x; ω_s)), each ω_s the weights with a fresh dropout mask: the network predicts with
its dropout layers in training mode and every other layer as in evaluation (BatchNorm keeps its running statistics
and does not update them). The output is a `VariationalClassifierOutput` like that of Bayesian model averaging, so
the same metrics (entropy, mutual information) apply; `mean_logits` is the deterministic prediction (dropout off).

The masks of draw s come from the seed derive_seed(seed, s), in a forked RNG state: predictions are reproducible and
the global RNG (e.g. of a training run in progress) is left as it was.

Only dropout *modules* (`torch.nn.Dropout` and its relatives) are switched on. Dropout that a layer applies itself
according to its own `training` flag (e.g. the attention-probability dropout of transformers' attention layers, which
reads the attention module's flag) stays off, as does stochastic depth. A network without dropout layers (e.g. a
ResNet) gets one before its output layer from `add_output_dropout`, the placement of Gal & Ghahramani's convolutional
networks' last dropout layer; it must then be trained with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..model_parts import output_layer
from ..outputs import VariationalClassifierOutput, model_logits
from ..posterior.seeds import derive_seed
from .bma import average_predictions

__all__ = ["OUTPUT_DROPOUT_KEY", "add_output_dropout", "dropout_modules", "dropout_sampling", "mc_dropout_predictive"]

#: model-config entry recording the rate of the dropout `add_output_dropout` put before the output layer, and the
#: name of that dropout module (`VariationalModel.from_pretrained` puts it back)
OUTPUT_DROPOUT_KEY = "varsmooth_output_dropout"


def add_output_dropout(model: torch.nn.Module, p: float) -> torch.nn.Module:
    """Give `model` a dropout layer of rate `p` on the input of its output layer (the penultimate features) and
    return it, for MC dropout on a network that has no dropout layers. Train the model with it.

    The dropout has no weights: `state_dict`, `save_pretrained` and the posterior are those of the plain network. The
    rate is recorded in `model.config` (as `varsmooth_output_dropout`), so `VariationalModel.from_pretrained` puts the
    layer back when it loads the saved model.
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"The dropout rate must be a number in [0, 1), got {p!r}.")
    if hasattr(model, OUTPUT_DROPOUT_KEY):
        raise ValueError(f"{type(model).__name__} already has an output dropout ({OUTPUT_DROPOUT_KEY}); add it only "
                         "once.")
    layer = output_layer(model)
    dropout = torch.nn.Dropout(p).train(model.training)  # a new module starts in training mode
    model.add_module(OUTPUT_DROPOUT_KEY, dropout)  # a submodule: train()/eval() and dropout_sampling reach it
    layer.register_forward_pre_hook(_DropInput(dropout))
    if getattr(model, "config", None) is not None:
        setattr(model.config, OUTPUT_DROPOUT_KEY, float(p))
    return model


class _DropInput:
    """Forward pre-hook applying `dropout` to a layer's input (an object, not a closure, so that a deep copy of the
    model applies the copy's dropout module)."""

    def __init__(self, dropout: torch.nn.Dropout) -> None:
        self.dropout = dropout

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple:
        return (self.dropout(args[0]), *args[1:])


def dropout_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dropout layers of `model` (`nn.Dropout`, `Dropout1d/2d/3d`, `AlphaDropout`, `FeatureAlphaDropout`)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]


@contextlib.contextmanager
def dropout_sampling(model: torch.nn.Module) -> Iterator[None]:
    """Put only `model`'s dropout layers in training mode; every module's mode is restored on exit."""
    layers = dropout_modules(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no dropout layers (torch.nn.Dropout or its relatives): MC dropout would "
            "average copies of the deterministic prediction. Use a model with dropout layers (e.g. hidden_dropout_prob "
            "> 0 in a BERT config; timm's drop_rate is applied without a layer and is not sampled), give it one with "
            "varsmooth.add_output_dropout(model, p) before training, or set mc_dropout_samples=0."
        )
    modes = [m.training for m in layers]
    try:
        for m in layers:
            m.train()
        yield
    finally:
        for m, mode in zip(layers, modes):
            m.train(mode)


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def mc_dropout_predictive(model: torch.nn.Module, inputs: Mapping[str, Any], num_samples: int,
                          seed: int = 0) -> VariationalClassifierOutput:
    """Average of `num_samples` softmax predictions with dropout on, and the deterministic prediction, for one batch.

    `model` should be in evaluation mode (as `evaluate()` and `from_pretrained` leave it): only its dropout layers are
    switched to training mode. `num_samples=0` returns the deterministic prediction.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 (0 = the deterministic prediction), got {num_samples}.")
    mean_logits = model_logits(model, inputs)
    if num_samples == 0:
        return average_predictions(mean_logits, ())
    device = _device_of(model)
    # the dropout masks come from the global RNG: fork it, so that the caller's RNG stream is not consumed
    forked = torch.random.fork_rng(devices=[device] if device.type != "cpu" else [],
                                   device_type=device.type if device.type != "cpu" else None)

    def draws() -> Iterator[torch.Tensor]:
        for s in range(num_samples):
            torch.manual_seed(derive_seed(seed, s))
            yield model_logits(model, inputs).softmax(-1)

    with dropout_sampling(model), forked:
        return average_predictions(mean_logits, draws())
