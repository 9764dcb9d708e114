"""Training methods behind one interface: IVON and the baselines of the seed papers."""

from .base import METHODS, TrainingMethod, get_method_class, register_method
from .ivon import IVONFixedHessianMethod, IVONMethod

__all__ = ["METHODS", "IVONFixedHessianMethod", "IVONMethod", "TrainingMethod", "get_method_class", "register_method"]
