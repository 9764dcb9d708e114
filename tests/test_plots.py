"""Pictures of the label noise (Variational Learning Induces Adaptive Label Smoothing (Yang et al. 2025), Fig. 2-4; the
Moon picture of its blog post): each writes a readable PNG."""

from __future__ import annotations

import os

import datasets
import matplotlib.image
import numpy as np
import PIL.Image
import pytest
import torch
from matplotlib.collections import PathCollection
from matplotlib.contour import ContourSet
from numpy.polynomial.hermite import hermgauss
from scipy.special import expit
from transformers.utils import ModelOutput

from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.label_noise import LabelNoiseCallback, plots
from varsmooth.label_noise.plots import (
    class_smoothed_labels,
    find_image_column,
    label_smoothing_targets,
    plot_noise_2d,
    plot_noise_extremes,
    plot_noise_vs_mean,
    plot_smoothed_labels,
)

K = 3


def assert_png(path: str, folder) -> None:
    assert os.path.dirname(path) == str(folder)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 50
    assert not [name for name in os.listdir(folder) if name.startswith(".tmp-")]


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, in order: what is drawn, not only that a PNG exists."""
    figures = []
    save = plots.save_figure

    def keep(fig, output_dir, filename):
        figures.append(fig)
        return save(fig, output_dir, filename)

    monkeypatch.setattr(plots, "save_figure", keep)
    return figures


def noise_table(n: int = 12, seed: int = 0) -> datasets.Dataset:
    """A hand-made label-noise result: smoothed labels y + ε with Σ_k ε_k = 0."""
    rng = np.random.default_rng(seed)
    label = np.arange(n) % K
    clean = np.where(np.arange(n) % 5 == 0, (label + 1) % K, label)
    eps = rng.normal(scale=0.01, size=(n, K))
    eps -= eps.mean(1, keepdims=True)
    return datasets.Dataset.from_dict({
        "example_index": np.arange(n)[::-1].copy(), "label": label, "clean_label": clean,
        "is_corrupted": clean != label,
        "noise": eps.astype(np.float32), "smoothed_label": (np.eye(K)[label] + eps).astype(np.float32),
        "noise_at_label": np.abs(eps[np.arange(n), label]), "noise_l2": np.linalg.norm(eps, axis=1),
    })


def test_fig2_noise_vs_mean(tmp_path, drawn):
    variances = (0.25, 1.0, 4.0)
    assert_png(plot_noise_vs_mean(tmp_path, variances=variances), tmp_path)
    (ax,) = drawn[0].axes
    curves, peaks = ax.lines[0::2], ax.lines[1::2]
    assert len(curves) == len(peaks) == len(variances)
    nodes, weights = hermgauss(80)
    for curve, peak, v in zip(curves, peaks, variances):
        m = np.asarray(curve.get_xdata())
        # |σ(m) − E_{N(m, v)}[σ(f)]| by Gauss–Hermite written out here (Yang et al. 2025, Eq. 12)
        expected = expit(m[:, None] + np.sqrt(2 * v) * nodes) @ weights / np.sqrt(np.pi)
        np.testing.assert_allclose(curve.get_ydata(), np.abs(expit(m) - expected), atol=1e-9)
        # the two markers sit on the curve's maxima, at ±m*
        top = np.argmax(curve.get_ydata())
        np.testing.assert_allclose(peak.get_ydata(), curve.get_ydata()[top], rtol=1e-3)
        np.testing.assert_allclose(np.abs(peak.get_xdata()), abs(m[top]), atol=0.02)
        assert peak.get_xdata()[0] == -peak.get_xdata()[1]


def test_fig3_extremes_from_pil_images_and_pixel_arrays(tmp_path, drawn):
    noise = noise_table()
    table = noise.with_format("numpy")[:]

    def assert_extremes(fig, pictures, score, k):
        """Top row: the k highest `score`, bottom row: the k lowest, each the image of its example_index, min-max
        scaled; wrong labels titled in red with the clean one."""
        axes = np.asarray(fig.axes).reshape(2, -1)
        order = np.argsort(-table[score], kind="stable")
        for ax_row, rows in zip(axes, (order[:k], order[::-1][:k])):
            assert len(ax_row) == k
            for ax, row in zip(ax_row, rows):
                picture = pictures[table["example_index"][row]].astype(np.float64)
                picture = (picture - picture.min()) / (picture.max() - picture.min())
                np.testing.assert_allclose(ax.images[0].get_array(), picture, atol=1e-12)
                title = ax.title.get_text()
                assert title.startswith(f"y={table['label'][row]}") and title.endswith(f"{table[score][row]:.3g}")
                wrong = table["clean_label"][row] != table["label"][row]
                assert (f"clean={table['clean_label'][row]}" in title) == wrong
                assert ax.title.get_color() == ("red" if wrong else "black")

    rng = np.random.default_rng(0)
    gray = rng.integers(0, 255, (12, 8, 8), dtype=np.uint8)
    pil = datasets.Dataset.from_dict(
        {"img": [PIL.Image.fromarray(g) for g in gray]},
        features=datasets.Features({"img": datasets.Image()}),
    )
    assert find_image_column(pil) == "img"
    assert_png(plot_noise_extremes(noise, pil, tmp_path, num_examples=4, filename="pil.png"), tmp_path)
    assert_extremes(drawn[-1], gray, "noise_l2", 4)
    flat = datasets.Dataset.from_dict({"pixel_values": rng.random((12, 64)).astype(np.float32)})
    assert_png(plot_noise_extremes(noise, flat, tmp_path, num_examples=20, score="noise_at_label", filename="flat.png"),
               tmp_path)
    assert_extremes(drawn[-1], np.asarray(flat["pixel_values"]).reshape(12, 8, 8), "noise_at_label", 12)
    chw = datasets.Dataset.from_dict({"pixel_values": rng.random((12, 3, 6, 6)).astype(np.float32)})
    assert_png(plot_noise_extremes(noise, chw, tmp_path, num_examples=3, filename="chw.png"), tmp_path)
    assert_extremes(drawn[-1], np.moveaxis(np.asarray(chw["pixel_values"]), 1, -1), "noise_l2", 3)
    with pytest.raises(ValueError, match="No image column"):
        plot_noise_extremes(noise, datasets.Dataset.from_dict({"x": list(range(12))}), tmp_path)


def test_fig4_smoothed_labels(tmp_path, drawn):
    noise = noise_table()
    targets = label_smoothing_targets(K, 0.3)
    np.testing.assert_allclose(targets.sum(1), 1.0)
    np.testing.assert_allclose(np.diag(targets), 0.7 + 0.1)  # (1 − α) + α/K
    np.testing.assert_allclose(targets[0, 1], 0.1)
    smoothed = np.asarray(noise.with_format("numpy")[:]["smoothed_label"])
    per_class = class_smoothed_labels(noise)
    for c in range(K):
        np.testing.assert_allclose(per_class[c], smoothed[np.arange(12) % K == c].mean(0), rtol=1e-6)
    ols = np.full((K, K), 1.0 / K)
    assert_png(plot_smoothed_labels(noise, tmp_path, others={"LS α=0.3": targets, "OLS": ols}), tmp_path)
    # one panel per given label c; its bars are, per series, row c of: the mean smoothed label of the examples
    # labelled c (computed here by hand), LS's targets, OLS's matrix; whiskers span IVON's 10th-90th percentile
    axes = drawn[0].axes
    assert [ax.get_title() for ax in axes] == [f"given label: {c}" for c in range(K)]
    for c, ax in enumerate(axes):
        members = smoothed[np.arange(12) % K == c]
        heights = np.asarray([bar.get_height() for bar in ax.patches]).reshape(3, K)
        np.testing.assert_allclose(heights[0], members.mean(0), rtol=1e-6)
        np.testing.assert_allclose(heights[1], targets[c])
        np.testing.assert_allclose(heights[2], ols[c])
        (whiskers,) = [coll for coll in ax.collections if len(coll.get_segments()) == K]
        spans = np.asarray([seg[:, 1] for seg in whiskers.get_segments()])
        np.testing.assert_allclose(np.sort(spans, 1), np.quantile(members, [0.1, 0.9], axis=0).T, rtol=1e-6)
    with pytest.raises(ValueError, match="matrix"):
        plot_smoothed_labels(noise, tmp_path, others={"bad": np.eye(K + 1)})


def test_moon_picture(tmp_path, drawn):
    noise = noise_table()
    points = np.random.default_rng(1).normal(size=(12, 2))
    path = plot_noise_2d(noise, points, tmp_path, boundary=lambda xy: 1 / (1 + np.exp(-xy[:, 0])))
    assert_png(path, tmp_path)
    table = noise.with_format("numpy")[:]
    ax = drawn[0].axes[0]
    scatters = [coll for coll in ax.collections if isinstance(coll, PathCollection)]
    # one scatter per given label at the inputs of its examples (row i is example example_index[i]), coloured by
    # |ε̄_y|, then red rings on the wrong labels
    for label, scatter in zip(range(K), scatters):
        rows = table["label"] == label
        np.testing.assert_allclose(scatter.get_offsets(), points[table["example_index"][rows]])
        np.testing.assert_allclose(scatter.get_array(), table["noise_at_label"][rows])
    np.testing.assert_allclose(scatters[K].get_offsets(), points[table["example_index"][table["is_corrupted"]]])
    # the boundary σ(x) = 0.5 is the line x = 0
    assert len(scatters) == K + 1
    (boundary,) = [coll for coll in ax.collections if isinstance(coll, ContourSet)]
    vertices = np.concatenate([path.vertices for path in boundary.get_paths()])
    assert len(vertices) and np.abs(vertices[:, 0]).max() < 0.02
    with pytest.raises(ValueError, match="shape"):
        plot_noise_2d(noise, points[:, :1], tmp_path)


class TinyImageClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, K)

    def forward(self, pixel_values, labels=None):
        return ModelOutput(logits=self.net(pixel_values.flatten(1)))


def test_callback_draws_figures_for_images(tmp_path, drawn):
    """Images decoded on the fly by `with_transform` (the usual vision set-up): the Trainer's collator batches
    the transform's output, the figures read the raw images."""
    rng = np.random.default_rng(0)
    label = np.arange(24) % K
    pictures = [PIL.Image.fromarray((rng.random((4, 4)) * 60 + 60 * y).astype(np.uint8)) for y in label]
    data = datasets.Dataset.from_dict(
        {"image": pictures, "label": label, "clean_label": label},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=K),
                                    "clean_label": datasets.ClassLabel(num_classes=K)}),
    )

    def to_pixels(batch):
        pixels = [torch.as_tensor(np.asarray(im, dtype=np.float32) / 255.0)[None] for im in batch["image"]]
        return {"pixel_values": pixels, "labels": batch["label"]}

    def collate(rows):
        return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
                "labels": torch.tensor([r["labels"] for r in rows])}

    args = VariationalTrainingArguments(
        output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=8, learning_rate=0.05,
        method_config={"beta2": 0.99},
        report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    torch.manual_seed(0)
    trainer = VariationalTrainer(TinyImageClassifier(), args, train_dataset=data.with_transform(to_pixels),
                                 data_collator=collate, callbacks=[LabelNoiseCallback(num_samples=4, plots=True)])
    trainer.train()
    assert_png(str(tmp_path / "label_noise_smoothed_labels.png"), tmp_path)
    assert_png(str(tmp_path / "label_noise_extremes.png"), tmp_path)
    noise = datasets.Dataset.from_parquet(str(tmp_path / "label_noise.parquet"))
    assert noise["label"][:] == list(label) and noise.features["clean_label"] == data.features["clean_label"]
    # the pictures show the exported numbers: per class the mean smoothed label, and the raw images of the
    # examples with the highest / lowest ‖ε̄‖₂
    smoothed_figure, extremes_figure = drawn
    table = noise.with_format("numpy")[:]
    for c, ax in enumerate(smoothed_figure.axes):
        heights = [bar.get_height() for bar in ax.patches]
        np.testing.assert_allclose(heights, table["smoothed_label"][label == c].mean(0), rtol=1e-5)
    order = np.argsort(-table["noise_l2"], kind="stable")
    axes = np.asarray(extremes_figure.axes).reshape(2, -1)
    for ax_row, rows in zip(axes, (order[:8], order[::-1][:8])):
        for ax, row in zip(ax_row, rows):
            picture = np.asarray(pictures[table["example_index"][row]], dtype=np.float64)
            np.testing.assert_allclose(ax.images[0].get_array(), (picture - picture.min()) / np.ptp(picture))


def _noise_from(smoothed: np.ndarray, label: np.ndarray) -> datasets.Dataset:
    smoothed = np.asarray(smoothed, dtype=np.float32)
    eps = smoothed - np.eye(smoothed.shape[1], dtype=np.float32)[label]
    return datasets.Dataset.from_dict({
        "example_index": np.arange(len(label)), "label": label, "noise": eps, "smoothed_label": smoothed,
        "noise_at_label": np.abs(eps[np.arange(len(label)), label]), "noise_l2": np.linalg.norm(eps, axis=1),
    })


def _skewed() -> datasets.Dataset:
    # class 0: 19 targets of exactly onehot(0) and one far off: the mean of class 1's target (0.05) lies above its
    # 90th percentile (0.0), so whiskers drawn around the mean would have a negative length
    smoothed = np.tile(np.eye(K)[0], (20, 1))
    smoothed[0] = [0.0, 1.0, 0.0]
    return _noise_from(smoothed, np.zeros(20, dtype=int))


DEGENERATE = {
    "skewed": _skewed,
    "one_example": lambda: _noise_from(np.eye(K)[[2]] + [[0.01, -0.02, 0.01]], np.array([2])),
    "constant": lambda: _noise_from(np.full((6, K), 1.0 / K), np.arange(6) % K),
    "single_class_present": lambda: _noise_from(np.eye(K)[np.ones(5, dtype=int)], np.ones(5, dtype=int)),
    "one_class": lambda: _noise_from(np.ones((4, 1)), np.zeros(4, dtype=int)),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_every_picture_draws_skewed_and_degenerate_label_noise(tmp_path, case):
    noise = DEGENERATE[case]()
    n = len(noise)
    assert_png(plot_smoothed_labels(noise, tmp_path), tmp_path)
    images = datasets.Dataset.from_dict({"pixel_values": np.full((n, 16), 0.5, dtype=np.float32)})  # constant images
    assert_png(plot_noise_extremes(noise, images, tmp_path), tmp_path)
    assert_png(plot_noise_2d(noise, np.zeros((n, 2)), tmp_path, boundary=lambda xy: np.full(len(xy), 0.5)), tmp_path)


def test_smoothed_label_whiskers_span_the_quantiles_around_the_median(tmp_path, monkeypatch):
    """The whiskers are drawn from the 10th to the 90th percentile around the median, which lies between them."""
    from matplotlib.axes import Axes

    drawn = []
    original = Axes.errorbar

    def record(self, x, y, yerr=None, **kwargs):
        drawn.append((np.asarray(y), np.asarray(yerr)))
        return original(self, x, y, yerr=yerr, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", record)
    plot_smoothed_labels(_skewed(), tmp_path)
    (center, (below, above)), = drawn
    members = np.eye(K)[[1] + [0] * 19]
    np.testing.assert_allclose(center, np.median(members, 0), atol=1e-7)
    np.testing.assert_allclose(center - below, np.quantile(members, 0.1, axis=0), atol=1e-7)
    np.testing.assert_allclose(center + above, np.quantile(members, 0.9, axis=0), atol=1e-7)


def test_smoothed_labels_show_every_class_of_a_ten_class_task_and_the_model_names(tmp_path, drawn):
    """Ten classes: ten panels (not the first four), titled by the class names given (the callback passes the model's
    id2label, which a dataset without a ClassLabel column lacks)."""
    classes = 10
    labels = np.arange(40) % classes
    noise = datasets.Dataset.from_dict({"label": labels, "smoothed_label": np.eye(classes, dtype=np.float32)[labels]})
    names = [f"class {k}" for k in range(classes)]
    plot_smoothed_labels(noise, tmp_path, class_names=names)
    assert [ax.get_title() for ax in drawn[-1].axes] == [f"given label: {n}" for n in names]


def test_the_reliability_diagrams_legend_shows_the_bars_as_drawn(tmp_path, monkeypatch):
    """One overconfident and one underconfident bin: the gap bar over the accuracy bar is not blended into a colour
    the legend lacks."""
    from varsmooth import figures

    drawn, save = [], figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda fig, out, name: drawn.append(fig) or save(fig, out, name))
    diagram = {"edges": np.linspace(0, 1, 11), "count": np.array([0, 0, 0, 0, 0, 5, 0, 0, 5, 0]),
               "confidence": np.array([0, 0, 0, 0, 0, 0.55, 0, 0, 0.85, 0]),
               "accuracy": np.array([0, 0, 0, 0, 0, 0.8, 0, 0, 0.6, 0])}
    figures.plot_reliability_diagram(diagram, tmp_path)
    top = drawn[-1].axes[0]
    legend = top.get_legend()
    for handle, text in zip(legend.legend_handles, legend.get_texts()):
        (bars,) = [c for c in top.containers if c.get_label() == text.get_text()] or [None]
        if bars is None:  # the diagonal
            continue
        for bar in bars:
            assert bar.get_alpha() in (None, 1.0) and (bar.get_fill() is False or text.get_text() == "accuracy")
            assert (bar.get_hatch(), bar.get_fill()) == (handle.get_hatch(), handle.get_fill())
            np.testing.assert_allclose(bar.get_edgecolor(), handle.get_edgecolor())
            if bar.get_fill():
                np.testing.assert_allclose(bar.get_facecolor(), handle.get_facecolor())

