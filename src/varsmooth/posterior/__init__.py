"""The weight posterior q = N(m, diag σ²): IVON's optimizer (`optimizer`, `kernels`), its detached Gaussian
(`gaussian`), each draw's BatchNorm statistics (`draw_buffers`), resume (`resume`) and whether the Hessian learns
(`diagnostics`). Nothing here knows of `transformers`: predicting with a model is `varsmooth.prediction`'s."""

from .diagnostics import HESSIAN_STUCK_TOLERANCE, hessian_summary
from .gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior, std_summary
from .optimizer import VariationalIVON, unwrap_ivon
from .seeds import derive_seed

__all__ = [
    "HESSIAN_STUCK_TOLERANCE",
    "POSTERIOR_FILE",
    "DiagonalGaussianPosterior",
    "VariationalIVON",
    "derive_seed",
    "hessian_summary",
    "std_summary",
    "unwrap_ivon",
]
