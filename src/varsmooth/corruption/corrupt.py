"""Synthetic and real label noise applied to `datasets` objects with a cache-friendly ``Dataset.map``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Value

from ._rng import FLIP_STREAM, TARGET_STREAM, uniforms
from .instance import instance_noise_rows, resolve_feature_column
from .transition import (
    NOISE_TYPES,
    NoiseReport,
    asymmetric_transition,
    classwise_transition,
    pairflip_transition,
    resolve_class_map,
    symmetric_transition,
    uniform_transition,
)

CLEAN_COLUMN = "clean_label"
CORRUPTED_COLUMN = "is_corrupted"

# Keyword parameters each noise type accepts, with defaults (None = required).
_TYPE_PARAMS: dict[str, dict[str, Any]] = {
    "symmetric": {},
    "uniform": {},
    "pairflip": {},
    "asymmetric": {"class_map": None},
    "classwise": {"kappa": None, "beta": 0.05},
    "instance": {"feature_column": None, "norm_std": 0.1},
    "column": {"noisy_column": None},
}
_OPTIONAL_NONE = {("instance", "feature_column")}  # None is a meaningful value here (auto-detect)
_RATE_FREE = ("classwise", "column")  # the noise level comes from other parameters / the data


def corrupt_labels(
    dataset: Dataset | DatasetDict,
    noise_type: str,
    rate: float = 0.0,
    *,
    seed: int,
    label_column: str = "label",
    splits: str | Iterable[str] = ("train",),
    num_classes: int | None = None,
    return_report: bool = False,
    batch_size: int = 1000,
    num_proc: int | None = None,
    **type_params: Any,
) -> Dataset | DatasetDict | tuple[Dataset | DatasetDict, NoiseReport | dict[str, NoiseReport]]:
    """Corrupt the labels of a dataset (or of some splits of a DatasetDict) with a known noise process.

    The result keeps the noisy label in ``label_column`` (same feature, ClassLabel kept), adds the
    original as ``clean_label`` (same feature type) and ``is_corrupted = noisy != clean``. Other splits of a
    DatasetDict are returned untouched; ``splits`` is ignored for a single Dataset.

    Noise types (``T[i, j] = P(noisy = j | clean = i)``):

    * ``"symmetric"``: flip to a different class with probability ``rate`` (Yu et al. 2019; Yang et al. 2025).
    * ``"uniform"``: resample over all K classes with probability ``rate`` (LN, ALASCA); about
      ``rate (K-1)/K`` of the labels change and only those count as corrupted.
    * ``"pairflip"``: flip to the next class (cyclic) with probability ``rate`` (Yu et al. 2019).
    * ``"asymmetric"``: ``class_map=`` ``"mnist"``, ``"cifar10"``, ``"cifar100"`` (published maps, see
      ``ASYMMETRIC_CLASS_MAPS``) or ``{source: target}`` of indices or class names; each source class flips
      to its target with probability ``rate``.
    * ``"classwise"``: Variational Learning Induces Adaptive Label Smoothing (Yang et al. 2025), Eq. 20-21, with
      ``kappa=`` (required) and ``beta=`` (default 0.05); label index ``c`` flips with probability ``kappa +
      beta*(c+1)`` (the paper numbers classes 1..K) to the other classes uniformly. ``rate`` must stay 0: the level is
      set by kappa and beta.
    * ``"instance"``: Xia et al. 2020: example i flips with probability ``q_i ~ TruncNormal(rate,
      norm_std², [0, 1])`` (``norm_std=0.1``; the mean is ≈ ``rate`` away from 0 and 1, e.g. 0.08 for
      rate 0) to a class picked by a random linear map of its features, ``feature_column=`` (an image or
      numeric array column; auto-detected when there is exactly one). Its intended transition matrix is
      the per-class average of the per-example noise distributions, its intended rate the mean ``q_i``.
    * ``"column"``: real human noise, ``noisy_column=`` (e.g. CIFAR-10N's ``"worse_label"``) becomes the
      label; ``rate`` must stay 0 and the intended transition matrix is the realized one.

    Reproducibility: an example's noise is a function of (seed, its row index in the input dataset, its
    clean label, and for instance noise its features) only, so it does not depend on ``batch_size``,
    ``num_proc`` or sharding, and ``corrupt_labels(dd)[s]`` equals ``corrupt_labels(dd[s])``. Corruption
    is decided by one uniform per example (``u_i < 1 - T[y_i, y_i]``) and the new class by another, so
    for a fixed seed a higher ``rate`` corrupts a superset of the examples, with the same new labels for
    symmetric, pair-flip, asymmetric and classwise noise. The same seed gives the same ``map`` fingerprint,
    so on-disk datasets reuse the cache.

    Labels must be integers in [0, K). K comes from the ClassLabel feature, else from ``num_classes``,
    else it is inferred as ``max(label) + 1`` with a warning (a class missing from the data would then be
    missing from the noise too).

    Returns the corrupted dataset, or ``(dataset, report)`` with ``return_report=True``; for a DatasetDict
    the report is a dict ``split -> NoiseReport``. [`noise_report`][varsmooth.corruption.noise_report] recomputes the
    realized part later.
    """
    if noise_type not in NOISE_TYPES:
        raise ValueError(f"Unknown noise_type {noise_type!r}; use one of {list(NOISE_TYPES)}.")
    rate = _check_rate(rate, noise_type)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int (it keys the noise generator); got {seed!r}.")
    params = _check_type_params(noise_type, type_params)
    options = dict(
        noise_type=noise_type,
        rate=rate,
        seed=int(seed),
        label_column=label_column,
        num_classes=num_classes,
        batch_size=batch_size,
        num_proc=num_proc,
        params=params,
    )
    if isinstance(dataset, DatasetDict):
        names = (splits,) if isinstance(splits, str) else tuple(splits)
        missing = [name for name in names if name not in dataset]
        if missing or not names:
            raise ValueError(
                f"splits {list(names)} are not all in the DatasetDict (missing {missing}); available splits: "
                f"{list(dataset)}. Pass splits= with existing split names."
            )
        result = DatasetDict(dataset)  # a new dict: the caller's DatasetDict keeps its splits
        reports = {}
        for name in names:
            result[name], reports[name] = _corrupt_split(dataset[name], **options)
        return (result, reports) if return_report else result
    if isinstance(dataset, Dataset):
        result, report = _corrupt_split(dataset, **options)
        return (result, report) if return_report else result
    raise TypeError(
        f"corrupt_labels expects a datasets.Dataset or DatasetDict, got {type(dataset).__name__}. Iterable "
        "(streaming) datasets have no stable row index; load the data without streaming=True."
    )


def noise_report(
    dataset: Dataset | DatasetDict, label_column: str = "label", num_classes: int | None = None
) -> NoiseReport | dict[str, NoiseReport]:
    """Recompute the realized noise of a corrupted dataset from its ``clean_label`` and label columns.

    The generator is unknown here, so ``noise_type``, ``params``, ``seed`` and the ``intended_*`` fields are
    ``None``/empty. For a DatasetDict, returns ``split -> NoiseReport`` for the splits that have
    ``clean_label``.
    """
    if isinstance(dataset, DatasetDict):
        reports = {
            name: noise_report(split, label_column, num_classes)
            for name, split in dataset.items()
            if CLEAN_COLUMN in split.column_names
        }
        if not reports:
            raise ValueError(
                f"No split of the DatasetDict has a {CLEAN_COLUMN!r} column, so there is no label noise to "
                "report; corrupt it first with corrupt_labels()."
            )
        return reports
    if CLEAN_COLUMN not in dataset.column_names:
        raise ValueError(
            f"The dataset has no {CLEAN_COLUMN!r} column, so its label noise cannot be measured; corrupt it with "
            f"corrupt_labels() first. Columns: {dataset.column_names}."
        )
    _check_label_column(dataset, label_column)
    K, names = _num_classes(dataset, CLEAN_COLUMN, num_classes, also=label_column)
    clean = _labels(dataset, CLEAN_COLUMN, K)
    noisy = _labels(dataset, label_column, K)
    return NoiseReport.from_labels(clean, noisy, K, label_column=label_column, class_names=names)


def realized_noise_report(dataset: Any, num_classes: int | None = None) -> NoiseReport | None:
    """The realized noise of a training set recomputed from its ``clean_label`` column (`noise_report`), or None when
    it has no such column (its labels are the dataset's own) or is no ``datasets.Dataset``. Its classes are the
    column's ClassLabel, else `num_classes` (the model's: integer labels need not show every class)."""
    if isinstance(dataset, Dataset) and CLEAN_COLUMN in dataset.column_names:
        label_column = "label" if "label" in dataset.column_names else "labels"
        if isinstance(dataset.features[CLEAN_COLUMN], ClassLabel):
            num_classes = None  # the dataset names its classes; a model may predict more (an unused head)
        return noise_report(dataset.with_format(None), label_column=label_column, num_classes=num_classes)
    return None


def _apply_noise(
    labels: list[int], indices: list[int], *, noisy_labels: np.ndarray, label_column: str
) -> dict[str, np.ndarray]:
    # Module-level and fed only picklable arrays, so `datasets` fingerprints it deterministically
    # (an unhashable closure would get a random fingerprint and silently defeat caching).
    clean = np.asarray(labels, dtype=np.int64)
    noisy = noisy_labels[np.asarray(indices, dtype=np.int64)]
    return {label_column: noisy, CLEAN_COLUMN: clean, CORRUPTED_COLUMN: noisy != clean}


def _corrupt_split(
    dataset: Dataset,
    *,
    noise_type: str,
    rate: float,
    seed: int,
    label_column: str,
    num_classes: int | None,
    batch_size: int,
    num_proc: int | None,
    params: dict[str, Any],
) -> tuple[Dataset, NoiseReport]:
    _check_label_column(dataset, label_column)
    already = [name for name in (CLEAN_COLUMN, CORRUPTED_COLUMN) if name in dataset.column_names]
    if already:
        raise ValueError(
            f"The dataset already has {already} columns, so its labels were corrupted before. Corrupting again "
            f"would stack two noise processes and lose the clean labels. To re-corrupt from the clean labels, "
            f"start from dataset.remove_columns([{label_column!r}, {CORRUPTED_COLUMN!r}])"
            f".rename_column({CLEAN_COLUMN!r}, {label_column!r})."
        )
    K, names = _num_classes(dataset, label_column, num_classes)
    clean = _labels(dataset, label_column, K)
    params = dict(params)
    report_seed: int | None = seed

    if noise_type == "column":
        noisy_column = params["noisy_column"]
        if noisy_column not in dataset.column_names:
            raise ValueError(
                f"noisy_column {noisy_column!r} is not a column of the dataset; columns: {dataset.column_names}."
            )
        noisy = _labels(dataset, noisy_column, K)
        intended = None  # filled with the realized matrix below: human noise has no separate generator
        report_seed = None  # nothing random happens
    elif noise_type == "instance":
        feature_column = resolve_feature_column(dataset, params["feature_column"], label_column)
        params["feature_column"] = feature_column
        params = {"rate": rate, **params}
        rows = instance_noise_rows(
            dataset,
            clean,
            feature_column=feature_column,
            rate=rate,
            norm_std=params["norm_std"],
            seed=seed,
            num_classes=K,
        )
        noisy = _draw(clean, rows, seed)
        # Expected T of instance noise: the average noise distribution over the examples of each class.
        counts = np.bincount(clean, minlength=K)
        intended = np.zeros((K, K))
        np.add.at(intended, clean, rows)
        intended = np.where(counts[:, None] > 0, intended / np.maximum(counts, 1)[:, None], np.eye(K))
    else:
        if noise_type == "classwise":
            intended = classwise_transition(K, params["kappa"], params["beta"])
        elif noise_type == "asymmetric":
            intended = asymmetric_transition(K, rate, resolve_class_map(params["class_map"], K, names))
            params = {"rate": rate, **params}
        else:
            builders = {
                "symmetric": symmetric_transition,
                "uniform": uniform_transition,
                "pairflip": pairflip_transition,
            }
            intended = builders[noise_type](K, rate)
            params = {"rate": rate}
        noisy = _draw(clean, intended[clean], seed)

    features = dataset.features.copy()
    features[CLEAN_COLUMN] = dataset.features[label_column]  # keeps a ClassLabel a ClassLabel
    features[CORRUPTED_COLUMN] = Value("bool")
    if len(dataset) == 0:  # `map` calls nothing on zero rows and would add no columns
        corrupted = dataset.add_column(CLEAN_COLUMN, [], feature=features[CLEAN_COLUMN]).add_column(
            CORRUPTED_COLUMN, [], feature=features[CORRUPTED_COLUMN])
    else:
        corrupted = dataset.map(
            _apply_noise,
            with_indices=True,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc,
            input_columns=[label_column],  # the label only: image columns are not decoded
            features=features,
            fn_kwargs={"noisy_labels": noisy, "label_column": label_column},
            desc=f"Corrupting {label_column!r} ({noise_type} noise)",
        )
    report = NoiseReport.from_labels(
        clean,
        noisy,
        K,
        label_column=label_column,
        class_names=names,
        intended_transition=intended,
        noise_type=noise_type,
        params=params,
        seed=report_seed,
    )
    if intended is None:
        report.intended_transition = [list(row) for row in report.realized_transition]
        report.intended_rate = report.realized_rate
    return corrupted, report


def _draw(clean: np.ndarray, rows: np.ndarray, seed: int) -> np.ndarray:
    """Sample noisy labels from per-example rows ``P(noisy = j | example)`` in two steps.

    Example i is corrupted iff ``u_i < 1 - rows[i, y_i]``; its new class comes from the off-diagonal part
    of its row by inverse CDF of ``v_i``. Both uniforms depend only on (seed, i), which is what makes the
    noise order-independent and nested across rates.
    """
    n = len(clean)
    u = uniforms(seed, FLIP_STREAM, n)
    v = uniforms(seed, TARGET_STREAM, n)
    own = np.arange(n), clean
    flip = u < 1.0 - rows[own]
    off = rows.copy()
    off[own] = 0.0
    cdf = np.cumsum(off, axis=1)
    # First class whose cumulative mass exceeds v * total: classes with zero mass are never chosen.
    target = np.minimum((cdf <= (v * cdf[:, -1])[:, None]).sum(axis=1), rows.shape[1] - 1)
    return np.where(flip, target, clean).astype(np.int64)


def _check_rate(rate: Any, noise_type: str) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise TypeError(f"rate must be a number in [0, 1]; got {rate!r} of type {type(rate).__name__}.")
    rate = float(rate)
    if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
        raise ValueError(f"rate must be a probability in [0, 1]; got {rate}. For a percentage, divide by 100.")
    if noise_type in _RATE_FREE and rate != 0.0:
        source = "kappa and beta (Yang et al. 2025, Eq. 20-21)" if noise_type == "classwise" else "the noisy column"
        raise ValueError(
            f"{noise_type} noise takes its level from {source}, not from rate; leave rate at 0 (got {rate})."
        )
    return rate


def _check_type_params(noise_type: str, type_params: Mapping[str, Any]) -> dict[str, Any]:
    accepted = _TYPE_PARAMS[noise_type]
    unknown = sorted(set(type_params) - set(accepted))
    if unknown:
        hint = f"it accepts {sorted(accepted)}" if accepted else "it takes no extra parameters"
        raise TypeError(f"{noise_type} noise got unexpected parameters {unknown}; {hint}.")
    params = {**accepted, **type_params}
    missing = [k for k, v in params.items() if v is None and (noise_type, k) not in _OPTIONAL_NONE]
    if missing:
        raise ValueError(f"{noise_type} noise needs {missing}: pass {', '.join(f'{k}=...' for k in missing)}.")
    if noise_type == "instance" and not params["norm_std"] > 0:
        raise ValueError(f"norm_std must be > 0 (Xia et al. 2020 use 0.1); got {params['norm_std']}.")
    if noise_type == "classwise":
        params["kappa"], params["beta"] = float(params["kappa"]), float(params["beta"])
    return params


def _check_label_column(dataset: Dataset, label_column: str) -> None:
    if label_column not in dataset.column_names:
        raise ValueError(
            f"Label column {label_column!r} not found; columns: {dataset.column_names}. Pass label_column= with "
            "the name of the integer/ClassLabel label column."
        )


def _num_classes(
    dataset: Dataset, column: str, num_classes: int | None, also: str | None = None
) -> tuple[int, list[str] | None]:
    """K and class names: from the ClassLabel, else ``num_classes``, else inferred as max + 1 (warned)."""
    feature = dataset.features[column]
    if isinstance(feature, ClassLabel):
        if num_classes is not None and num_classes != feature.num_classes:
            raise ValueError(
                f"num_classes={num_classes} contradicts the ClassLabel of {column!r} ({feature.num_classes} "
                "classes); drop num_classes or cast the column to the right ClassLabel."
            )
        return feature.num_classes, list(feature.names)
    _check_integer(feature, column)
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int; got {num_classes!r}.")
        return int(num_classes), None
    columns = [column] + ([also] if also else [])
    table = dataset.with_format("numpy", columns=columns)[:]
    inferred = int(max(int(table[c].max(initial=-1)) for c in columns)) + 1
    warnings.warn(
        f"{column!r} is not a ClassLabel and num_classes was not given, so K = max(label) + 1 = {inferred} is "
        "inferred; pass num_classes= (or cast the column to ClassLabel) if a class may be absent.",
        UserWarning,
        stacklevel=4,
    )
    return max(inferred, 1), None


def _check_integer(feature: Any, column: str) -> None:
    if not (isinstance(feature, Value) and feature.dtype.startswith(("int", "uint"))):
        raise TypeError(
            f"Column {column!r} has feature {feature}, but class labels must be integers; map them to indices "
            "first, e.g. dataset.class_encode_column(...) or cast_column(..., ClassLabel(names=[...]))."
        )


def _labels(dataset: Dataset, column: str, num_classes: int) -> np.ndarray:
    """The column as int64, checked to lie in [0, K)."""
    feature = dataset.features[column]
    if not isinstance(feature, ClassLabel):
        _check_integer(feature, column)
    labels = np.asarray(dataset.with_format("numpy", columns=[column])[:][column], dtype=np.int64)
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        raise ValueError(
            f"{int(bad.sum())} labels of {column!r} lie outside [0, {num_classes}) (e.g. "
            f"{sorted(set(labels[bad].tolist()))[:5]}); drop unlabeled rows (e.g. label -1) with dataset.filter, "
            "or pass the right num_classes."
        )
    return labels
