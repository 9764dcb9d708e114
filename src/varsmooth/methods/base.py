"""The one small interface every training method implements (peft-style: one module per method).

A method decides three things for `VariationalTrainer`: whether IVON is the optimizer (and with which
settings), the training loss computed from the model's logits, and any extra state it must checkpoint.
Optional hooks: `attach` (extra heads trained with the model, see `heads.py`), `training_step` (methods with
their own forward/backward schedule, e.g. SAM's two passes) and `needs_example_index` (per-example state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from ..trainer import VariationalTrainer
    from ..training_args import VariationalTrainingArguments

__all__ = [
    "EXAMPLE_INDEX_KEY", "IGNORE_INDEX", "METHODS", "ExampleIndexDataset", "TrainingMethod", "get_method_class",
    "register_method",
]

METHODS: dict[str, type["TrainingMethod"]] = {}
#: batch key holding each example's position in the training set (added by the trainer, never seen by the model)
EXAMPLE_INDEX_KEY = "example_index"
#: label value that every loss skips, as in `F.cross_entropy`
IGNORE_INDEX = -100


def register_method(cls: type["TrainingMethod"]) -> type["TrainingMethod"]:
    METHODS[cls.name] = cls
    return cls


def get_method_class(name: str) -> type["TrainingMethod"]:
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}. Choose one of: {', '.join(sorted(METHODS))}.")
    return METHODS[name]


class TrainingMethod:
    """Base class: plain cross-entropy with whatever optimizer the Trainer's `optim` names.

    Subclasses override `loss` (and `ivon_settings` when IVON is the optimizer), and may keep state that is
    saved in checkpoints through `state_dict`/`load_state_dict`.
    """

    name: ClassVar[str] = "erm"
    uses_ivon: ClassVar[bool] = False
    #: per-example state (e.g. ALASCA's EMA): the trainer adds `EXAMPLE_INDEX_KEY` to every training batch
    needs_example_index: ClassVar[bool] = False
    #: learning rate used when the user gives none (TrainingArguments' own default for optimizer-agnostic methods)
    default_learning_rate: ClassVar[float] = 5e-5

    def __init__(self, args: "VariationalTrainingArguments", num_train_examples: int | None = None) -> None:
        self.args = args
        self.num_train_examples = num_train_examples

    def ivon_settings(self) -> dict[str, Any]:
        """Keyword arguments for `VariationalIVON` (only called when `uses_ivon`)."""
        raise NotImplementedError(f"{self.name} does not train with IVON")

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, trainer: "VariationalTrainer", inputs: dict[str, Any]) -> torch.Tensor:
        """Mean training loss of one micro-batch (labels equal to -100 are ignored)."""
        return F.cross_entropy(logits.float(), labels)

    def attach(self, model: torch.nn.Module) -> None:
        """Called once by the trainer before the optimizer exists: add extra heads or hooks to `model`."""

    def training_step(
        self, trainer: "VariationalTrainer", model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor | None:
        """Forward/backward of one micro-batch if the method schedules its own (return the loss to log); None = stock."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def callbacks(self) -> list[Any]:
        """`TrainerCallback`s the method needs (e.g. end-of-epoch updates)."""
        return []

    def hyperparameters(self) -> dict[str, Any]:
        """What the model card reports about this method."""
        return {"method": self.name}


register_method(TrainingMethod)


class ExampleIndexDataset(Dataset):
    """A map-style dataset whose rows also carry their position, under `EXAMPLE_INDEX_KEY`.

    Wrapping (instead of adding a column) keeps `set_transform`/`with_transform` outputs intact, and the
    index survives the Trainer's column removal because the trainer lists it among the signature columns.
    """

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"This method keeps per-example state and needs a map-style training dataset with a length, got "
                f"{type(dataset).__name__} (an IterableDataset has no stable example index)."
            )
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def _with_index(self, row: Any, index: int) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise TypeError(f"Training examples must be dicts to carry {EXAMPLE_INDEX_KEY!r}, got {type(row).__name__}.")
        return {**row, EXAMPLE_INDEX_KEY: index}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._with_index(self.dataset[index], index)

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        # `datasets.Dataset` fetches a whole batch at once; keep that fast path
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return [self._with_index(row, i) for row, i in zip(rows, indices)]
