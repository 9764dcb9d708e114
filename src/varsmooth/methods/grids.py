"""Hyperparameter grids of the seed papers, for the benchmark sweeps.

Keys are `VariationalTrainingArguments` fields, so one grid point is a set of keyword arguments.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["DEFAULT_GRIDS", "grid_points"]

DEFAULT_GRIDS: dict[str, dict[str, list[Any]]] = {
    # seed 000 §4.3 / App. C: LS rates; SAM ρ "from [0.01, 0.05, 0.1, 0.2, 0.5]" following Foret et al.
    "ls": {"method": ["ls"], "smoothing": [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]},
    "sam": {"method": ["sam"], "sam_rho": [0.01, 0.05, 0.1, 0.2, 0.5]},
    # seed 000 data-dependent-noise experiment (ρ = 0 is the base optimizer at twice the cost)
    "sam_data_dependent": {"method": ["sam"], "sam_rho": [0.0, 0.05, 0.1, 0.15, 0.2, 0.5]},
    # seed 003 reference code (UCSC-REAL/negative-label-smoothing) smooth-rate grid
    "gls": {"method": ["gls"], "gls_rate": [0.8, 0.6, 0.4, 0.2, 0.0, -0.2, -0.4, -0.6, -0.8, -1.0, -2.0, -4.0, -6.0, -8.0]},
}


def grid_points(grid: str, grids: dict[str, dict[str, list[Any]]] = DEFAULT_GRIDS) -> list[dict[str, Any]]:
    """Every combination of the values of `grids[grid]`, as keyword arguments for `VariationalTrainingArguments`."""
    if grid not in grids:
        raise KeyError(f"Unknown grid {grid!r}; choose one of {sorted(grids)}.")
    names = list(grids[grid])
    return [dict(zip(names, values)) for values in itertools.product(*(grids[grid][n] for n in names))]
