"""Sharing on the Hub: the model card, built from a `RunRecord`, and the trainer's pushes (`VariationalHubMixin`);
what is uploaded is the folder's manifest (`varsmooth.files`)."""

from .card import MODEL_CARD_TEMPLATE, build_model_card
from .mixin import VariationalHubMixin
from .record import RunRecord

__all__ = ["MODEL_CARD_TEMPLATE", "RunRecord", "VariationalHubMixin", "build_model_card"]
