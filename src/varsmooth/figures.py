"""Figures varsmooth draws: matplotlib's Agg canvas without pyplot, each PNG written atomically; the reliability
diagram of a model card here, the pictures of the label noise in `varsmooth.label_noise.plots`."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .files import atomic_path

__all__ = ["new_figure", "plot_reliability_diagram", "save_figure"]


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib figure drawn by the Agg canvas: no display and no global pyplot state."""
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # attaches itself to the figure: Agg rendering without pyplot
    return fig


def save_figure(fig: Figure, output_dir: str | os.PathLike, filename: str) -> str:
    """Write `fig` as `output_dir/filename` (PNG), whole or not at all (`varsmooth.files.atomic_path`); returns the
    path."""
    path = os.path.join(output_dir, filename)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    return path


def plot_reliability_diagram(
    diagram: Mapping[str, np.ndarray],
    output_dir: str | os.PathLike,
    filename: str = "reliability_diagram.png",
    title: str = "Reliability diagram",
) -> str:
    """Accuracy against confidence per bin (Guo et al. 2017, Fig. 1) from `varsmooth.metrics.reliability_diagram`
    data: a bar per non-empty bin at its mean confidence, the diagonal of perfect calibration, and the share of
    examples per bin below. The ECE of the bins is in the title."""
    count = np.asarray(diagram["count"], dtype=np.float64)
    if count.sum() == 0:
        raise ValueError("The reliability diagram has no examples (all bins are empty): evaluate on labelled data "
                         "first.")
    edges = np.asarray(diagram["edges"], dtype=np.float64)
    conf, acc = np.asarray(diagram["confidence"]), np.asarray(diagram["accuracy"])
    filled = count > 0
    widths = np.diff(edges)
    ece = float((count[filled] * np.abs(acc[filled] - conf[filled])).sum() / count.sum())
    fig = new_figure(4.2, 4.8)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.bar(edges[:-1][filled], acc[filled], width=widths[filled], align="edge", color="tab:blue", edgecolor="white",
            label="accuracy")
    # hatched, not translucent: over an accuracy bar (an underconfident bin) a translucent fill would blend into a
    # colour the legend does not show
    top.bar(edges[:-1][filled], conf[filled] - acc[filled], bottom=acc[filled], width=widths[filled], align="edge",
            fill=False, hatch="////", edgecolor="tab:red", linewidth=0.8, label="gap to confidence")
    top.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    top.legend(fontsize=7, frameon=False, loc="upper left")
    top.set_title(f"{title} (ECE {100 * ece:.2f} %)")
    bottom.bar(edges[:-1][filled], count[filled] / count.sum(), width=widths[filled], align="edge", color="gray")
    bottom.set_xlim(0, 1)
    bottom.set_xlabel("confidence (maximum probability)")
    bottom.set_ylabel("share")
    return save_figure(fig, output_dir, filename)
