"""The weight posterior: IVON's optimizer state, its detached Gaussian, and prediction with it."""

from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior
from .ivon import VariationalIVON, derive_seed, unwrap_ivon
from .mc_dropout import OUTPUT_DROPOUT_KEY, add_output_dropout, dropout_modules, dropout_sampling, mc_dropout_predictive
from .prediction import VariationalClassifierOutput, average_predictions, model_logits, predictive_distribution

__all__ = [
    "OUTPUT_DROPOUT_KEY",
    "POSTERIOR_FILE",
    "DiagonalGaussianPosterior",
    "VariationalClassifierOutput",
    "VariationalIVON",
    "add_output_dropout",
    "average_predictions",
    "derive_seed",
    "dropout_modules",
    "dropout_sampling",
    "mc_dropout_predictive",
    "model_logits",
    "predictive_distribution",
    "unwrap_ivon",
]
