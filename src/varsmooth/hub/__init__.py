"""Sharing on the Hub: the model card, built from a `RunRecord`; the trainer's pushes are
`varsmooth.trainer.hub.VariationalHubMixin`, and what is uploaded is the folder's manifest (`varsmooth.files`)."""

from .card import MODEL_CARD_TEMPLATE, build_model_card
from .record import RunRecord

__all__ = ["MODEL_CARD_TEMPLATE", "RunRecord", "build_model_card"]
