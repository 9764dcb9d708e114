"""Deprecated name of `varsmooth.posterior.seeds` (one release): the package has three other "noise"s (the label
corruption, the label noise ε̄ and IVON's weight noise), and this module only derives seeds."""

import warnings

from .seeds import derive_seed  # noqa: F401

__all__ = ["derive_seed"]

warnings.warn("varsmooth.posterior.noise is deprecated and will be removed in the next release: use "
              "varsmooth.posterior.seeds.", FutureWarning, stacklevel=2)
