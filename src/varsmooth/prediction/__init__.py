"""How a trained classifier predicts: Bayesian model averaging over IVON's posterior (`bma`), the posterior
temperature τ it is made at (`temperature`), each draw's BatchNorm statistics (`batchnorm`), the other kinds of
prediction (MC dropout, deep ensembles) and the one choice between them (`predictors`), and what a saved model
loads as (`modeling`: `VariationalModel`, `ensemble`: `DeepEnsemble`, `pipelines`)."""

from .bma import predictive_distribution
from .ensemble import DeepEnsemble
from .mc_dropout import add_output_dropout, mc_dropout_predictive
from .modeling import VariationalModel
from .pipelines import pipeline
from .predictors import PosteriorPredictor, Predictor, make_predictor
from .temperature import PosteriorTemperature

__all__ = ["DeepEnsemble", "PosteriorPredictor", "PosteriorTemperature", "Predictor", "VariationalModel",
           "add_output_dropout", "make_predictor", "mc_dropout_predictive", "pipeline", "predictive_distribution"]
