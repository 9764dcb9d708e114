"""Instance-dependent label noise of Xia et al. 2020, "Part-dependent label noise" (NeurIPS),
reference ``tools.py::get_instance_noisy_label`` (xiaoboxia/Part-dependent-label-noise).

For example i with clean class y and features x (flattened, unnormalised as in the reference):
``q_i ~ TruncNormal(rate, norm_std², [0, 1])``, ``a = x W[y]`` with ``W ~ N(0, 1)`` of shape (K, D, K),
``a_y = -inf``, ``p = q_i softmax(a)`` and ``p_y += 1 - q_i``; the noisy label is drawn from ``p``.
"""

from __future__ import annotations

import numpy as np
from datasets import Array2D, Array3D, Array4D, Array5D, Dataset, Image, LargeList, List, Value
from scipy.stats import truncnorm

from ._rng import INSTANCE_RATE_STREAM, INSTANCE_WEIGHT_STREAM, normals, uniforms


def _is_numeric(dtype: str) -> bool:
    try:
        return np.dtype(dtype).kind in "iufb"
    except TypeError:  # "string", "binary", "null", ... are Arrow names numpy does not know
        return False


def _is_feature_vector(feature: object) -> bool:
    """Image, fixed-shape array, or (nested) list of numbers: anything that flattens to a float vector."""
    if isinstance(feature, Image):
        return True
    if isinstance(feature, (Array2D, Array3D, Array4D, Array5D)):
        return _is_numeric(feature.dtype)
    if isinstance(feature, (List, LargeList)):
        inner = feature.feature
        return _is_numeric(inner.dtype) if isinstance(inner, Value) else _is_feature_vector(inner)
    return False


def resolve_feature_column(dataset: Dataset, feature_column: str | None, label_column: str) -> str:
    """Pick the column that instance noise reads: the one named, or the only usable one."""
    usable = [
        name for name, feature in dataset.features.items() if name != label_column and _is_feature_vector(feature)
    ]
    if feature_column is None:
        if len(usable) == 1:
            return usable[0]
        found = f"candidates: {usable}" if usable else f"columns: {dataset.column_names}"
        raise ValueError(
            "instance noise (Xia et al. 2020) needs per-example features: pass feature_column= naming an image "
            f"column or a numeric array/list column (pixels or an embedding); {found}."
        )
    if feature_column not in dataset.column_names:
        raise ValueError(
            f"feature_column {feature_column!r} is not a column of the dataset; columns: {dataset.column_names}."
        )
    if not _is_feature_vector(dataset.features[feature_column]):
        raise ValueError(
            f"feature_column {feature_column!r} has feature {dataset.features[feature_column]}, which is not an "
            "image or numeric array; instance noise needs pixels or an embedding. Usable columns: "
            f"{usable or 'none (add an embedding column first)'}."
        )
    return feature_column


def _as_matrix(values: object, column: str) -> np.ndarray:
    """Flatten a batch of images/arrays to an (n, D) float64 matrix; ragged batches are an error."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values.reshape(len(values), -1).astype(np.float64)
    vectors = [np.asarray(v, dtype=np.float64).ravel() for v in values]
    if len({len(v) for v in vectors}) > 1:
        raise ValueError(
            f"instance noise needs features of one size, but column {column!r} holds examples of different "
            "sizes; resize the images (or pad the arrays) to a common shape first."
        )
    return np.stack(vectors)


def instance_noise_rows(
    dataset: Dataset,
    clean: np.ndarray,
    *,
    feature_column: str,
    rate: float,
    norm_std: float,
    seed: int,
    num_classes: int,
    batch_size: int = 1024,
) -> np.ndarray:
    """Per-example noise distributions ``p_i`` (N, K) of Xia et al. 2020 (see the module docstring).

    ``q_i`` comes from example i's own uniform (seed, row index) and ``W[y]`` from (seed, y), so the result
    does not depend on dataset order beyond the row index. Examples are visited class by class so that
    each class's (D, K) weight block is generated once and never the whole (K, D, K) tensor.
    """
    lower, upper = (0.0 - rate) / norm_std, (1.0 - rate) / norm_std
    # Inverse-CDF sampling of the truncated normal keeps q_i a function of example i's uniform alone.
    q = truncnorm.ppf(uniforms(seed, INSTANCE_RATE_STREAM, len(clean)), lower, upper, loc=rate, scale=norm_std)
    rows = np.zeros((len(clean), num_classes))
    columns = dataset.select_columns([feature_column])
    dim = None
    for c in range(num_classes):
        members = np.flatnonzero(clean == c)
        if len(members) == 0:
            continue
        subset = columns.select(members).with_format("numpy")
        weights = None
        for start in range(0, len(members), batch_size):
            x = _as_matrix(subset[start : start + batch_size][feature_column], feature_column)
            if dim is None:
                dim = x.shape[1]
            if not np.isfinite(x).all():
                raise ValueError(
                    f"instance noise needs finite features, but column {feature_column!r} holds NaN or infinite values "
                    "(the noise of such an example would be silently zero); fill or drop those examples first."
                )
            if x.shape[1] != dim:
                raise ValueError(
                    f"instance noise needs features of one size, but column {feature_column!r} holds vectors of "
                    f"length {dim} and {x.shape[1]}; resize or pad them to a common shape first."
                )
            if weights is None:
                weights = normals(seed, (INSTANCE_WEIGHT_STREAM, c), (dim, num_classes))
            logits = x @ weights
            logits[:, c] = -np.inf
            logits -= logits.max(axis=1, keepdims=True)
            off_class = np.exp(logits)
            off_class /= off_class.sum(axis=1, keepdims=True)
            batch = members[start : start + batch_size]
            rows[batch] = q[batch, None] * off_class
            rows[batch, c] += 1.0 - q[batch]
    return rows
