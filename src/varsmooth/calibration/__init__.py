"""Post-hoc calibration of any varsmooth prediction (temperature scaling)."""

from .callback import TemperatureScalingCallback, fit_on_batches, fit_trainer_temperature_scaling
from .temperature_scaling import TEMPERATURE_SCALING_FILE, TemperatureScaling, describe_prediction, network_fingerprint, scaled_nll

__all__ = ["TEMPERATURE_SCALING_FILE", "TemperatureScaling", "TemperatureScalingCallback", "describe_prediction", "fit_on_batches", "network_fingerprint", "fit_trainer_temperature_scaling", "scaled_nll"]
