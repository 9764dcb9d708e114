"""What both example scripts share around their own data and model: the split and label-noise flags and the end of a
run (train, evaluate on validation and test, save, share, print the metrics)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from varsmooth import VariationalTrainer
from varsmooth.corruption import CorruptionArguments
from varsmooth.utils import evaluate_validation_and_test


@dataclass
class SplitArguments:
    """Which splits train, validate and test (the data flags of both examples, before their own)."""

    train_split: str = field(default="train", metadata={"help": "Split to train on."})
    eval_split: str | None = field(
        default=None,
        metadata={"help": "Validation split: evaluated during and after training, and where the posterior temperature "
                          "is chosen (default: 'validation' if the dataset has one, else --train_val_split of the "
                          "training split). A 'test' split is scored once at the end (test_* metrics)."},
    )
    train_val_split: float = field(
        default=0.2, metadata={"help": "Fraction of the training split held out for validation when the dataset has none."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set."})


@dataclass
class ExampleCorruptionArguments(CorruptionArguments):
    noise_splits: str = field(
        default="train,validation",
        metadata={"help": "Comma-separated splits to corrupt. The validation split too by default: whoever has noisy "
                          "training labels has no clean validation set, and every choice is made on it."},
    )


def validation_noise_transition(reports: dict[str, Any] | None) -> list[list[float]] | None:
    """The transition matrix of the noise injected into the validation split, if any: with it the trainer chooses the
    posterior temperature by the noise-corrected validation NLL, which scores predictions against the clean labels.
    None for labels taken from a column (e.g. CIFAR-10N's human labels): their matrix would be measured on the clean
    labels, which a user with noisy labels does not have."""
    report = (reports or {}).get("validation")
    return None if report is None or report.noise_type == "column" else report.intended_transition


def train_evaluate_and_share(trainer: VariationalTrainer, checkpoint: str | None, test: Any, dataset_name: str) -> None:
    """Train (resuming from `checkpoint`) and save; evaluate on the validation split and once on `test`; push or write
    the model card naming `dataset_name`; print one JSON line of metrics (rank 0 only); end the process group."""
    args = trainer.args
    if args.do_train:
        trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
    if args.do_eval:
        metrics = evaluate_validation_and_test(trainer, test)
    if args.do_train:
        if args.push_to_hub:
            trainer.push_to_hub(dataset=dataset_name)
        else:
            trainer.create_model_card(dataset=dataset_name)
    if args.do_eval and trainer.is_world_process_zero():  # one line of metrics per run, not per process
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    trainer.accelerator.wait_for_everyone()
    trainer.end()
