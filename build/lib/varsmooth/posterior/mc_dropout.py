"""Deprecated name of `varsmooth.mc_dropout` (one release): MC dropout is not IVON's posterior."""

import warnings

from ..mc_dropout import *  # noqa: F401,F403
from ..mc_dropout import __all__  # noqa: F401

warnings.warn("varsmooth.posterior.mc_dropout is deprecated and will be removed in the next release: use "
              "varsmooth.mc_dropout.", FutureWarning, stacklevel=2)
