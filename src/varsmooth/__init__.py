"""varsmooth: variational learning (IVON) as adaptive label smoothing for noisy labels, in `transformers.Trainer`."""

# varsmooth.evaluation scores a trainer (README); importing mean_pooling_bert registers its BERT with the Auto classes
from . import evaluation, mean_pooling_bert  # noqa: F401
from .adapters import LoraArguments, add_lora_adapters
from .label_noise import LabelNoiseCallback, compute_label_noise
from .metrics import classification_metrics
from .outputs import VariationalClassifierOutput
from .posterior import POSTERIOR_FILE, DiagonalGaussianPosterior, VariationalIVON
from .prediction import (
    DeepEnsemble,
    PosteriorTemperature,
    VariationalModel,
    add_output_dropout,
    mc_dropout_predictive,
    pipeline,
)
from .temperature_scaling import TemperatureScaling
from .trainer import VariationalTrainer, VariationalTrainingArguments

__version__ = "0.1.0"

__all__ = [
    "POSTERIOR_FILE",
    "DeepEnsemble",
    "DiagonalGaussianPosterior",
    "LabelNoiseCallback",
    "LoraArguments",
    "PosteriorTemperature",
    "TemperatureScaling",
    "VariationalClassifierOutput",
    "VariationalIVON",
    "VariationalModel",
    "VariationalTrainer",
    "VariationalTrainingArguments",
    "add_lora_adapters",
    "add_output_dropout",
    "classification_metrics",
    "compute_label_noise",
    "mc_dropout_predictive",
    "pipeline",
]
