"""Small helpers shared across the package."""

from __future__ import annotations

from typing import Any

__all__ = ["length_order"]


def length_order(dataset: Any, column: str = "input_ids") -> list[int] | None:
    """The rows of a tokenized `dataset` from shortest to longest `column` (stable), or None when it has no such column
    (images, a transform): batches in this order pad each sequence to about its own length. Label-noise export and
    the choice of τ run S forward passes over a split, and batches of sentences in dataset order padded to their
    longest (the collator's rule) cost about twice as much."""
    names = getattr(dataset, "column_names", None) or ()
    if column not in names or (getattr(dataset, "format", None) or {}).get("type") == "custom":
        return None
    lengths = [len(ids) for ids in dataset.with_format(None)[column]]
    return sorted(range(len(lengths)), key=lengths.__getitem__)

