"""Hyperparameter grids of the papers, for the benchmark sweeps (robustness.py).

Keys are `VariationalTrainingArguments` fields or fields of the method's config; `grid_points` turns one grid
point into keyword arguments for `VariationalTrainingArguments` (the method's fields nested in `method_config`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from varsmooth.methods import get_method_config_class

__all__ = ["DEFAULT_GRIDS", "grid_points"]

DEFAULT_GRIDS: dict[str, dict[str, list[Any]]] = {
    # "Variational Learning Induces Adaptive Label Smoothing" (2025) §4.3 / App. C: LS rates; SAM ρ "from
    # [0.01, 0.05, 0.1, 0.2, 0.5]" following Foret et al.
    "ls": {"method": ["ls"], "smoothing": [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]},
    "sam": {"method": ["sam"], "sam_rho": [0.01, 0.05, 0.1, 0.2, 0.5]},
    # the same paper's data-dependent-noise experiment (ρ = 0 is the base optimizer at twice the cost)
    "sam_data_dependent": {"method": ["sam"], "sam_rho": [0.0, 0.05, 0.1, 0.15, 0.2, 0.5]},
    # smooth-rate grid of the reference code of Wei et al. 2022 (UCSC-REAL/negative-label-smoothing)
    "gls": {"method": ["gls"],
            "gls_rate": [0.8, 0.6, 0.4, 0.2, 0.0, -0.2, -0.4, -0.6, -0.8, -1.0, -2.0, -4.0, -6.0, -8.0]},
}


def grid_points(grid: str, grids: dict[str, dict[str, list[Any]]] = DEFAULT_GRIDS) -> list[dict[str, Any]]:
    """Every combination of the values of `grids[grid]`, as keyword arguments for `VariationalTrainingArguments`:
    the method's own fields go into `method_config`."""
    if grid not in grids:
        raise KeyError(f"Unknown grid {grid!r}; choose one of {sorted(grids)}.")
    names = list(grids[grid])
    points = []
    for values in itertools.product(*(grids[grid][n] for n in names)):
        point = dict(zip(names, values))
        own = {f.name for f in dataclasses.fields(get_method_config_class(point.get("method", "ivon")))}
        config = {n: point.pop(n) for n in names if n in own}
        points.append({**point, "method_config": config} if config else point)
    return points
