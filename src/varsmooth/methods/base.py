"""The one small interface every training method implements (peft-style: one module per method).

A method decides three things for `VariationalTrainer`: whether IVON is the optimizer (and with which
settings), the training loss computed from the model's logits, and any extra state it must checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..trainer import VariationalTrainer
    from ..training_args import VariationalTrainingArguments

__all__ = ["TrainingMethod", "METHODS", "register_method", "get_method_class"]

METHODS: dict[str, type["TrainingMethod"]] = {}


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
