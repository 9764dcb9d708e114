"""varsmooth: variational learning (IVON) as adaptive label smoothing for noisy labels, in `transformers.Trainer`."""

from . import mean_pooling_bert  # noqa: F401  (registers the mean-pooling BERT with the Auto classes)
from . import evaluation, metrics
from .adapters import LoraArguments, add_lora_adapters
from .ensemble import DeepEnsemble
from .label_noise import LabelNoiseCallback, compute_label_noise
from .mc_dropout import add_output_dropout, mc_dropout_predictive
from .metrics import classification_metrics
from .modeling import VariationalModel
from .pipelines import pipeline
from .posterior import POSTERIOR_FILE, DiagonalGaussianPosterior, VariationalClassifierOutput, VariationalIVON
from .temperature_scaling import TemperatureScaling
from .trainer import VariationalTrainer
from .training_args import VariationalTrainingArguments
from .utils import deprecated_alias

# deprecated aliases (one release): these score a trainer's predictions, so they moved from varsmooth.metrics (functions
# of arrays, below the trainer) to varsmooth.evaluation (above it); set here, since metrics may not import upwards
metrics.DEFAULT_SAMPLE_COUNTS = evaluation.DEFAULT_SAMPLE_COUNTS
for _name in ("ood_evaluation", "posterior_samples_curve", "predictive_outputs"):
    setattr(metrics, _name, deprecated_alias(f"varsmooth.metrics.{_name}", f"varsmooth.evaluation.{_name}",
                                             getattr(evaluation, _name)))
del _name

__version__ = "0.1.0"

__all__ = [
    "POSTERIOR_FILE",
    "DeepEnsemble",
    "DiagonalGaussianPosterior",
    "LabelNoiseCallback",
    "LoraArguments",
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
