"""`VariationalTrainer` and what only it uses: its arguments (`arguments`), the checks of its inputs (`checks`), saves
and resumes (`checkpointing`), the guard against non-finite steps (`finite`), FSDP2 through accelerate (`fsdp`), the
steps after training (`after_training`), Hub pushes (`hub`) and hyperparameter search (`hp_search`)."""

from .arguments import VariationalTrainingArguments
from .trainer import VariationalTrainer

__all__ = ["VariationalTrainer", "VariationalTrainingArguments"]
