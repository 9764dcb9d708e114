"""Training methods behind one interface: IVON and the baselines it is compared with, each with its own config.

`list_methods()` describes them; `register_method(name, config_cls, method_cls)` adds one.
"""

from .alasca import ALASCAConfig, ALASCAMethod
from .base import (
    EXAMPLE_INDEX_KEY,
    METHODS,
    CallbackContext,
    ExampleIndexDataset,
    MethodConfig,
    MethodContext,
    MethodInfo,
    OptimizerContext,
    TrainingMethod,
    build_method_config,
    get_method_class,
    get_method_config_class,
    learns_posterior,
    list_methods,
    register_method,
)
from .gce import GCEConfig, GCEMethod
from .ivon import IVONConfig, IVONFixedHessianMethod, IVONMethod
from .label_smoothing import (
    GeneralizedLabelSmoothingConfig,
    GeneralizedLabelSmoothingMethod,
    LabelSmoothingConfig,
    LabelSmoothingMethod,
    optimal_smoothing_rate,
)
from .logistic_normal import LogisticNormalConfig, LogisticNormalMethod
from .ols import OnlineLabelSmoothingConfig, OnlineLabelSmoothingMethod
from .sam import SAMConfig, SAMMethod

__all__ = [
    "ALASCAConfig",
    "CallbackContext",
    "ALASCAMethod",
    "EXAMPLE_INDEX_KEY",
    "ExampleIndexDataset",
    "GCEConfig",
    "GCEMethod",
    "GeneralizedLabelSmoothingConfig",
    "GeneralizedLabelSmoothingMethod",
    "IVONConfig",
    "IVONFixedHessianMethod",
    "IVONMethod",
    "LabelSmoothingConfig",
    "LabelSmoothingMethod",
    "LogisticNormalConfig",
    "LogisticNormalMethod",
    "METHODS",
    "MethodConfig",
    "MethodContext",
    "MethodInfo",
    "OnlineLabelSmoothingConfig",
    "OnlineLabelSmoothingMethod",
    "OptimizerContext",
    "SAMConfig",
    "SAMMethod",
    "TrainingMethod",
    "build_method_config",
    "get_method_class",
    "get_method_config_class",
    "learns_posterior",
    "list_methods",
    "optimal_smoothing_rate",
    "register_method",
]
