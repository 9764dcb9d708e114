"""Sharing on the Hub: the model card (what is uploaded is the folder's manifest, `varsmooth.files`)."""

from .card import MODEL_CARD_TEMPLATE, build_model_card

__all__ = ["MODEL_CARD_TEMPLATE", "build_model_card"]
