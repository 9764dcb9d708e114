"""Label-noise transition matrices and the [`NoiseReport`][varsmooth.corruption.NoiseReport] that documents a
corruption.

All matrices are row-stochastic: ``T[i, j] = P(noisy = j | clean = i)`` (the Co-teaching / Yu et al.
convention; cleanlab's ``noise_matrix`` is the transpose).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..files import atomic_path

#: the file a trainer's save writes the training set's `NoiseReport` into, next to the model (the model card reads it)
NOISE_REPORT_FILE = "noise_report.json"
#: the `noise_type`s `corrupt_labels` accepts (its docstring describes each)
NOISE_TYPES: tuple[str, ...] = ("symmetric", "uniform", "pairflip", "asymmetric", "classwise", "instance", "column")

#: published asymmetric ("class-conditional") maps, source class -> target class, by the name
#: `corrupt_labels(..., "asymmetric", class_map=name)` takes
ASYMMETRIC_CLASS_MAPS: dict[str, dict[int, int]] = {
    # Englesson et al. 2023, Logistic-Normal Likelihoods for Heteroscedastic Label Noise, Sec. 5.4 (and their code).
    "mnist": {7: 1, 2: 7, 5: 6, 6: 5, 3: 8},
    # LN label_corrupted_dataset.py and ALASCA dataset/noise_cifar10.py. The LN paper text omits
    # truck -> automobile (9 -> 1), but both reference codes flip it, so we follow the codes.
    "cifar10": {9: 1, 2: 0, 3: 5, 5: 3, 4: 7},
    # LN: every class goes to the next one (identical to pair-flip). ALASCA/FINE's within-super-class
    # variant is not offered: it assumes a class order that the standard fine labels do not have.
    "cifar100": {i: (i + 1) % 100 for i in range(100)},
}
_MAP_NUM_CLASSES = {"mnist": 10, "cifar10": 10, "cifar100": 100}


def symmetric_transition(num_classes: int, rate: float) -> np.ndarray:
    """Symmetric flip to a *different* class (Yu et al. 2019, used by Variational Learning Induces Adaptive Label
    Smoothing (Yang et al. 2025)): ``T_ii = 1-r``, ``T_ij = r/(K-1)``."""
    if num_classes < 2:
        raise ValueError("symmetric noise needs at least 2 classes to flip between.")
    _check_probability(rate, "symmetric")
    T = np.full((num_classes, num_classes), rate / (num_classes - 1))
    np.fill_diagonal(T, 1.0 - rate)
    return T


def uniform_transition(num_classes: int, rate: float) -> np.ndarray:
    """Resample uniformly over all K classes with probability r (LN, ALASCA, Patrini et al. 2017):
    ``T_ii = 1-r+r/K``, ``T_ij = r/K``; the expected fraction of changed labels is r(K-1)/K."""
    _check_probability(rate, "uniform")
    T = np.full((num_classes, num_classes), rate / num_classes)
    np.fill_diagonal(T, 1.0 - rate + rate / num_classes)
    return T


def pairflip_transition(num_classes: int, rate: float) -> np.ndarray:
    """Pair flip to the next class, cyclically (Yu et al. 2019; Yang et al. 2025, App. C.2):
    ``T_ii = 1-r``, ``T_{i,(i+1) mod K} = r``."""
    return asymmetric_transition(num_classes, rate, {i: (i + 1) % num_classes for i in range(num_classes)})


def asymmetric_transition(num_classes: int, rate: float, class_map: Mapping[int, int]) -> np.ndarray:
    """Class-conditional flips: each source class of ``class_map`` goes to its target with probability
    r; unmapped classes are never corrupted. ``class_map`` must already be resolved to integers."""
    _check_probability(rate, "asymmetric")
    T = np.eye(num_classes)
    for source, target in class_map.items():
        T[source, source] = 1.0 - rate
        T[source, target] += rate
    return T


def classwise_transition(num_classes: int, kappa: float, beta: float) -> np.ndarray:
    """Class-wise data-dependent noise of Variational Learning Induces Adaptive Label Smoothing (Yang et al. 2025), Eq.
    20-21.

    ``T_ii = 1-(κ+β i)`` and ``T_ij = (κ+β i)/(K-1)`` for ``j != i``, with the paper's 1-based class
    number ``i = 1..K``: label index 0 flips with probability κ+β and index K-1 with κ+βK. The mean rate
    over balanced classes is κ+β(K+1)/2.
    """
    if num_classes < 2:
        raise ValueError("classwise noise needs at least 2 classes to flip between.")
    flip = kappa + beta * np.arange(1, num_classes + 1)
    if not (kappa >= 0 and beta >= 0 and flip[-1] <= 1.0 + 1e-12):  # also refuses NaN, which compares False
        raise ValueError(
            "classwise noise (Yang et al. 2025, Eq. 20-21) needs kappa >= 0, beta >= 0 and kappa + beta*K <= 1 so "
            f"that every flip probability is valid; got kappa={kappa}, beta={beta}, K={num_classes} "
            f"(kappa + beta*K = {flip[-1]:.4g}). Lower kappa or beta, e.g. beta <= {(1 - kappa) / num_classes:.4g}."
        )
    flip = np.minimum(flip, 1.0)  # absorb round-off of an exactly-feasible kappa + beta*K == 1
    T = np.repeat((flip / (num_classes - 1))[:, None], num_classes, axis=1)
    np.fill_diagonal(T, 1.0 - flip)
    return T


def _check_probability(rate: float, noise_type: str) -> None:
    # a rate outside [0, 1] (or NaN) gives negative or NaN "probabilities" that sampling would silently misread
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{noise_type} noise needs a flip rate in [0, 1]; got {rate}. For a percentage, divide by "
                         "100.")


def resolve_class_map(
    class_map: str | Mapping[Any, Any], num_classes: int, class_names: list[str] | None
) -> dict[int, int]:
    """Turn a published map name or a user map ``{source: target}`` into integer indices.

    Keys and values may be ints, class names (resolved through the ClassLabel names) or digit strings
    (JSON object keys are always strings).
    """
    if isinstance(class_map, str):
        if class_map not in ASYMMETRIC_CLASS_MAPS:
            raise ValueError(
                f"Unknown asymmetric class map {class_map!r}. Use one of {sorted(ASYMMETRIC_CLASS_MAPS)} "
                "or pass a dict {source: target} of class indices or names."
            )
        if _MAP_NUM_CLASSES[class_map] != num_classes:
            raise ValueError(
                f"The {class_map!r} class map is defined for {_MAP_NUM_CLASSES[class_map]} classes but the "
                f"labels have {num_classes}. Pick the map of your dataset or pass a dict {{source: target}}."
            )
        return dict(ASYMMETRIC_CLASS_MAPS[class_map])
    if not isinstance(class_map, Mapping) or not class_map:
        raise ValueError(
            f"class_map must be one of {sorted(ASYMMETRIC_CLASS_MAPS)} or a non-empty dict {{source: target}}; "
            f"got {class_map!r}."
        )

    def to_index(value: Any) -> int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            index = int(value)
        elif isinstance(value, str) and class_names is not None and value in class_names:
            index = class_names.index(value)
        elif isinstance(value, str) and value.lstrip("-").isdigit():
            index = int(value)
        else:
            names = f" or one of the class names {class_names}" if class_names else ""
            raise ValueError(f"class_map entry {value!r} is not a class: use an index in [0, {num_classes}){names}.")
        if not 0 <= index < num_classes:
            raise ValueError(f"class_map entry {value!r} is outside [0, {num_classes}): use a valid class index.")
        return index

    resolved = {to_index(source): to_index(target) for source, target in class_map.items()}
    if len(resolved) != len(class_map):
        raise ValueError(f"class_map {dict(class_map)!r} names the same source class twice; give each source once.")
    self_maps = [source for source, target in resolved.items() if source == target]
    if self_maps:
        raise ValueError(f"class_map sends classes {self_maps} to themselves; drop those entries.")
    return resolved


def realized_transition(clean: np.ndarray, noisy: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-normalised confusion matrix of clean vs noisy labels and the clean class counts.

    A class absent from ``clean`` gets an all-zero row (its count is 0), which keeps the report JSON-safe.
    """
    confusion = np.bincount(clean * num_classes + noisy, minlength=num_classes * num_classes)
    confusion = confusion.reshape(num_classes, num_classes).astype(np.float64)
    counts = confusion.sum(axis=1)
    return confusion / np.maximum(counts, 1.0)[:, None], counts.astype(np.int64)


@dataclass
class NoiseReport:
    """What a label corruption intended and what it realized, JSON-safe for model cards.

    ``intended_*`` describe the generator (``None`` when the report was recomputed from a dataset with
    [`noise_report`][varsmooth.corruption.noise_report], which cannot know it); ``realized_*`` are measured on the
    clean vs noisy labels: ``realized_transition`` is the row-normalised confusion matrix,
    ``per_class_rate[i]`` the fraction of clean class ``i`` whose label changed, ``realized_rate`` the
    fraction of all labels that changed (= mean of ``is_corrupted``).
    """

    num_classes: int
    num_examples: int
    num_corrupted: int
    realized_rate: float
    realized_transition: list[list[float]]
    per_class_rate: list[float]
    class_counts: list[int]
    label_column: str = "label"
    class_names: list[str] | None = None
    noise_type: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    intended_rate: float | None = None
    intended_transition: list[list[float]] | None = None

    @classmethod
    def from_labels(
        cls,
        clean: np.ndarray,
        noisy: np.ndarray,
        num_classes: int,
        *,
        label_column: str = "label",
        class_names: list[str] | None = None,
        intended_transition: np.ndarray | None = None,
        **generator: Any,
    ) -> NoiseReport:
        """Measure the realized noise; the intended rate is the clean-class-weighted mean of
        ``1 - T_ii``, so it is directly comparable with the realized rate on the same labels."""
        T_hat, counts = realized_transition(clean, noisy, num_classes)
        changed = int(np.count_nonzero(clean != noisy))
        # A JSON round trip turns int dict keys (a class_map) into strings; do it now so that a report
        # equals its from_json(to_json()) copy.
        generator["params"] = json.loads(json.dumps(generator.get("params", {})))
        intended_rate = None
        if intended_transition is not None:
            intended_rate = float(np.dot(counts, 1.0 - np.diag(intended_transition)) / max(len(clean), 1))
        return cls(
            num_classes=num_classes,
            num_examples=len(clean),
            num_corrupted=changed,
            realized_rate=changed / max(len(clean), 1),
            realized_transition=T_hat.tolist(),
            per_class_rate=np.where(counts > 0, 1.0 - np.diag(T_hat), 0.0).tolist(),
            class_counts=counts.tolist(),
            label_column=label_column,
            class_names=list(class_names) if class_names is not None else None,
            intended_rate=intended_rate,
            intended_transition=None if intended_transition is None else np.asarray(intended_transition).tolist(),
            **generator,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, folder: str | os.PathLike) -> str:
        """Write the report as `NOISE_REPORT_FILE` into `folder`, whole or not at all; returns the file's path."""
        path = os.path.join(os.fspath(folder), NOISE_REPORT_FILE)
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            f.write(self.to_json())
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NoiseReport:
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> NoiseReport:
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """One line for logs and model cards."""
        what = self.noise_type or "label"
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        intended = "" if self.intended_rate is None else f" (intended {self.intended_rate:.2%})"
        return (
            f"{what} noise{f' ({params})' if params else ''}, seed {self.seed}: {self.num_corrupted} of "
            f"{self.num_examples} '{self.label_column}' labels corrupted = {self.realized_rate:.2%}{intended}"
        )
