"""The weight posterior: IVON's optimizer state, its detached Gaussian, prediction with it, and whether it learns."""

import warnings

from .diagnostics import HESSIAN_STUCK_TOLERANCE, HessianDiagnosticsCallback, hessian_summary
from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior, std_summary
from .seeds import derive_seed
from .optimizer import VariationalIVON, unwrap_ivon
from .prediction import VariationalClassifierOutput, average_predictions, model_logits, model_outputs, predictive_distribution

__all__ = [
    "HESSIAN_STUCK_TOLERANCE",
    "POSTERIOR_FILE",
    "DiagonalGaussianPosterior",
    "HessianDiagnosticsCallback",
    "VariationalClassifierOutput",
    "VariationalIVON",
    "average_predictions",
    "derive_seed",
    "hessian_summary",
    "model_logits",
    "model_outputs",
    "predictive_distribution",
    "std_summary",
    "unwrap_ivon",
]

#: MC dropout moved to `varsmooth.mc_dropout` (it is not IVON's posterior): its names here are deprecated aliases
_MOVED_TO_MC_DROPOUT = ("OUTPUT_DROPOUT_KEY", "add_output_dropout", "dropout_modules", "dropout_sampling", "mc_dropout_predictive")


def __getattr__(name: str):
    if name in _MOVED_TO_MC_DROPOUT:
        from .. import mc_dropout

        warnings.warn(f"varsmooth.posterior.{name} is deprecated and will be removed in the next release: use "
                      f"varsmooth.mc_dropout.{name}.", FutureWarning, stacklevel=2)
        return getattr(mc_dropout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
