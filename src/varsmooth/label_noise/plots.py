"""Pictures of the label noise variational learning adds (Variational Learning Induces Adaptive Label Smoothing (Yang et
al. 2025), Fig. 2-4; the Moon picture of its blog post, Khan 2025).

Every function draws with matplotlib's Agg canvas (no display, no global pyplot state), writes one PNG into
`output_dir` (atomically: temporary file, then rename) and returns its path. The inputs are `compute_label_noise`
results, as returned or reloaded from `label_noise.parquet`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
import numpy as np
from matplotlib.colors import Normalize

from ..figures import new_figure, save_figure
from .theory import logistic_label_noise, logistic_label_noise_peak

__all__ = [
    "class_smoothed_labels",
    "find_image_column",
    "label_smoothing_targets",
    "plot_noise_2d",
    "plot_noise_extremes",
    "plot_noise_vs_mean",
    "plot_smoothed_labels",
]

_IMAGE_COLUMNS = ("pixel_values", "image", "img")


def _column(noise: datasets.Dataset, name: str) -> np.ndarray:
    if name not in noise.column_names:
        raise ValueError(f"The label-noise dataset has no column {name!r} (columns: {noise.column_names}).")
    return noise.with_format("numpy", columns=[name])[:][name]


def _class_names(noise: datasets.Dataset, num_classes: int, class_names: Sequence[str] | None) -> list[str]:
    if class_names is not None:
        return list(class_names)
    feature = noise.features.get("label")
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    return [str(k) for k in range(num_classes)]


# -- Fig. 2 ------------------------------------------------------------------------------------------
def plot_noise_vs_mean(
    output_dir: str | os.PathLike,
    variances: Sequence[float] = (1.0,),
    mean_range: tuple[float, float] = (-6.0, 6.0),
    filename: str = "label_noise_vs_mean.png",
) -> str:
    """Seed 000, Fig. 2: |ε| = |σ(m) − E_{N(m, v)}[σ(f)]| (Eq. 12) against the mean m for fixed variances v.

    Exact (Gauss–Hermite), with each peak marked: zero at m = 0, largest slightly away from it (m ≈ ±1.53 for v = 1).
    """
    m = np.linspace(*mean_range, 1201)
    fig = new_figure(5.0, 3.4)
    ax = fig.add_subplot()
    for v in variances:
        line = ax.plot(m, np.abs(logistic_label_noise(m, v)), label=f"v = {v:g}")[0]
        peak_m, peak = logistic_label_noise_peak(v)
        ax.plot([-peak_m, peak_m], [peak, peak], "o", color=line.get_color(), ms=4)
    ax.set_xlabel("mean of q(f), m")
    ax.set_ylabel("label noise magnitude |ε|")
    ax.set_title("Logistic regression: |σ(m) − E_q[σ(f)]| (Eq. 12)")
    ax.legend(frameon=False)
    return save_figure(fig, output_dir, filename)


# -- Fig. 3 ------------------------------------------------------------------------------------------
def find_image_column(dataset: datasets.Dataset) -> str | None:
    """The column holding the images: an `Image` feature, else `pixel_values`/`image`/`img`; None when there is none."""
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            return name
    return next((name for name in _IMAGE_COLUMNS if name in dataset.column_names), None)


def _as_picture(value: Any) -> np.ndarray:
    """An H×W or H×W×3 array in [0, 1] from a PIL image, a C×H×W / H×W×C tensor or a flat square image."""
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 1:
        side = int(round(np.sqrt(array.size)))
        if side * side != array.size:
            raise ValueError(f"Cannot draw a flat vector of {array.size} values as a square image.")
        array = array.reshape(side, side)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = np.moveaxis(array, 0, -1)  # C×H×W -> H×W×C
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    low, high = array.min(), array.max()
    return (array - low) / (high - low) if high > low else np.zeros_like(array)


def plot_noise_extremes(
    noise: datasets.Dataset,
    dataset: datasets.Dataset,
    output_dir: str | os.PathLike,
    num_examples: int = 8,
    score: str = "noise_l2",
    image_column: str | None = None,
    class_names: Sequence[str] | None = None,
    filename: str = "label_noise_extremes.png",
) -> str:
    """Seed 000, Fig. 3: the `num_examples` examples with the highest (top row) and lowest (bottom row) `score`.

    `dataset` holds the images, indexed by the `example_index` column of `noise`. Each title gives the given label
    and, when `clean_label` is known and differs, the clean one (in red).
    """
    image_column = image_column or find_image_column(dataset)
    if image_column is None:
        raise ValueError(f"No image column in the dataset (columns: {dataset.column_names}); name it with "
                         "image_column=.")
    values = _column(noise, score)
    order = np.argsort(-values, kind="stable")
    num_examples = min(num_examples, len(order))
    rows = {"highest": order[:num_examples], "lowest": order[::-1][:num_examples]}
    index = _column(noise, "example_index")
    labels = _column(noise, "label")
    clean = _column(noise, "clean_label") if "clean_label" in noise.column_names else None
    names = _class_names(noise, int(labels.max()) + 1, class_names)
    images = dataset.with_format(None).select_columns([image_column])  # raw images, without any transform

    fig = new_figure(1.3 * num_examples, 3.2)
    axes = fig.subplots(2, num_examples, squeeze=False)
    for r, (kind, rows_) in enumerate(rows.items()):
        for c, row in enumerate(rows_):
            ax = axes[r, c]
            picture = _as_picture(images[int(index[row])][image_column])
            ax.imshow(picture, cmap="gray" if picture.ndim == 2 else None)
            ax.set_xticks([])
            ax.set_yticks([])
            title, color = f"y={names[labels[row]]}", "black"
            if clean is not None and clean[row] != labels[row]:
                title, color = f"{title}\nclean={names[clean[row]]}", "red"
            ax.set_title(f"{title}\n{values[row]:.3g}", fontsize=7, color=color)
        axes[r, 0].set_ylabel(f"{kind}\n{score}", fontsize=8)
    return save_figure(fig, output_dir, filename)


# -- Fig. 4 ------------------------------------------------------------------------------------------
#: panels of `plot_smoothed_labels` by default: every class of a 10-class task (CIFAR-10, digits), a readable page of
#: more
SMOOTHED_LABEL_PANELS = 10


def label_smoothing_targets(num_classes: int, alpha: float) -> np.ndarray:
    """Row c is label smoothing's target for class c: (1 − α)·onehot(c) + α/K (Yang et al. 2025, Eq. 1)."""
    return (1.0 - alpha) * np.eye(num_classes) + alpha / num_classes


def class_smoothed_labels(noise: datasets.Dataset) -> np.ndarray:
    """K×K matrix: row c is the mean smoothed label y + ε̄ of the examples whose given label is c (NaN if none)."""
    smoothed = _column(noise, "smoothed_label").astype(np.float64)
    labels = _column(noise, "label")
    num_classes = smoothed.shape[1]
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    sums = np.zeros((num_classes, num_classes))
    np.add.at(sums, labels, smoothed)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts[:, None]


def plot_smoothed_labels(
    noise: datasets.Dataset,
    output_dir: str | os.PathLike,
    classes: Sequence[int] | None = None,
    others: Mapping[str, np.ndarray] | None = None,
    class_names: Sequence[str] | None = None,
    filename: str = "smoothed_labels.png",
) -> str:
    """Seed 000, Fig. 4: per class, the smoothed label IVON trains on, y + ε̄, beside other methods' targets.

    For each class c in `classes` (default every class with examples, the first `SMOOTHED_LABEL_PANELS` of more)
    one panel shows, for every class k, the mean over the
    examples labelled c of (y + ε̄)_k, with whiskers from the 10th to the 90th percentile around the median; `others`
    maps a name to a K×K matrix of per-class targets drawn beside it (e.g. `{"LS α=0.1": label_smoothing_targets(K,
    0.1)}` or OLS's soft-label matrix). The y-axis is symmetric-log: IVON's smoothed labels can be slightly negative (or
    exceed 1) where the noise *sharpens* the target, which a plain log axis could not show.
    """
    smoothed = _column(noise, "smoothed_label").astype(np.float64)
    labels = _column(noise, "label")
    num_classes = smoothed.shape[1]
    present = np.unique(labels)
    classes = list(present[:SMOOTHED_LABEL_PANELS] if classes is None else classes)
    series: dict[str, np.ndarray] = {"IVON y + ε̄": class_smoothed_labels(noise), **dict(others or {})}
    for name, matrix in series.items():
        if np.shape(matrix) != (num_classes, num_classes):
            raise ValueError(f"{name!r} must be a {num_classes}×{num_classes} matrix of per-class targets, got "
                             f"{np.shape(matrix)}.")
    names = _class_names(noise, num_classes, class_names)
    width = 0.8 / len(series)
    x = np.arange(num_classes)

    columns = 1 if len(classes) <= 4 else 2
    rows = -(-len(classes) // columns)
    fig = new_figure(columns * min(16.0, max(6.0, 0.3 * num_classes * len(series) + 2.0)), 2.4 * rows)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[len(classes):]:
        fig.delaxes(ax)
    if len(classes) < len(present):
        fig.suptitle(f"{len(classes)} of the {len(present)} given labels", fontsize=9)
    for ax, c in zip(axes, classes):
        for j, (name, matrix) in enumerate(series.items()):
            offset = (j - (len(series) - 1) / 2) * width
            ax.bar(x + offset, np.asarray(matrix)[c], width, label=name)
            members = smoothed[labels == c]
            if j == 0 and len(members):  # IVON's targets differ per example: show their spread
                # around the median, not the bar's mean: a skewed class puts its mean outside the 10-90 % range,
                # and matplotlib refuses negative whiskers; the clip absorbs rounding of the interpolated quantiles
                low, median, high = np.quantile(members, [0.1, 0.5, 0.9], axis=0)
                whiskers = np.clip([median - low, high - median], 0.0, None)
                ax.errorbar(x + offset, median, yerr=whiskers, fmt="none", ecolor="black", lw=0.8, capsize=1.5)
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_xticks(x, names if num_classes <= 20 else [str(k) for k in x], fontsize=7,
                      rotation=90 if num_classes > 10 else 0)
        ax.set_title(f"given label: {names[c]}", fontsize=9)
        ax.set_ylabel("target")
    axes[0].legend(fontsize=7, frameon=False, ncols=len(series))
    fig.tight_layout()
    return save_figure(fig, output_dir, filename)


# -- the blog post (Khan 2025): the Moon picture --------------------------------------------------------------
def plot_noise_2d(
    noise: datasets.Dataset,
    points: np.ndarray,
    output_dir: str | os.PathLike,
    score: str = "noise_at_label",
    boundary: Callable[[np.ndarray], np.ndarray] | None = None,
    filename: str = "label_noise_2d.png",
) -> str:
    """The blog post (Khan 2025): 2-D inputs coloured by their label-noise magnitude, marker shape by given label.

    `points[i]` is the input of dataset row i (matched through `example_index`). `boundary`, if given, maps an
    (n, 2) array of inputs to the posterior-mean probability of class 1 and is drawn as the 0.5 contour. Wrong
    labels (when `is_corrupted` is known) are ringed in red.
    """
    points = np.asarray(points, dtype=np.float64)
    if points.ndim != 2 or points.shape[1] != 2:
        raise ValueError(f"points must have shape (n, 2), got {points.shape}.")
    xy = points[_column(noise, "example_index")]
    values = _column(noise, score)
    labels = _column(noise, "label")
    fig = new_figure(5.6, 4.2)
    ax = fig.add_subplot()
    if boundary is not None:
        pad = 0.5
        gx, gy = np.meshgrid(np.linspace(xy[:, 0].min() - pad, xy[:, 0].max() + pad, 200),
                             np.linspace(xy[:, 1].min() - pad, xy[:, 1].max() + pad, 200))
        prob = np.asarray(boundary(np.stack([gx.ravel(), gy.ravel()], 1))).reshape(gx.shape)
        ax.contour(gx, gy, prob, levels=[0.5], colors="gray", linestyles="--", linewidths=1)
    norm = Normalize(vmin=0.0, vmax=float(values.max()) or 1.0)
    for label, marker in zip(np.unique(labels), "o^sDvP*X"):
        mask = labels == label
        scatter = ax.scatter(xy[mask, 0], xy[mask, 1], c=values[mask], cmap="viridis", norm=norm, marker=marker,
                             s=22, edgecolors="none", label=f"y = {label}")
    if "is_corrupted" in noise.column_names:
        wrong = _column(noise, "is_corrupted").astype(bool)
        ax.scatter(xy[wrong, 0], xy[wrong, 1], s=60, facecolors="none", edgecolors="red", lw=0.8, label="wrong label")
    fig.colorbar(scatter, ax=ax, label=score)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    ax.set_title("Per-example label noise of variational learning")
    return save_figure(fig, output_dir, filename)
