"""Datasets that ship with packages, as `datasets.DatasetDict`s (the examples' offline defaults)."""

from __future__ import annotations

import datasets
import numpy as np

__all__ = ["load_digits_dataset"]


def load_digits_dataset(test_size: float = 0.2, seed: int = 0) -> datasets.DatasetDict:
    """scikit-learn's 1797 8x8 handwritten digits as grayscale images, split into stratified train/test.

    Real data that ships with scikit-learn, so the examples and tests run with no network.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])})
    ds = datasets.Dataset.from_dict({"image": list(images), "label": digits.target.tolist()}, features=features)
    return ds.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")
