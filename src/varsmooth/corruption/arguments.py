"""Command-line arguments for label corruption, parseable by ``transformers.HfArgumentParser``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset, DatasetDict

from .corrupt import corrupt_labels
from .transition import ASYMMETRIC_CLASS_MAPS, NOISE_TYPES, NoiseReport


@dataclass
class CorruptionArguments:
    """``--noise_type --noise_rate --noise_seed ...`` for the examples;
    [`apply`][varsmooth.corruption.CorruptionArguments.apply] runs
    [`corrupt_labels`][varsmooth.corruption.corrupt_labels] with them."""

    noise_type: str | None = field(
        default=None,
        metadata={"help": "Label noise to inject into the training labels; none by default. 'none' keeps the labels "
                  "(and turns off an example's default noise).", "choices": ("none", *NOISE_TYPES)},
    )
    noise_rate: float = field(
        default=0.0,
        metadata={"help": "Flip probability for symmetric/uniform/pairflip/asymmetric, mean flip probability "
                  "for instance noise. Keep 0 for classwise and column noise."},
    )
    noise_seed: int = field(default=0, metadata={"help": "Seed of the noise; independent of the training seed."})
    noise_kappa: float = field(
        default=0.4,
        metadata={"help": "classwise noise (Yang et al. 2025, Eq. 20-21): starting flip probability kappa."}
    )
    noise_beta: float = field(
        default=0.05, metadata={"help": "classwise noise: per-class increase beta; needs kappa + beta*K <= 1."}
    )
    noise_class_map: str | None = field(
        default=None,
        metadata={"help": f"asymmetric noise: one of {sorted(ASYMMETRIC_CLASS_MAPS)} or a JSON object "
                  "'{\"source\": target}' of class indices or names."},
    )
    noise_column: str | None = field(
        default=None, metadata={"help": "column noise: the column of real noisy labels, e.g. 'worse_label'."}
    )
    noise_feature_column: str | None = field(
        default=None,
        metadata={"help": "instance noise: image or numeric array column (auto-detected when only one exists)."},
    )
    noise_splits: str = field(
        default="train", metadata={"help": "Comma-separated splits of a DatasetDict to corrupt."}
    )

    def __post_init__(self) -> None:
        # Fail at parse time with the flag names, rather than later with corrupt_labels' keyword names.
        if self.noise_type == "asymmetric" and not self.noise_class_map:
            raise ValueError("--noise_type asymmetric needs --noise_class_map (a map name or a JSON object).")
        if self.noise_type == "column" and not self.noise_column:
            raise ValueError("--noise_type column needs --noise_column naming the column of noisy labels.")

    def type_params(self) -> dict[str, Any]:
        """The extra keyword arguments of [`corrupt_labels`][varsmooth.corruption.corrupt_labels] for ``noise_type``."""
        if self.noise_type == "asymmetric":
            class_map: Any = self.noise_class_map
            if class_map.lstrip().startswith("{"):
                try:
                    class_map = json.loads(class_map)
                except json.JSONDecodeError as error:
                    raise ValueError(f"--noise_class_map is not valid JSON ({error}); e.g. '{{\"9\": 1}}'.") from None
            return {"class_map": class_map}
        if self.noise_type == "classwise":
            return {"kappa": self.noise_kappa, "beta": self.noise_beta}
        if self.noise_type == "instance":
            return {"feature_column": self.noise_feature_column}
        if self.noise_type == "column":
            return {"noisy_column": self.noise_column}
        return {}

    def apply(
        self, dataset: Dataset | DatasetDict, label_column: str = "label"
    ) -> tuple[Dataset | DatasetDict, NoiseReport | dict[str, NoiseReport] | None]:
        """Corrupt ``dataset`` as configured and return it with its report(s); a no-op when
        ``noise_type`` is None or ``"none"``."""
        if self.noise_type in (None, "none"):
            return dataset, None
        return corrupt_labels(
            dataset,
            self.noise_type,
            self.noise_rate,
            seed=self.noise_seed,
            label_column=label_column,
            splits=tuple(s.strip() for s in self.noise_splits.split(",") if s.strip()),
            return_report=True,
            **self.type_params(),
        )
