"""The weight posterior: IVON's optimizer state, its detached Gaussian, prediction with it, and whether it learns."""

from .diagnostics import HESSIAN_STUCK_TOLERANCE, HessianDiagnosticsCallback, hessian_summary
from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior, std_summary
from .noise import derive_seed
from .optimizer import VariationalIVON, unwrap_ivon
from .mc_dropout import OUTPUT_DROPOUT_KEY, add_output_dropout, dropout_modules, dropout_sampling, mc_dropout_predictive
from .prediction import VariationalClassifierOutput, average_predictions, model_logits, model_outputs, predictive_distribution

__all__ = [
    "HESSIAN_STUCK_TOLERANCE",
    "OUTPUT_DROPOUT_KEY",
    "POSTERIOR_FILE",
    "DiagonalGaussianPosterior",
    "HessianDiagnosticsCallback",
    "VariationalClassifierOutput",
    "VariationalIVON",
    "add_output_dropout",
    "average_predictions",
    "derive_seed",
    "hessian_summary",
    "dropout_modules",
    "dropout_sampling",
    "mc_dropout_predictive",
    "model_logits",
    "model_outputs",
    "predictive_distribution",
    "std_summary",
    "unwrap_ivon",
]
