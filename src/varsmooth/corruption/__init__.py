"""Label corruption as `datasets` transforms: synthetic noise with known transition matrices, real human noise from a
column, and a JSON-safe [`NoiseReport`][varsmooth.corruption.NoiseReport] of what was intended and realized."""

from .arguments import CorruptionArguments
from .corrupt import corrupt_labels, noise_report, realized_noise_report
from .transition import (
    ASYMMETRIC_CLASS_MAPS,
    NOISE_REPORT_FILE,
    NOISE_TYPES,
    NoiseReport,
    asymmetric_transition,
    classwise_transition,
    pairflip_transition,
    realized_transition,
    symmetric_transition,
    uniform_transition,
)

__all__ = [
    "ASYMMETRIC_CLASS_MAPS",
    "NOISE_REPORT_FILE",
    "NOISE_TYPES",
    "CorruptionArguments",
    "NoiseReport",
    "corrupt_labels",
    "noise_report",
    "realized_noise_report",
    "asymmetric_transition",
    "classwise_transition",
    "pairflip_transition",
    "realized_transition",
    "symmetric_transition",
    "uniform_transition",
]
