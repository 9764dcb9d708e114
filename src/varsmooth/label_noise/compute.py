"""Per-example label noise that variational learning adds, measured on a trained model.

Training with IVON equals training on smoothed labels y + ε with, for every example
(Variational Learning Induces Adaptive Label Smoothing (2025), Eq. 15),

    ε̄_i = p̄_i − P̂_i,   p̄_i = softmax(f(x_i; m)),   P̂_i = E_q[softmax(f(x_i; θ))] ≈ (1/S) Σ_s softmax(f(x_i; θ_s)),

where m is the posterior mean and θ_s ~ q = N(m, diag σ²). A single weight sample adds the per-step noise
ε_{i,s} = p̄_i − softmax(f(x_i; θ_s)) (Eq. 19 is its linearisation); its RMS size is reported too. The entries of
ε̄_i sum to 0, so the smoothed label y_i + ε̄_i still sums to 1 (its entries may leave [0, 1]).

What the numbers mean: ε̄ is large where the posterior is uncertain *and* the posterior-mean prediction sits where
the softmax bends most: fairly confident, not at the decision boundary, where it vanishes (same paper, Eq. 12 and
Fig. 2). With clean labels, where the mean predicts nearly every example confidently, that makes it largest for
ambiguous or atypical examples (Fig. 3); a mean fitted to heavily noisy labels predicts most examples less confidently
than that peak, and the noise is then largest for the more confident ones (`noise_adaptivity` measures which).
A confidently *wrong* label usually gets a tiny |ε̄_y|, because p_y ≈ 0 where the softmax is flat; wrong labels are
found by a low posterior-predictive confidence P̂_y instead (see `varsmooth.label_noise.detection`).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import default_data_collator

from ..files import atomic_path
from ..outputs import LABEL_KEYS
from ..posterior import DiagonalGaussianPosterior
from ..prediction.batchnorm import head_batches
from ..prediction.predictors import PosteriorPredictor, as_posterior_predictor
from .detection import mislabel_detection_report

__all__ = [
    "MAGNITUDE_COLUMNS",
    "METADATA_COLUMNS",
    "compute_label_noise",
    "noise_adaptivity",
    "summarize_label_noise",
    "write_label_noise",
]

#: columns of the input dataset copied into the result when present (written by `varsmooth.corruption`)
METADATA_COLUMNS = ("clean_label", "is_corrupted")
#: posterior draws of the export by default (`compute_label_noise`, `VariationalTrainer.label_noise`,
#: `LabelNoiseCallback`): one antithetic pair m ± σ⊙e, so that the export costs 3 evaluation passes over the training
#: set, under half the training time of a 3-epoch fine-tune (benchmarks/label_noise_cost.py, "The export's
#: defaults"); more draws average ε̄ of each example over more directions
EXPORT_NUM_SAMPLES = 2
#: per-example scalars that `summarize_label_noise` describes
MAGNITUDE_COLUMNS = ("noise_at_label", "noise_l1", "noise_l2", "noise_rms", "confidence", "mean_confidence")
_QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def _batch_label_noise(model: torch.nn.Module, predictor: PosteriorPredictor, batch: Mapping[str, Any],
                       max_full_classes: int, top_k: int) -> dict[str, torch.Tensor]:
    """All per-example quantities of one batch, as tensors of leading size B (memory O(B·K))."""
    label_key = next((key for key in LABEL_KEYS if key in batch), None)
    if label_key is None:
        raise ValueError(
            f"The batch has no labels (keys: {sorted(batch)}): the label noise is measured at the given label. "
            "Keep the label column ('label' or 'labels') in the dataset and collator."
        )
    labels = batch[label_key].long()
    out = predictor.predict(model, batch)
    num_classes = out.probs.shape[-1]
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"Labels must lie in [0, {num_classes}); got values in [{labels.min().item()}, "
                         f"{labels.max().item()}].")
    noise = out.mean_probs - out.probs  # Eq. 15 of the paper above, the expectation taken over S posterior samples
    at_label = labels[:, None]
    result = {
        "label": labels,
        "confidence": out.probs.gather(1, at_label)[:, 0],
        "mean_confidence": out.mean_probs.gather(1, at_label)[:, 0],
        "noise_at_label": noise.gather(1, at_label)[:, 0].abs(),
        "noise_l1": noise.abs().sum(-1),
        "noise_l2": noise.norm(dim=-1),
        "noise_rms": out.noise_rms,  # RMS over draws of ‖p̄ − softmax(f(x; θ_s))‖₂ (Eq. 19's per-step noise)
    }
    if num_classes <= max_full_classes:
        result.update(
            mean_probs=out.mean_probs,
            predictive_probs=out.probs,
            noise=noise,
            smoothed_label=torch.nn.functional.one_hot(labels, num_classes).to(noise.dtype) + noise,
        )
    else:
        _, indices = noise.abs().topk(min(top_k, num_classes), dim=-1)
        result.update(noise_topk_indices=indices, noise_topk_values=noise.gather(1, indices))
    return result


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _default_dataloader(
    model: torch.nn.Module, dataset: datasets.Dataset, batch_size: int, collate_fn: Any, label_column: str
) -> DataLoader:
    """Sequential batches of `dataset`: with `collate_fn` the rows as they are, else the columns `model.forward`
    takes."""
    if collate_fn is not None:
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
    if dataset.format.get("type") == "custom":
        raise ValueError(
            "The dataset has a transform (set_transform/with_transform): pass the `collate_fn` that batches its "
            "output, since selecting columns would drop the transform."
        )
    accepted = inspect.signature(model.forward).parameters
    inputs = [c for c in dataset.column_names if c in accepted and c not in LABEL_KEYS]
    if not inputs:
        raise ValueError(
            f"None of the dataset columns {dataset.column_names} is an argument of {type(model).__name__}.forward "
            f"({list(accepted)}); pass a `collate_fn` that builds the model inputs."
        )
    if label_column not in dataset.column_names:
        raise ValueError(f"The dataset has no label column {label_column!r} (columns: {dataset.column_names}).")
    formatted = dataset.with_format("torch", columns=[*inputs, label_column])
    return DataLoader(formatted, batch_size=batch_size, shuffle=False, collate_fn=default_data_collator)


def _check_posterior_belongs_to(model: torch.nn.Module, posterior: DiagonalGaussianPosterior) -> None:
    own = {id(p) for p in model.parameters()}
    params = dict(posterior.model.named_parameters())
    if any(id(params[name]) not in own for name in posterior.names):
        raise ValueError(
            "The posterior samples the weights of another model than the one given: build it from this model "
            "(DiagonalGaussianPosterior.load(model, path) or trainer.posterior())."
        )


def _to_arrow(column: np.ndarray) -> pa.Array:
    if column.ndim == 1:
        return pa.array(column)
    # fixed-size lists: one contiguous buffer, no per-row Python objects
    return pa.FixedSizeListArray.from_arrays(pa.array(column.reshape(-1)), column.shape[1])


@torch.no_grad()
def compute_label_noise(
    model: torch.nn.Module,
    posterior: DiagonalGaussianPosterior | PosteriorPredictor,
    dataset: datasets.Dataset,
    *,
    num_samples: int = EXPORT_NUM_SAMPLES,
    seed: int = 0,
    batch_size: int = 256,
    collate_fn: Any = None,
    label_column: str = "label",
    max_full_classes: int = 100,
    top_k: int = 5,
    device: str | torch.device | None = None,
    dataloader: Iterable[Mapping[str, Any]] | None = None,
    accelerator: Any = None,
    keep_columns: Sequence[str] = METADATA_COLUMNS,
    temperature: float = 1.0,
    order: Sequence[int] | None = None,
    progress: bool = False,
) -> datasets.Dataset:
    """The label noise IVON adds to every example of `dataset` (Variational Learning Induces
    Adaptive Label Smoothing, 2025, Eq. 15 and Eq. 19), one row per example.

    Each batch costs `num_samples + 1` forward passes: one at the posterior mean m and one per draw θ_s ~ q
    (the draws are the same S models for every batch: antithetic pairs m ± σ⊙e, see `draw_seeds`, which cancel the
    first-order Monte-Carlo error of ε̄).

    The draws come from the learned posterior (`temperature` = 1), whatever posterior temperature τ the model predicts
    with: ε̄ is by definition the noise that training with q induced, and a τ = 0 chosen for prediction would make it
    identically zero. For the same reason, in a model with BatchNorm each draw normalises with statistics of its own,
    as each sampled network normalised with its batch's statistics in training: those `posterior` holds when it is a
    `PosteriorPredictor` prepared for these draws (the trainer's, computed from training data), else recomputed from
    (at most 2,000 of) the examples measured (`varsmooth.prediction.batchnorm.draw_batchnorm_statistics`; one more
    forward pass per draw and example); p̄ uses the model's own statistics.

    Columns, in dataset order:
        example_index: row of `dataset`. label: the given (possibly noisy) label y.
        confidence: P̂_y, the posterior-predictive probability of the given label. mean_confidence: p̄_y.
        noise_at_label: |ε̄_y|. noise_l1, noise_l2: ‖ε̄‖₁, ‖ε̄‖₂. noise_rms: sqrt(mean_s ‖p̄ − softmax(f(x; θ_s))‖²),
            the size of the noise a single weight sample adds (Eq. 19).
        with K ≤ `max_full_classes`: mean_probs (p̄), predictive_probs (P̂), noise (ε̄ = p̄ − P̂) and
            smoothed_label (onehot(y) + ε̄), K floats each;
        with K > `max_full_classes`: noise_topk_indices, noise_topk_values: the `top_k` largest |ε̄_k|, signed values.
        `keep_columns` present in `dataset` (default clean_label, is_corrupted), copied as they are.

    Args:
        model: the network; its weights are the posterior mean m.
        posterior: q over `model`'s weights (`trainer.posterior()`, `DiagonalGaussianPosterior.load`), or a
            prediction with it (`trainer.posterior_predictor()`, `PosteriorPredictor.load`), whose draws' BatchNorm
            statistics are used when they are the export's draws; a point mass is refused (its ε̄ is zero by
            definition).
        temperature: the scale of the draws, 1 (the learned posterior) unless you study a tempered one.
        dataset: rows with the model inputs (e.g. `pixel_values` or `input_ids`/`attention_mask`) and the label.
        batch_size: how many rows of `dataset` a batch holds when no `dataloader` is given.
        collate_fn: turns raw rows of `dataset` into model inputs + `labels` when no `dataloader` is given; by
            default the columns that `model.forward` accepts and `label_column` are stacked with
            `transformers.default_data_collator`.
        dataloader: batches to use instead of building them from `dataset` (e.g. the Trainer's); they must
            follow dataset order (sequential, sharded by `accelerator` when given), or `order`.
        order: the dataset row of each row `dataloader` yields, when they come in another order (e.g. by length,
            `varsmooth.utils.length_order`, so that batches pad little); the result is in dataset order all the same.
        accelerator: an `accelerate.Accelerator` whose `prepare`d `dataloader` is split over processes; the
            per-process results are collected with `gather_for_metrics`, which returns dataset order.
        device: where the batches go (default: the device of the model's first parameter).
        progress: show progress bars (tqdm) over the draws' BatchNorm statistics and the batches.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (posterior draws per example), got {num_samples}.")
    if temperature == 0:
        raise ValueError("temperature=0 draws nothing (every draw is the posterior mean): the label noise would be "
                         "zero by definition. Measure it with the learned posterior, temperature=1 (the default).")
    # ε̄ is the noise that training with the learned posterior induced (Eq. 15): τ = 1, whatever τ prediction uses
    predictor = as_posterior_predictor(posterior, num_samples, seed, temperature)
    posterior = predictor.posterior
    if posterior.is_point_mass:
        raise ValueError(
            "The posterior is a point mass (a model without posterior.safetensors, or trained by a method without "
            "one): its label noise is zero by definition, not measured. Measure it with the posterior IVON learned "
            "(trainer.posterior() of an IVON run, or DiagonalGaussianPosterior.load(model, folder))."
        )
    _check_posterior_belongs_to(model, posterior)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if dataloader is None:
        dataloader = _default_dataloader(model, dataset, batch_size, collate_fn, label_column)
    if predictor.lacks_draw_statistics(model):
        # each draw normalises with statistics of its own, as each sampled network did while training; the batches
        # they are computed from are read once (collating them again for every draw cost more than the passes)
        batches = iter(dataloader)
        head = head_batches(batches)
        if batches is dataloader:  # an iterator: what the head took is measured below all the same
            dataloader = itertools.chain(head, batches)
        predictor = predictor.with_draw_statistics(model, [_to_device(b, device) for b in head], progress=progress)
    was_training = model.training
    model.eval()
    parts: dict[str, list[np.ndarray]] = {}
    try:
        for batch in tqdm(dataloader, desc=f"Label noise ({num_samples} posterior draws)", disable=not progress,
                          leave=False):
            result = _batch_label_noise(model, predictor, _to_device(batch, device), max_full_classes, top_k)
            if accelerator is not None:
                result = accelerator.gather_for_metrics(result)
            for key, value in result.items():
                parts.setdefault(key, []).append(value.cpu().numpy())
    finally:
        model.train(was_training)
    if not parts:
        raise ValueError("The dataset is empty: there is no example to measure the label noise of.")
    columns = {key: np.concatenate(chunks) for key, chunks in parts.items()}
    num_rows = len(columns["label"])
    if order is not None and num_rows == len(order):  # back to dataset order
        rows = np.argsort(np.asarray(order), kind="stable")
        columns = {key: value[rows] for key, value in columns.items()}
    if num_rows != len(dataset):
        raise RuntimeError(
            f"The batches held {num_rows} examples but the dataset has {len(dataset)}: the dataloader drops or "
            "repeats rows (drop_last? a cached dataloader of another dataset?), so rows cannot be matched to examples."
        )
    if label_column in dataset.column_names:
        given = dataset.with_format("numpy", columns=[label_column])[:][label_column]
        if not np.array_equal(given, columns["label"]):
            raise RuntimeError(
                "The labels that came through the dataloader are not the dataset's labels in dataset order: the "
                "dataloader reorders rows (a shuffling or length-grouping sampler?)."
            )

    table = pa.table({"example_index": pa.array(np.arange(num_rows, dtype=np.int64)),
                      **{key: _to_arrow(value) for key, value in columns.items()}})
    features = datasets.Features.from_arrow_schema(table.schema)
    if isinstance(dataset.features.get(label_column), datasets.ClassLabel):
        features["label"] = dataset.features[label_column]  # keep the class names
    kept = [c for c in keep_columns if c in dataset.column_names]
    if kept:
        metadata = dataset.select_columns(kept).with_format("arrow")[:]
        for name in kept:
            table = table.append_column(name, metadata.column(name))
            features[name] = dataset.features[name]
    return datasets.Dataset(table.cast(features.arrow_schema), info=datasets.DatasetInfo(features=features))


def summarize_label_noise(noise: datasets.Dataset) -> dict[str, Any]:
    """Mean, std and quantiles of the per-example magnitudes — overall and, when `is_corrupted` is known, for clean
    and corrupted labels separately —, `noise_adaptivity` (when the full probabilities are kept), plus the
    mislabel-detection metrics of `detection.mislabel_detection_report`."""
    table = noise.with_format("numpy",
                              columns=[c for c in (*MAGNITUDE_COLUMNS, "is_corrupted") if c in noise.column_names])[:]

    def describe(mask: np.ndarray | None) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        for name in MAGNITUDE_COLUMNS:
            values = np.asarray(table[name], dtype=np.float64)
            values = values if mask is None else values[mask]
            if len(values) == 0:
                continue
            stats[name] = {
                "mean": float(values.mean()),
                "std": float(values.std()),
                **{f"q{round(q * 100):02d}": float(v) for q, v in zip(_QUANTILES, np.quantile(values, _QUANTILES))},
            }
        return stats

    summary: dict[str, Any] = {"num_examples": len(noise)}
    if "mean_probs" in noise.column_names:
        summary["num_classes"] = noise.features["mean_probs"].length
    summary["all"] = describe(None)
    if "mean_probs" in noise.column_names:
        summary["adaptivity"] = noise_adaptivity(noise)
    if "is_corrupted" in table:
        corrupted = np.asarray(table["is_corrupted"], dtype=bool)
        summary["num_corrupted"] = int(corrupted.sum())
        summary["clean"] = describe(~corrupted)
        summary["corrupted"] = describe(corrupted)
        summary["detection"] = mislabel_detection_report(noise)
    return summary


def noise_adaptivity(noise: datasets.Dataset, num_bins: int = 10) -> dict[str, float]:
    """Whether the label noise is adaptive, as the paper's first claim says (Yang et al. 2025, Sec. 3 and Fig. 3): its
    size varies across examples (`noise_l1_q90_over_q10`: 90th over 10th percentile of ‖ε̄‖₁, 1 for a constant noise,
    as label smoothing adds) and is larger for ambiguous ones (`noise_l1_entropy_spearman`: Spearman correlation of
    ‖ε̄‖₁ with the entropy of the posterior-mean prediction p̄).

    Whether the second holds depends on where the examples sit: the expected noise vanishes at the decision boundary
    and peaks at a moderately confident p̄ (same paper, Eq. 12 and Fig. 2; for a narrow posterior at p̄ ≈ 0.79 with
    2 classes, `theory.logistic_label_noise_peak`), so it grows with ambiguity only across examples more confident than
    that peak. Measured here: `noise_l1_peak_confidence`, the median confidence max_k p̄_k of the one of `num_bins`
    equal-count confidence bins with the largest mean ‖ε̄‖₁, `below_noise_peak_share`, the share of examples predicted
    less confidently than it, and `mean_confidence_median`."""
    from scipy.stats import spearmanr

    table = noise.with_format("numpy", columns=["noise_l1", "mean_probs"])[:]
    l1, mean_probs = np.asarray(table["noise_l1"], dtype=np.float64), np.asarray(table["mean_probs"], dtype=np.float64)
    entropy = -(mean_probs * np.log(np.clip(mean_probs, 1e-30, None))).sum(-1)
    q10, q90 = np.quantile(l1, [0.1, 0.9])
    rho = spearmanr(l1, entropy).statistic if len(l1) > 1 and l1.std() > 0 and entropy.std() > 0 else float("nan")
    confidence = mean_probs.max(-1)
    bins = [b for b in np.array_split(np.argsort(confidence, kind="stable"), num_bins) if len(b)]
    peak = float(np.median(confidence[max(bins, key=lambda b: l1[b].mean())]))
    return {"noise_l1_q90_over_q10": float(q90 / q10) if q10 > 0 else float("inf"),
            "noise_l1_entropy_spearman": float(rho),
            "mean_confidence_median": float(np.median(confidence)), "noise_l1_peak_confidence": peak,
            "below_noise_peak_share": float((confidence < peak).mean())}


def write_label_noise(
    noise: datasets.Dataset, output_dir: str | os.PathLike, name: str = "label_noise",
    metadata: Mapping[str, Any] | None = None
) -> tuple[str, str]:
    """Write `<name>.parquet` and `<name>_summary.json` into `output_dir`, each whole or not at all.

    The parquet file loads with `datasets.load_dataset("parquet", data_files=path)`. Returns both paths.
    """
    os.makedirs(output_dir, exist_ok=True)
    parquet_path = os.path.join(output_dir, f"{name}.parquet")
    summary_path = os.path.join(output_dir, f"{name}_summary.json")
    with atomic_path(parquet_path) as tmp:
        noise.to_parquet(tmp)
    summary = {**dict(metadata or {}), **summarize_label_noise(noise)}
    with atomic_path(summary_path) as tmp:
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
    return parquet_path, summary_path
