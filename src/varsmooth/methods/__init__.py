"""Training methods behind one interface: IVON and the baselines of the seed papers."""

from .alasca import ALASCAMethod
from .base import EXAMPLE_INDEX_KEY, METHODS, ExampleIndexDataset, TrainingMethod, get_method_class, register_method
from .gce import GCEMethod
from .grids import DEFAULT_GRIDS, grid_points
from .ivon import IVONFixedHessianMethod, IVONMethod
from .label_smoothing import GeneralizedLabelSmoothingMethod, LabelSmoothingMethod, optimal_smoothing_rate
from .logistic_normal import LogisticNormalMethod
from .ols import OnlineLabelSmoothingMethod
from .sam import SAMMethod

__all__ = [
    "ALASCAMethod",
    "DEFAULT_GRIDS",
    "EXAMPLE_INDEX_KEY",
    "ExampleIndexDataset",
    "GCEMethod",
    "GeneralizedLabelSmoothingMethod",
    "IVONFixedHessianMethod",
    "IVONMethod",
    "LabelSmoothingMethod",
    "LogisticNormalMethod",
    "METHODS",
    "OnlineLabelSmoothingMethod",
    "SAMMethod",
    "TrainingMethod",
    "get_method_class",
    "grid_points",
    "optimal_smoothing_rate",
    "register_method",
]
