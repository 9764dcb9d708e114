"""Per-example label noise of variational learning (Variational Learning Induces Adaptive Label Smoothing (2025),
Eq. 12, 15, 19): compute, export, judge, and theory."""

from .callback import LabelNoiseCallback
from .compute import (
    EXPORT_NUM_SAMPLES,
    MAGNITUDE_COLUMNS,
    METADATA_COLUMNS,
    compute_label_noise,
    summarize_label_noise,
    write_label_noise,
)
from .detection import SUSPICION_SCORES, detection_metrics, mislabel_detection_report, suspicion_scores
from .mixin import LabelNoiseMixin
from .strength import LabelNoiseSums, SmoothingStrengthCallback, label_smoothing_noise, mean_label_noise
from .theory import expected_sigmoid, logistic_label_noise, logistic_label_noise_peak, logistic_label_noise_rms

__all__ = [
    "EXPORT_NUM_SAMPLES",
    "MAGNITUDE_COLUMNS",
    "METADATA_COLUMNS",
    "SUSPICION_SCORES",
    "LabelNoiseCallback",
    "LabelNoiseMixin",
    "LabelNoiseSums",
    "SmoothingStrengthCallback",
    "compute_label_noise",
    "detection_metrics",
    "label_smoothing_noise",
    "expected_sigmoid",
    "logistic_label_noise",
    "logistic_label_noise_peak",
    "logistic_label_noise_rms",
    "mean_label_noise",
    "mislabel_detection_report",
    "summarize_label_noise",
    "suspicion_scores",
    "write_label_noise",
]
