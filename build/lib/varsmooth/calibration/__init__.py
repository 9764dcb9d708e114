"""Deprecated name of `varsmooth.temperature_scaling` (one release): "calibration" also named the calibration
metrics (`varsmooth.metrics`), and the posterior has a temperature of its own."""

import warnings

from ..temperature_scaling import *  # noqa: F401,F403
from ..temperature_scaling import __all__  # noqa: F401

warnings.warn("varsmooth.calibration is deprecated and will be removed in the next release: use "
              "varsmooth.temperature_scaling.", FutureWarning, stacklevel=2)
