"""What both example scripts share around their own data and model: the flags (from the command line or one JSON/YAML
file), the split, label-noise and export flags, the checkpoint to resume from, and the end of a run (train, evaluate on
validation and test, predict, save, share, print the metrics)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import difflib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from transformers import HfArgumentParser
from transformers.trainer_utils import get_last_checkpoint

from varsmooth import LabelNoiseCallback, VariationalTrainer
from varsmooth.corruption import CorruptionArguments
from varsmooth.evaluation import predictive_outputs
from varsmooth.files import atomic_path, is_leftover
from varsmooth.label_noise import EXPORT_NUM_SAMPLES
from varsmooth.methods import METHODS, get_method_config_class, learns_posterior
from varsmooth.trainer.checkpoint_files import refuse_finished_run, refuse_other_run

logger = logging.getLogger(__name__)

#: what `--do_predict` writes for the test split, as Hugging Face's run_classification.py does (with uncertainty)
PREDICT_RESULTS_FILE = "predict_results.txt"
#: flags of `TrainingArguments` that transformers renamed: the old name is refused with the new one named
RENAMED_FLAGS = {"evaluation_strategy": "eval_strategy", "no_cuda": "use_cpu",
                 "per_gpu_train_batch_size": "per_device_train_batch_size",
                 "per_gpu_eval_batch_size": "per_device_eval_batch_size", "push_to_hub_token": "hub_token"}


def _refuse_unknown_flags(parser: HfArgumentParser, given: set[str], source: str, method: str) -> None:
    """Name every flag (or config key) the parser does not know, with the one meant when it can tell (a setting of
    another method than `method`, a flag that transformers renamed, or a close spelling), before argparse's
    "arguments are not used" says none of it."""
    known = {option[2:].replace("-", "_") for action in parser._actions for option in action.option_strings
             if option.startswith("--")}
    unknown = sorted(given - known)
    if not unknown:
        return
    owners = {}
    for info in METHODS.values():
        for f in dataclasses.fields(info.config_class):
            owners.setdefault(f.name, info.name)
    hints = []
    for name in unknown:
        if name in owners:
            hints.append(f"--{name} (a setting of --method {owners[name]}, and --method is {method})")
            continue
        meant = RENAMED_FLAGS.get(name) or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.85)), None)
        hints.append(f"--{name}" + (f" (did you mean --{meant}?)" if meant else ""))
    raise ValueError(f"Unknown {'flag' if len(unknown) == 1 else 'flags'} in {source}: {', '.join(hints)}. Fix the "
                     f"name (--help lists every flag, --method <name> --help a method's), or drop it.")


def _chosen_method(training_cls: type, argv: list[str], config: dict[str, Any] | None) -> str:
    default = next(f.default for f in dataclasses.fields(training_cls) if f.name == "method")
    if config is not None:
        return config.get("method", default)
    method_only = argparse.ArgumentParser(add_help=False)
    method_only.add_argument("--method", default=default)
    return method_only.parse_known_args(argv)[0].method


def parse_example_arguments(dataclass_types: tuple[type, ...], argv: list[str],
                            **overrides: Any) -> tuple[tuple, set[str]]:
    """The example's dataclasses (model, data, noise and training arguments, in `dataclass_types`) and the names of
    the arguments given, from command-line flags or from one JSON/YAML file given instead of them (as in the
    transformers examples). `--method` is read first; its config class's fields are flags too (`--method ivon --ess
    1e4`), and the config they make is the training arguments' `method_config`, unless `--method_config` gives it.

    `overrides` are defaults the script chose from what was given (e.g. `ivon_preset="lora"`); a `--logging_steps`
    given without `--logging_strategy` logs every that many steps (the examples' own default logs once an epoch)."""
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        text = Path(argv[0]).read_text()
        config = json.loads(text) if argv[0].endswith(".json") else yaml.safe_load(text)
        if not isinstance(config, dict):
            raise ValueError(f"{argv[0]} must hold one mapping of argument names to values, got "
                             f"{type(config).__name__}.")
        given = set(config)
    else:
        config, given = None, {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    *others, training_cls = dataclass_types
    method = _chosen_method(training_cls, argv, config)
    config_cls = get_method_config_class(method)
    parser = HfArgumentParser((*dataclass_types, config_cls))
    _refuse_unknown_flags(parser, given, argv[0] if config is not None else "the command line", method)
    if "logging_steps" in given and "logging_strategy" not in given:
        overrides = {"logging_strategy": "steps", **overrides}
    if config is not None:
        values = {**config, **overrides}
    else:  # argparse's typed values of every flag (--help prints the chosen method's flags and exits here)
        values = vars(parser.parse_args(argv + [f"--{name}={value}" for name, value in overrides.items()]))
    config_fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    if "method_config" in given and config_fields & given:
        raise ValueError(f"Give the settings of method {method!r} either as flags "
                         f"({', '.join('--' + f for f in sorted(config_fields & given))}) or in --method_config, not "
                         "both.")
    # the config is built before the training arguments, whose defaults it may decide (IVON's preset: learning_rate)
    extra = {} if "method_config" in given else {"method_config": _build(config_cls, values, {})}
    return (*(_build(cls, values, {}) for cls in others), _build(training_cls, values, extra)), given


def _build(cls: type, values: dict[str, Any], extra: dict[str, Any]) -> Any:
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values
                  and f.name not in extra}, **extra)


@dataclass
class ExportArguments:
    """The per-example label-noise export of both examples."""

    label_noise_samples: int = field(
        default=EXPORT_NUM_SAMPLES,
        metadata={"help": "Posterior samples for the per-example label-noise export (label_noise.parquet, summary and "
                          "pictures next to the model; IVON methods only): each costs an evaluation pass over the "
                          f"training set. Default: {EXPORT_NUM_SAMPLES}, the library's (one antithetic pair). 0: no "
                          "export."},
    )


def label_noise_callbacks(training_args: Any) -> list[LabelNoiseCallback] | None:
    """The export callback when the run's method learns a posterior (IVON) and `label_noise_samples` > 0."""
    if training_args.label_noise_samples > 0 and learns_posterior(training_args.method):
        return [LabelNoiseCallback(training_args.label_noise_samples, plots=True)]
    return None


@dataclass
class HubArguments:
    """The model flags of Hugging Face's example scripts (run_classification.py, run_image_classification.py): how
    models, their tokenizers or image processors, and datasets are loaded from the Hub (or a folder)."""

    cache_dir: str | None = field(
        default=None, metadata={"help": "Where models and datasets downloaded from the Hub are stored."}
    )
    model_revision: str = field(
        default="main", metadata={"help": "The model version to load: a branch name, tag name or commit id."}
    )
    token: str | None = field(
        default=None,
        metadata={"help": "The token for private models and datasets (default: the one `hf auth login` stored)."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Run the modelling code of a Hub model repository (only for repositories you trust)."},
    )
    ignore_mismatched_sizes: bool = field(
        default=True,
        metadata={"help": "Load a checkpoint whose classifier has another number of classes, with a new one for the "
                          "dataset's classes. On by default here (off in Hugging Face's examples): these examples "
                          "always build the head for the data."},
    )

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """What every `from_pretrained` of the run takes (the model's, its config's, tokenizer's or processor's)."""
        return {"cache_dir": self.cache_dir, "revision": self.model_revision, "token": self.token,
                "trust_remote_code": self.trust_remote_code}

    def load_dataset_kwargs(self) -> dict[str, Any]:
        """What `datasets.load_dataset` takes of them (the model's revision is not the dataset's)."""
        return {"cache_dir": self.cache_dir, "token": self.token}


@dataclass
class SplitArguments:
    """Which splits train, validate and test (the data flags of both examples, before their own)."""

    train_split: str = field(default="train", metadata={"help": "Split to train on.",
                                                        "aliases": ["--train_split_name"]})
    eval_split: str | None = field(
        default=None,
        metadata={"help": "Validation split: evaluated during and after training, and where the posterior temperature "
                          "is chosen (default: 'validation' if the dataset has one, else --train_val_split of the "
                          "training split). A 'test' split is scored once at the end (test_* metrics).",
                  "aliases": ["--validation_split_name"]},
    )
    train_val_split: float = field(
        default=0.2,
        metadata={"help": "Fraction of the training split held out for validation when the dataset has none."}
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


def write_predictions(trainer: VariationalTrainer, test: Any, labels: list[int] | None, names: list[str]) -> str:
    """`--do_predict`: the prediction of every example of `test` (what `evaluate()` scores) into
    output_dir/predict_results.txt, tab-separated: index, prediction, label (when known), confidence, predictive
    entropy and the mutual information of the draws the prediction averages (BMA over the posterior, MC dropout),
    `n/a` for a prediction without draws. Returns the file's path."""
    out = predictive_outputs(trainer, test)
    probs = out["probs"].astype(np.float64)
    entropy = -(probs * np.log(np.clip(probs, 1e-12, None))).sum(-1)
    with_mi = "mutual_information" in out  # absent for a prediction without draws (a point estimate, or τ = 0)
    if not with_mi:
        logger.info("%s's mutual_information is n/a: the prediction is made at a single set of weights (the posterior "
                    "mean, or a method without a posterior: no samples to disagree).", PREDICT_RESULTS_FILE)
    path = os.path.join(trainer.args.output_dir, PREDICT_RESULTS_FILE)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["index", "prediction", *(["label"] if labels is not None else []), "confidence", "entropy",
                         "mutual_information"])
        for i, p in enumerate(probs):
            writer.writerow([i, names[int(p.argmax())], *([names[labels[i]]] if labels is not None else []),
                             f"{p.max():.6f}", f"{entropy[i]:.6f}",
                             f"{out['mutual_information'][i]:.6f}" if with_mi else "n/a"])
    return path


def check_output_dir_writable(output_dir: str) -> None:
    """Refuse an output folder this process cannot write into (or, when it does not exist yet, create in), before
    anything is loaded or trained rather than at the first save; nothing is created."""
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise PermissionError(
            f"--output_dir {output_dir} cannot be written ({type(error).__name__}: {error.strerror or error}): the run "
            "could not save its model. Choose a folder you can write to (--output_dir), or fix its permissions."
        ) from error


def train_evaluate_and_share(trainer: VariationalTrainer, checkpoint: str | None, test: Any, dataset_name: str,
                             dataset_tags: list[str] | None = None, test_labels: list[int] | None = None) -> None:
    """Train (resuming from `checkpoint`) and save; evaluate on the validation split and once on `test`; with
    `--do_predict` write the test split's predictions (beside its labels `test_labels`, when known); push or write the
    model card naming `dataset_name` (and `dataset_tags`, Hub dataset ids only, in its metadata); print one JSON line of
    metrics (rank 0 only); end the process group."""
    args = trainer.args
    if args.do_predict and test is None:  # refused before training, not after
        raise ValueError("--do_predict predicts the test split, and this dataset has none: give one (--test_file, "
                         "a dataset with a 'test' split).")
    if args.do_predict and args.world_size > 1:  # each process would predict only its shard of the test split
        raise ValueError("--do_predict writes predict_results.txt from a single process: run it without a "
                         "multi-process launch (e.g. python examples/<script>.py ... --do_predict).")
    if args.do_train:
        train_metrics = trainer.train(resume_from_checkpoint=checkpoint).metrics
        trainer.save_model()
        trainer.log_metrics("train", train_metrics)  # train_results.json, as HF's examples write it
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()  # trainer_state.json (the log history), as HF's examples write it
    if args.do_eval:
        metrics = evaluate_validation_and_test(trainer, test)
    if args.do_predict:
        if trainer.is_world_process_zero():
            names = list(trainer.accelerator.unwrap_model(trainer.model).config.id2label.values())
            logger.info("Predictions of the test split written to %s",
                        write_predictions(trainer, test, test_labels, names))
    if args.do_train:
        card = {"dataset": dataset_name, **({"dataset_tags": dataset_tags} if dataset_tags else {})}
        if args.push_to_hub:
            trainer.push_to_hub(**card)
        else:
            trainer.create_model_card(**card)
    if args.do_eval and trainer.is_world_process_zero():  # one line of metrics per run, not per process
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    trainer.accelerator.wait_for_everyone()
    trainer.end()


def checkpoint_to_resume(args: Any) -> str | None:
    """The checkpoint an example script resumes from, as in Hugging Face's example scripts.

    `args.resume_from_checkpoint` when given, else the last `checkpoint-N` in `args.output_dir`. A non-empty
    `output_dir` without checkpoints is refused unless `args.overwrite_output_dir`, so that a run never mixes its
    files with an earlier run's; `overwrite_output_dir` also starts from scratch when there are checkpoints. A
    checkpoint of another `--seed` or `--method` is refused (resuming it would continue that run under this one's name,
    on a data split drawn with this seed), and so is the last checkpoint of a run that has already finished (the stock
    Trainer would train one step more): `varsmooth.files`' checks, which `VariationalTrainer.train` makes too,
    made here before the data and model are built.
    """
    if args.resume_from_checkpoint is not None:
        if not os.path.isdir(args.resume_from_checkpoint):
            raise FileNotFoundError(f"--resume_from_checkpoint {args.resume_from_checkpoint!r} is not a folder: pass a "
                                    f"checkpoint-N folder written by an earlier run.")
        refuse_other_run(args, args.resume_from_checkpoint)
        return args.resume_from_checkpoint
    if not os.path.isdir(args.output_dir) or getattr(args, "overwrite_output_dir", False):
        return None
    last = get_last_checkpoint(args.output_dir)
    # what a killed run left under a temporary name is no earlier run's file: the next save deletes it
    if last is None and [name for name in os.listdir(args.output_dir) if not is_leftover(name)]:
        raise ValueError(f"Output directory ({args.output_dir}) already exists and is not empty. Use "
                         "--overwrite_output_dir to train into it anyway, or choose another --output_dir.")
    if last is not None:
        refuse_other_run(args, last)
        refuse_finished_run(args, last)
    return last


def evaluate_validation_and_test(trainer: Any, test_dataset: Any = None) -> dict[str, float]:
    """The example scripts' final scores: `eval_*` on the trainer's validation split (where the posterior temperature
    and any other choice were made) and, when the dataset has one, `test_*` on its test split, scored once and never
    chosen on. Both are logged and saved (`eval_results.json`, `test_results.json`) as in HF's examples."""
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    if test_dataset is not None:
        test_metrics = trainer.evaluate(test_dataset, metric_key_prefix="test")
        trainer.log_metrics("test", test_metrics)
        trainer.save_metrics("test", test_metrics)
        metrics = {**metrics, **test_metrics}
    return metrics
