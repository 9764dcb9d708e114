"""The weight posterior: IVON's optimizer state, its detached Gaussian, and prediction with it."""

from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior
from .optimizer import VariationalIVON, derive_seed, unwrap_ivon
from .prediction import VariationalClassifierOutput, model_logits, predictive_distribution

__all__ = [
    "POSTERIOR_FILE",
    "DiagonalGaussianPosterior",
    "VariationalClassifierOutput",
    "VariationalIVON",
    "derive_seed",
    "model_logits",
    "predictive_distribution",
    "unwrap_ivon",
]
