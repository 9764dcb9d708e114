"""BatchNorm statistics of the posterior mean, recomputed when training with a weight posterior ends.

While IVON trains, every forward pass runs at a sampled weight θ ~ N(m, σ²), so BatchNorm's running statistics are
an average over sampled networks, not the statistics of the mean m that predictions use. Once σ has grown (a posterior
that learned), the two differ: on the image example's default run (σ ≈ 0.25) the statistics gathered in training
left the mean at 88.3 % clean test accuracy and NLL 0.69; recomputed at m, 93.6 % and 0.42 (benchmarks/README.md,
"The main job's default run"). The remedy is the one stochastic weight averaging uses for its
averaged weights (Izmailov et al. 2018, "Averaging Weights Leads to Wider Optima and Better Generalization";
`torch.optim.swa_utils.update_bn`): reset the statistics and pass training data through the network in training mode,
with a cumulative average (momentum None). `update_bn` itself takes tensor batches; the Trainer's batches are dicts.

Each posterior draw a prediction makes needs statistics of its own as well (`draw_batchnorm_statistics`): every
forward pass of IVON's training ran at a sampled weight and normalised with its own batch's statistics, so the sampled
networks training fitted have statistics of their own. Predicting with a draw but the *mean's* statistics gives a far
worse network (the image example's default run: 24 % against 66 % accuracy per draw, BMA 48 % against 93 %). SWAG
(Maddox et al. 2019, "A Simple Baseline for Bayesian Uncertainty in Deep Learning") recomputes BatchNorm statistics for
each sampled model for the same reason. The draws of a prediction are fixed by its seed, number of draws and τ, so a
`PosteriorPredictor` computes their statistics once, from training data, and saves them with σ: a reloaded model has no
training data.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from tqdm.auto import tqdm

from ..outputs import model_outputs
from ..posterior import DiagonalGaussianPosterior
from .bma import draw_seeds, restored_buffers

__all__ = ["DRAW_RECALIBRATION_EXAMPLES", "RECALIBRATION_EXAMPLES", "RECOMPUTED_LOG_KEY",
           "DrawBuffers", "batch_rows", "batchnorm_layers", "draw_batchnorm_statistics", "draw_buffers_from_tensors",
           "draw_buffer_tensors", "head_batches", "recompute_batchnorm_statistics"]

#: buffer name -> value, for each draw of a prediction: the statistics the draw s normalises with
DrawBuffers = list[dict[str, torch.Tensor]]

#: training examples the statistics are recomputed from at most: means and variances of activations settle within a
#: few thousand examples, and the pass then costs a fraction of an epoch on large training sets
RECALIBRATION_EXAMPLES = 10_000
#: examples each posterior draw's statistics are recomputed from in the label-noise export (they are held in memory,
#: and every draw makes a pass over them)
DRAW_RECALIBRATION_EXAMPLES = 2_000
#: the training log's key for the number of examples the statistics were recomputed from (the model card reports it)
RECOMPUTED_LOG_KEY = "batchnorm_recomputed_from_examples"


def batchnorm_layers(model: torch.nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of `model` that keep running statistics (those that predictions normalise with)."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def _cumulative_training_mode(model: torch.nn.Module, layers: list[_BatchNorm]) -> Iterator[None]:
    was_training = model.training
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # the plain average over batches, as update_bn: no batch outweighs the others
    model.train()
    try:
        yield
    finally:
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
        model.train(was_training)


def recompute_batchnorm_statistics(model: torch.nn.Module, batches: Iterable[Mapping[str, Any]],
                                   max_examples: int = RECALIBRATION_EXAMPLES, progress: bool = False) -> int:
    """Recompute the running statistics of `model`'s BatchNorm layers at its current weights from `batches` (dicts of
    model inputs, as the Trainer prepares them), over at most `max_examples` examples; returns the number of examples
    used (0, and nothing changed, for a model without BatchNorm or no batches). Under torch.distributed every process
    must call it with as many batches; the statistics are then averaged over processes, so that all agree.

    Dropout is active during the pass, as in training (update_bn does the same); no gradients are computed. `progress`
    shows a progress bar (tqdm)."""
    layers = batchnorm_layers(model)
    if not layers:
        return 0
    seen = 0
    with _cumulative_training_mode(model, layers), torch.no_grad():
        bar = tqdm(batches, desc="BatchNorm statistics at the posterior mean", disable=not progress, leave=False)
        for batch in itertools.takewhile(lambda _: seen < max_examples, bar):  # noqa: B023
            model_outputs(model, batch)
            seen += batch_rows(batch)
    if seen and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for layer in layers:
            for buffer in (layer.running_mean, layer.running_var):
                dist.all_reduce(buffer)
                buffer.div_(dist.get_world_size())
    return seen


def draw_batchnorm_statistics(model: torch.nn.Module, posterior: DiagonalGaussianPosterior,
                              batches: Callable[[], Iterable[Mapping[str, Any]]], num_samples: int, seed: int = 0,
                              max_examples: int = DRAW_RECALIBRATION_EXAMPLES, progress: bool = False,
                              temperature: float = 1.0) -> DrawBuffers | None:
    """The BatchNorm buffers of each of the draws `draw_seeds(seed, num_samples)` of `posterior` at `temperature`,
    recomputed at the drawn weights from `batches()` (a fresh iterable per call) as `recompute_batchnorm_statistics`
    does; None for a model without BatchNorm. The model's own statistics are unchanged. For `sampled_probs(...,
    draw_buffers=)`; `progress` shows a progress bar over the draws.

    A sampled network normalised with its own batches' statistics while it trained; with the mean's statistics
    instead, a wide posterior's draws are far worse networks than the ones training saw (the image example's default
    run: 12 % against 65 % training accuracy), and the label noise p̄ − P̂ measured with them is not the noise training
    induced."""
    layers = batchnorm_layers(model)
    if not layers:
        return None
    names = [f"{name}.{buffer}" for name, module in model.named_modules() if module in layers
             for buffer, _ in module.named_buffers(recurse=False)]
    statistics = []
    with restored_buffers(model, names) as named:
        for draw_seed, mirrored in tqdm(draw_seeds(seed, num_samples),
                                        desc="BatchNorm statistics of each posterior draw",
                                        disable=not progress, leave=False):
            with posterior.sampled(draw_seed, mirrored=mirrored, scale=temperature):
                recompute_batchnorm_statistics(model, batches(), max_examples)
            statistics.append({name: named[name].clone() for name in names})
    return statistics


def head_batches(batches: Iterable[Mapping[str, Any]],
                 max_examples: int = DRAW_RECALIBRATION_EXAMPLES) -> list[Mapping[str, Any]]:
    """The first batches of `batches` that hold `max_examples` examples (or all of them), read once: every draw's
    statistics are computed from the same examples, and collating them again for every draw would cost more than the
    passes."""
    head, rows = [], 0
    for batch in batches:
        head.append(batch)
        rows += batch_rows(batch)
        if rows >= max_examples:
            break
    return head


def batch_rows(batch: Mapping[str, Any]) -> int:
    """The number of rows of a batch of model inputs (the length of its first tensor with a batch dimension)."""
    return next(len(value) for value in batch.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def draw_buffer_tensors(buffers: DrawBuffers) -> dict[str, torch.Tensor]:
    """The draws' buffers as flat tensors `<s>/<buffer name>`, on the CPU (saved beside σ: a reloaded model has no
    training data to compute them from)."""
    return {f"{s}/{name}": value.detach().to("cpu").contiguous()
            for s, named in enumerate(buffers) for name, value in named.items()}


def draw_buffers_from_tensors(tensors: Mapping[str, torch.Tensor], num_draws: int, model: torch.nn.Module,
                              path: str) -> DrawBuffers:
    """Read back what `draw_buffer_tensors` wrote for `num_draws` draws of `model`; refuses (naming `path`) entries
    that do not make that many draws, each with the same buffers of the model."""
    buffers: DrawBuffers = [{} for _ in range(num_draws)]
    for key, value in tensors.items():
        draw, _, name = key.partition("/")
        if not draw.isdigit() or int(draw) >= num_draws or not name:
            raise ValueError(f"{path} holds the entry {key!r}, which is not the buffer of one of its {num_draws} "
                             "posterior draws: the file was edited. Save the model again (trainer.save_model()).")
        buffers[int(draw)][name] = value
    if not buffers or any(set(named) != set(buffers[0]) for named in buffers) or not buffers[0]:
        raise ValueError(f"{path} does not hold the same buffers for each of its {num_draws} posterior draws: the "
                         "file was edited. Save the model again (trainer.save_model()).")
    unknown = sorted(set(buffers[0]) - {name for name, _ in model.named_buffers()})
    if unknown:
        raise ValueError(f"{path} holds posterior draws' buffers {unknown[:3]} that the model does not have: the file "
                         "belongs to another architecture.")
    return buffers
