"""Temperature scaling (Guo et al. 2017): one logit temperature T, fitted after training, that calibrates any varsmooth
prediction (BMA, the posterior mean, MC dropout, an ensemble). Not the posterior temperature τ, which scales the
posterior's σ (`varsmooth.prediction.temperature`)."""

from .fit import fit_on_batches
from .scaling import TEMPERATURE_SCALING_FILE, TemperatureScaling, network_fingerprint, scaled_nll

__all__ = ["TEMPERATURE_SCALING_FILE", "TemperatureScaling", "fit_on_batches", "network_fingerprint", "scaled_nll"]
