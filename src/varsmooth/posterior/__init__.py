"""The weight posterior: IVON's optimizer state, its detached Gaussian, prediction with it, and whether it learns."""

from .diagnostics import HESSIAN_STUCK_TOLERANCE, HessianDiagnosticsCallback, hessian_summary
from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior, std_summary
from .optimizer import VariationalIVON, unwrap_ivon
from .prediction import (
    VariationalClassifierOutput,
    average_predictions,
    model_logits,
    model_outputs,
    predictive_distribution,
)
from .seeds import derive_seed

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
