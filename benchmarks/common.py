"""Shared data, model and run code of the benchmarks (real data that fits a CPU).

* Data: MNIST (``mnist.npz`` in ``$VARSMOOTH_DATA_DIR``): a fixed 10k subset of the
  training images (``RandomState(12345).permutation(60000)[:10000]``), the first 1,000 are a *noisy* validation
  split and the other 9,000 the training set, test = the full clean 10k; scikit-learn's 8x8 digits for quick runs.
  Label noise comes from the library (``varsmooth.corruption.corrupt_labels``), applied to train + validation
  together with ``seed`` as the noise seed, so validation is as noisy as training (hyperparameters are chosen on it,
  never on the clean test set).
* Model: the reference study's small CNN (conv16-pool-conv32-pool-fc128-fc10, no BatchNorm), an ``nn.Module`` whose
  ``forward(pixel_values, labels=None)`` returns a ``ModelOutput`` with ``logits``, as the Trainer expects.
* :func:`run` trains one (method, hyperparameters, noise, seed, epochs) with ``VariationalTrainer`` and returns a
  JSON-able dict of clean-test and noisy-validation metrics, the per-epoch history and IVON's Hessian; each run is
  cached as JSON under ``benchmarks/results/<script>/runs/`` so that every script is resumable.

Paired design (as the reference): within a seed every method sees the same noisy labels, the same initial weights
(``torch.manual_seed(seed)`` before building the model) and the same batch order (the Trainer's sampler seed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainerCallback
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("VARSMOOTH_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# the examples' data/model helpers (example_utils) live beside the example scripts, outside the library
sys.path.insert(0, str(REPO_ROOT / "examples"))
#: bump when a change makes old cached runs incomparable (part of every cache key)
CACHE_VERSION = 1
#: size of the fixed clean-test subset behind the per-epoch curves (final metrics use the whole test set)
HISTORY_TEST_SIZE = 2000

hf_logging.set_verbosity_error()

__all__ = [
    "DATA_DIR", "RESULTS_DIR", "REPO_ROOT", "DataUnavailable", "ImageData", "SmallCNN", "load_data", "noisy_labels",
    "parse_noise", "run", "method_available", "mean_std", "write_json", "steps_per_epoch",
    "readme_with_block", "results_pages", "write_readme_section", "code_commit", "bench_device", "stamp_line",
    "stamp_fields", "STAMP_LINE",
]


class DataUnavailable(RuntimeError):
    """A data file is missing; benchmarks catch it and skip with its message."""


# -------------------------------------------------------------------------------------------------------------------
# data
# -------------------------------------------------------------------------------------------------------------------
@dataclass
class ImageData:
    name: str
    x_train: np.ndarray  # (N, 1, H, W) float32, normalised
    y_train: np.ndarray  # clean labels, int64
    x_val: np.ndarray
    y_val: np.ndarray  # clean labels (the run uses the noisy ones; clean only for descriptive diagnostics)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int = 10

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]


_DATA_CACHE: dict[str, ImageData] = {}


def load_mnist(n_train: int = 9000, n_val: int = 1000) -> ImageData:
    path = DATA_DIR / "mnist.npz"
    if not path.is_file():
        raise DataUnavailable(
            f"MNIST not found at {path} (expected ../shared/data/mnist.npz relative to the repository root, or set "
            "VARSMOOTH_DATA_DIR). Skipping the MNIST benchmarks; `--quick` runs on scikit-learn digits instead."
        )
    with np.load(path) as f:
        x_tr, y_tr, x_te, y_te = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
    idx = np.random.RandomState(12345).permutation(len(y_tr))[: n_train + n_val]
    norm = lambda x: ((x.astype(np.float32) / 255.0 - 0.1307) / 0.3081)[:, None]  # noqa: E731
    x_sub, y_sub = norm(x_tr[idx]), y_tr[idx].astype(np.int64)
    return ImageData("mnist", x_sub[n_val:], y_sub[n_val:], x_sub[:n_val], y_sub[:n_val], norm(x_te),
                     y_te.astype(np.int64))


def load_digits_data(n_train: int = 1000, n_val: int = 200) -> ImageData:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = ((d.images / 16.0 - 0.5) / 0.5).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    idx = np.random.RandomState(12345).permutation(len(y))
    tr, va, te = idx[n_val:n_val + n_train], idx[:n_val], idx[n_val + n_train:]
    return ImageData("digits", x[tr], y[tr], x[va], y[va], x[te], y[te])


def load_data(name: str) -> ImageData:
    if name not in _DATA_CACHE:
        loaders = {"mnist": load_mnist, "digits": load_digits_data}
        if name not in loaders:
            raise ValueError(f"Unknown dataset {name!r}; choose one of {sorted(loaders)}.")
        _DATA_CACHE[name] = loaders[name]()
    return _DATA_CACHE[name]


_NOISE_RE = re.compile(r"^(clean|sym|pair|cw)([0-9.]*)$")


def parse_noise(noise: str) -> tuple[str | None, dict[str, float]]:
    """'clean' | 'sym40' | 'pair20' | 'cw0.3' (class-wise, κ = 0.3, β = 0.05) -> (noise_type, corrupt_labels kwargs)."""
    m = _NOISE_RE.match(noise)
    if not m or (m.group(1) != "clean" and not m.group(2)):
        raise ValueError(f"Bad noise spec {noise!r}: use clean, sym<pct>, pair<pct> or cw<kappa> (e.g. sym40, cw0.3).")
    kind, level = m.group(1), m.group(2)
    if kind == "clean":
        return None, {}
    if kind == "cw":
        return "classwise", {"kappa": float(level), "beta": 0.05}
    return {"sym": "symmetric", "pair": "pairflip"}[kind], {"rate": float(level) / 100.0}


def noisy_labels(data: ImageData, noise: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy (train, val) labels from ``varsmooth.corruption.corrupt_labels``, applied to train + val as one dataset."""
    noise_type, params = parse_noise(noise)
    y_all = np.concatenate([data.y_val, data.y_train])
    if noise_type is not None:
        import datasets

        from varsmooth.corruption import corrupt_labels

        features = datasets.Features({"label": datasets.ClassLabel(num_classes=data.num_classes)})
        ds = datasets.Dataset.from_dict({"label": y_all.tolist()}, features=features)
        ds = corrupt_labels(ds, noise_type, seed=seed, **params)
        y_all = np.asarray(ds["label"], dtype=np.int64)
    n_val = len(data.y_val)
    return y_all[n_val:], y_all[:n_val]


class ArrayDataset(torch.utils.data.Dataset):
    """Rows {"pixel_values", "labels"} of in-memory tensors (fast to index, collated by the Trainer's default
    collator)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = torch.as_tensor(x)
        self.y = torch.as_tensor(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


# -------------------------------------------------------------------------------------------------------------------
# model
# -------------------------------------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """conv(1→16,3,p1)-ReLU-maxpool-conv(16→32,3,p1)-ReLU-maxpool-fc(32·H/4·W/4→128)-ReLU-fc(128→K), no BatchNorm."""

    def __init__(self, image_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10, width: int = 16,
                 hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        c, h, w = image_shape
        # dropout > 0: on the fc1 features, for MC-dropout prediction (uncertainty.py); 0 keeps the reference CNN
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.conv1 = nn.Conv2d(c, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * (h // 4) * (w // 4), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)
        # what ALASCA needs to place its auxiliary heads: widths of `hidden_states` (stem first), as HF CNN configs
        self.config = SimpleNamespace(embedding_size=width, hidden_sizes=[2 * width, hidden], num_labels=num_classes)

    def get_classifier(self) -> nn.Linear:  # timm-style accessor (OLS/ALASCA/LN find the output layer with it)
        return self.fc2

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None,
                output_hidden_states: bool = False) -> ImageClassifierOutput:
        h1 = F.max_pool2d(F.relu(self.conv1(pixel_values)), 2)
        h2 = F.max_pool2d(F.relu(self.conv2(h1)), 2)
        h3 = F.relu(self.fc1(h2.flatten(1)))
        logits = self.fc2(h3 if self.dropout is None else self.dropout(h3))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        hidden = (h1, h2, h3[:, :, None, None]) if output_hidden_states else None
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hidden)


@torch.no_grad()
def predict_probs(model: nn.Module, x: torch.Tensor, batch: int = 2000) -> torch.Tensor:
    """Class probabilities at the model's current weights, on CPU, computed on the model's device."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = torch.cat([model(pixel_values=x[i:i + batch].to(device)).logits.float().softmax(-1).cpu()
                     for i in range(0, len(x), batch)])
    model.train(was_training)
    return out


# -------------------------------------------------------------------------------------------------------------------
# methods and hyperparameters
# -------------------------------------------------------------------------------------------------------------------
#: the reference study's baseline optimizer: SGD(momentum 0.9, lr 0.05, wd 5e-4), cosine to 0 per step
#: (max_grad_norm 0: no gradient clipping, as the reference; the Trainer's default 1.0 slows memorisation for all
#: methods)
SGD_BASE: dict[str, Any] = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.05, "weight_decay": 5e-4,
                            "lr_scheduler_type": "cosine", "warmup_epochs": 0, "max_grad_norm": 0.0}
#: IVON as in the reference study's S1 (= the authors' CIFAR script, library defaults), 1-epoch warm-up then cosine
IVON_BASE: dict[str, Any] = {"learning_rate": 0.2, "hess_init": 0.5, "beta1": 0.9, "beta2": 0.99999,
                             "prior_precision": 2e-4, "lr_scheduler_type": "cosine", "warmup_epochs": 1,
                             "max_grad_norm": 0.0}


def bench_device() -> str:
    """Where `run` trains: $VARSMOOTH_BENCH_DEVICE ("cpu", the default, or "cuda"). Recorded in every result; not part
    of the cache key: a run is the same experiment on either device up to rounding and, for IVON, the weight draws,
    which act as one more draw of the training randomness (device_agreement.py measures it)."""
    device = os.environ.get("VARSMOOTH_BENCH_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"VARSMOOTH_BENCH_DEVICE={device!r}: use 'cpu' or 'cuda'.")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("VARSMOOTH_BENCH_DEVICE=cuda but torch sees no GPU; unset it to run on the CPU.")
    return device


def method_available(method: str) -> bool:
    from varsmooth.methods import METHODS

    return method in METHODS


def training_arguments(method: str, **fields: Any) -> Any:
    """`VariationalTrainingArguments(method=method, ...)` from flat keyword arguments as the hyperparameter dicts
    here hold them (and as the run caches are keyed): the fields of the method's config (e.g. ``sam_rho``, IVON's
    ``ess``) go into `method_config`."""
    import dataclasses

    from varsmooth import VariationalTrainingArguments
    from varsmooth.methods import get_method_config_class

    own = {f.name for f in dataclasses.fields(get_method_config_class(method))}
    config = {name: fields.pop(name) for name in list(fields) if name in own}
    return VariationalTrainingArguments(method=method, method_config=config or None, **fields)


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    return math.ceil(n_train / batch_size)


def _slug(hp: dict[str, Any]) -> str:
    parts = []
    for k in sorted(hp):
        v = hp[k]
        v = f"{v:.6g}" if isinstance(v, float) else str(v)
        parts.append(f"{k}={v}")
    s = ",".join(parts) or "default"
    return re.sub(r"[^A-Za-z0-9=,.+-]", "_", s)


def run_key(**config: Any) -> str:
    blob = json.dumps(config, sort_keys=True, default=str)
    h = hashlib.sha1(blob.encode()).hexdigest()[:10]
    name = (f"{config['dataset']}_{config['noise']}_{config['method']}_{_slug(config['hyperparams'])}"
            f"_e{config['epochs']}_s{config['seed']}")
    return (name[:150] + "_" + h) if len(name) > 150 else name + "_" + h


class HistoryCallback(TrainerCallback):
    """Every `every` epochs: clean-test and noisy-val accuracy at the current (mean) weights, and IVON's Hessian.

    Descriptive only: nothing is selected on the clean-test curve.
    """

    def __init__(self, x_test: torch.Tensor, y_test: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                 every: int = 1) -> None:
        self.x_test, self.y_test, self.x_val, self.y_val, self.every = x_test, y_test, x_val, y_val, every
        self.trainer = None
        self.history: list[dict[str, float]] = []

    def on_epoch_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        epoch = int(round(state.epoch or 0))
        if self.every <= 0 or (epoch % self.every and epoch != int(args.num_train_epochs)):
            return
        row: dict[str, float] = {"epoch": epoch, "step": state.global_step}
        row["test_acc"] = float((predict_probs(model, self.x_test).argmax(-1) == self.y_test).float().mean())
        row["val_acc"] = float((predict_probs(model, self.x_val).argmax(-1) == self.y_val).float().mean())
        losses = [r["loss"] for r in state.log_history if "loss" in r]
        if losses:
            row["train_loss"] = float(losses[-1])
        if self.trainer is not None and self.trainer.ivon is not None:
            row.update(self.trainer.hessian_summary())
        self.history.append(row)


def _versions() -> dict[str, str]:
    """What a run's numbers depend on besides the code: the packages and the CPU's kernel set (torch picks its CPU
    kernels by instruction set, so the same versions on another CPU need not repeat a run to the last digit)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:  # pragma: no cover
            return "?"

    return {"python": platform.python_version(), "torch": torch.__version__,
            **{name: installed(name) for name in ("transformers", "ivon-opt", "timm", "peft", "numpy", "accelerate")},
            "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def code_commit() -> str:
    """The repository's commit (with "+changes" where the work tree differs from it), so that a table names the code
    that measured it; "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


#: a generated table's stamp line: an optional caption sentence on mixing, then "Runs by ..." or, when no run has a
#: commit, "N runs predate stamping" (tests/test_benchmarks.py finds the stamp of every block by it)
STAMP_LINE = re.compile(r"^(\*\*This table mixes [^*]+\*\* )?(Runs by |\d+ runs? predates? stamping)", re.MULTILINE)
#: the packages that name an engine when a run predates the commit stamp (its `versions` field, when it has one)
_ENGINE_PACKAGES = ("torch", "transformers", "ivon-opt")


def _engine_of(run: dict[str, Any]) -> str:
    """What a run records of the code that produced it, short of a commit: its package versions, else its cache
    version, else nothing. Never a commit guessed from a date: a run that did not record one says so."""
    versions = run.get("versions")
    if not isinstance(versions, dict):  # some writers keep the versions at the top level (label_noise_cost.py)
        versions = {name: run[name] for name in _ENGINE_PACKAGES if isinstance(run.get(name), str)}
    if any(name in versions for name in _ENGINE_PACKAGES):
        return " ".join(f"{name} {versions[name]}" for name in _ENGINE_PACKAGES if name in versions)
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    version = run.get("version", config.get("version"))
    return f"cache version {version}" if version is not None else "no versions recorded"


def stamp_fields(run: dict[str, Any]) -> dict[str, Any]:
    """What `stamp_line` reads of a run (commit, device, package versions, cache version), for summaries that keep a
    few fields of each run rather than the run."""
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    version = run.get("version", config.get("version"))
    return {**{k: run[k] for k in ("commit", "device", "versions") if k in run},
            **({"version": version} if version is not None else {})}


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} ({n})" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def stamp_line(runs: Any, *, unrecorded_device: str | None = None) -> str:
    """One line for under a generated table: which code (commit) on which device its `runs` (dicts as the run JSON
    holds them, each with ``commit`` and ``device`` where recorded) came from, e.g. "Runs by 8b3ff5c on cpu (3)."
    When they span more than one engine or device the line opens with a caption sentence saying that the table mixes
    them (paired differences across engines or devices include their rounding).

    A run recorded before runs were stamped (no ``commit``) is counted as predating stamping and named by what it does
    record (package versions, else its cache version); no commit is guessed for it. `unrecorded_device` is the device
    of a run without a ``device`` field, for scripts that could train on nothing else before they recorded one
    (``use_cpu=True`` until commit 6bf945e for `run`, 41d5069 for real_noise.py, df81a07 for lora.py); None shows
    such runs as "device not recorded"."""
    runs = [r for r in runs if r]
    if not runs:
        return "Runs by nothing yet: no run is cached."
    stamped: dict[str, int] = {}
    predating: dict[str, int] = {}
    engines, devices = set(), set()
    for r in runs:
        device = r.get("device") or unrecorded_device or "device not recorded"
        engine = r.get("commit") or _engine_of(r)
        engines.add((bool(r.get("commit")), engine))
        devices.add(device)
        group = stamped if r.get("commit") else predating
        group[f"{engine} on {device}"] = group.get(f"{engine} on {device}", 0) + 1
    text = f"Runs by {_counted(stamped)}." if stamped else ""
    if predating:
        n = sum(predating.values())
        text += (f" {n} run{'s' * (n != 1)} predate{'s' * (n == 1)} stamping (no commit recorded): "
                 f"{_counted(predating)}.")
    if len(engines) > 1 or len(devices) > 1:
        mixed = [f"{len(engines)} engines" * (len(engines) > 1), f"{len(devices)} devices" * (len(devices) > 1)]
        text = f"**This table mixes runs of {' and '.join(m for m in mixed if m)}.** {text.strip()}"
    return text.strip()


def _result_path(script: str, key: str) -> Path:
    return RESULTS_DIR / script / "runs" / f"{key}.json"


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez_compressed` written whole or not at all (as write_json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def results_pages(root: Path | None = None) -> list[Path]:
    """The Markdown pages that hold the generated blocks: benchmarks/README.md (the summary) and one page per study,
    benchmarks/studies/*.md. `root` is the repository (default `REPO_ROOT`)."""
    bench = (root or REPO_ROOT) / "benchmarks"
    return [bench / "README.md", *sorted((bench / "studies").glob("*.md"))]


def readme_with_block(name: str, root: Path | None = None) -> Path:
    """The one page of `results_pages(root)` that has the markers of the generated block `name`; a ValueError names
    the pages searched when none has them, or the pages when more than one has."""
    begin, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    pages = results_pages(root)
    found = [p for p in pages if p.exists() and begin in (text := p.read_text()) and end in text]
    if len(found) != 1:
        where = ", ".join(str(p.relative_to((root or REPO_ROOT))) for p in (found or pages))
        raise ValueError(f"the generated block {name!r} must have its markers ({begin} ... {end}) on exactly one "
                         f"page; {'none of' if not found else 'it is on each of'}: {where}")
    return found[0]


def write_readme_section(name: str, markdown: str, readme: Path | None = None) -> Path:
    """Replace the block between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` with ``markdown``, so that
    every table of the results pages is written by the script that computes it, never copied by hand.

    Without `readme` the block is written wherever its markers are: benchmarks/README.md or one of the study pages
    benchmarks/studies/*.md (`readme_with_block`: a ValueError when no page, or more than one, has them). With
    `readme` (e.g. the front page's headline table) that file is written, the block appended at its end when the
    markers are missing. The file is replaced whole (no half-written page). Returns the file written."""
    readme = readme or readme_with_block(name)
    begin, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    text = readme.read_text() if readme.exists() else ""
    block = f"{begin}\n{markdown.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = readme.with_suffix(f".md.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, readme)
    return readme


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def train_timed(trainer: Any) -> tuple[float, str | None, float]:
    """`trainer.train()` as a benchmark runs it: (training loss, why it diverged or None, seconds). A diverged run
    (FloatingPointError, e.g. an unclipped small beta2) is a result with a NaN loss, not a crash."""
    t0 = time.perf_counter()
    try:
        return float(trainer.train().training_loss), None, time.perf_counter() - t0
    except FloatingPointError as error:
        return float("nan"), f"{error}"[:300], time.perf_counter() - t0


def cached(script: str, method: str, hyperparams: dict[str, Any] | None = None, noise: str = "sym40", seed: int = 0,
           epochs: int = 20, *, dataset: str = "mnist", batch_size: int = 64, eval_mc_samples: int = 8) -> dict | None:
    """The cached result of a run, or None (no training)."""
    config = dict(dataset=dataset, method=method, hyperparams=dict(hyperparams or {}), noise=noise, seed=seed,
                  epochs=epochs, batch_size=batch_size, eval_mc_samples=eval_mc_samples, version=CACHE_VERSION)
    path = _result_path(script, run_key(**config))
    return json.loads(path.read_text()) if path.is_file() else None


def run(method: str, hyperparams: dict[str, Any] | None = None, noise: str = "sym40", seed: int = 0, epochs: int = 20,
        *, dataset: str = "mnist", batch_size: int = 64, eval_mc_samples: int = 8, history_every: int = 1,
        script: str = "adhoc", force: bool = False, verbose: bool = True,
        analyze: Any = None, init_seed: int | None = None, dropout: float = 0.0) -> dict[str, Any]:
    """Train `method` (a name in `varsmooth.methods.METHODS`) with `hyperparams` (fields of
    `VariationalTrainingArguments`, plus ``warmup_epochs``) on `dataset` with `noise`, for `epochs` epochs.

    Defaults below the given hyperparameters: SGD_BASE for non-IVON methods, IVON_BASE for IVON methods.
    Returns (and caches under benchmarks/results/<script>/runs/) clean-test accuracy/NLL/ECE/Brier — the BMA over
    `eval_mc_samples` posterior draws for IVON methods, plus ``test_mean_*`` at the posterior mean —, the same on the
    noisy validation split (``val_*``, the only numbers used for selection), the fraction of flipped training labels
    the final model fits, the per-epoch history and the Hessian summary. `analyze(trainer, val, test)`, if given,
    runs on the trained model (noisy-validation and clean-test datasets) and its dict is kept as ``analysis``.
    `init_seed` (default `seed`) seeds the initial weights alone, e.g. for the members of a deep ensemble on the same
    noisy labels; `dropout` > 0 builds the CNN with dropout on its hidden features.
    """
    hyperparams = dict(hyperparams or {})
    config = dict(dataset=dataset, method=method, hyperparams=hyperparams, noise=noise, seed=seed, epochs=epochs,
                  batch_size=batch_size, eval_mc_samples=eval_mc_samples, version=CACHE_VERSION)
    # only when set, so that the keys of the runs cached before these options existed stay valid
    config.update({"init_seed": init_seed} if init_seed is not None else {})
    config.update({"dropout": dropout} if dropout else {})
    key = run_key(**config)
    path = _result_path(script, key)
    if path.is_file() and not force:
        return json.loads(path.read_text())
    if not method_available(method):
        from varsmooth.methods import METHODS

        raise KeyError(f"Method {method!r} is not in varsmooth.methods.METHODS ({sorted(METHODS)}).")

    from varsmooth import VariationalTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = load_data(dataset)
    y_train, y_val = noisy_labels(data, noise, seed)
    n_train = len(y_train)
    spe = steps_per_epoch(n_train, batch_size)
    from varsmooth.methods import learns_posterior

    ivon_method = learns_posterior(method)
    settings = {**(IVON_BASE if ivon_method else SGD_BASE), **hyperparams}
    warmup_epochs = settings.pop("warmup_epochs", 0)
    settings["warmup_steps"] = int(round(warmup_epochs * spe))

    torch.manual_seed(seed if init_seed is None else init_seed)
    model = SmallCNN(data.image_shape, data.num_classes, dropout=dropout)
    # per-epoch history on a fixed 2,000-image subset of the clean test set (cost; final metrics use all of it)
    sub = np.random.RandomState(0).permutation(len(data.y_test))[:HISTORY_TEST_SIZE]
    x_test, y_test = torch.as_tensor(data.x_test[sub]), torch.as_tensor(data.y_test[sub])
    x_val, y_val_t = torch.as_tensor(data.x_val), torch.as_tensor(y_val)
    history_cb = HistoryCallback(x_test, y_test, x_val, y_val_t, every=history_every)
    with tempfile.TemporaryDirectory(prefix="varsmooth-bench-") as tmp:
        args = training_arguments(
            method, output_dir=tmp, num_train_epochs=epochs, per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=1000, seed=seed, data_seed=seed, use_cpu=bench_device() == "cpu", report_to=[],
            save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=spe, disable_tqdm=True,
            dataloader_num_workers=0, eval_mc_samples=eval_mc_samples if ivon_method else 0, eval_seed=0,
            **settings,
        )
        trainer = VariationalTrainer(model=model, args=args, train_dataset=ArrayDataset(data.x_train, y_train),
                                     callbacks=[history_cb])
        history_cb.trainer = trainer
        trainer.remove_callback(PrinterCallback)  # the per-epoch log dicts are kept in the result instead
        training_loss, diverged, train_s = train_timed(trainer)
        hess = trainer.hessian_summary()
        t1 = time.perf_counter()
        test = trainer.evaluate(ArrayDataset(data.x_test, data.y_test), metric_key_prefix="test")
        val = trainer.evaluate(ArrayDataset(data.x_val, y_val), metric_key_prefix="val")
        eval_s = time.perf_counter() - t1
        analysis = (analyze(trainer, ArrayDataset(data.x_val, y_val), ArrayDataset(data.x_test, data.y_test))
                    if analyze is not None and diverged is None else None)
        log_history = trainer.state.log_history
    # memorisation: share of flipped training labels that the final (mean) model predicts as their noisy label
    pred_train = predict_probs(model, torch.as_tensor(data.x_train)).argmax(-1).numpy()
    flipped = y_train != data.y_train
    result: dict[str, Any] = {
        "key": key, "config": config, "settings": {k: v for k, v in settings.items()},
        "n_train": n_train, "steps": trainer.state.global_step, "steps_per_epoch": spe,
        "realized_noise_train": float(flipped.mean()), "realized_noise_val": float((y_val != data.y_val).mean()),
        "train_s": train_s, "eval_s": eval_s, "train_loss": training_loss, "diverged": diverged,
        "fit_flipped": float((pred_train[flipped] == y_train[flipped]).mean()) if flipped.any() else None,
        "fit_clean_train": float((pred_train[~flipped] == y_train[~flipped]).mean()),
        "hessian": hess, "history": history_cb.history,
        "log_history": [r for r in log_history if "loss" in r],
        "versions": _versions(), "threads": torch.get_num_threads(), "device": bench_device(),
        "commit": code_commit(), **({"analysis": analysis} if analysis is not None else {}),
    }
    for prefix, metrics in (("test", test), ("val", val)):
        for name in ("accuracy", "nll", "ece", "brier", "mean_accuracy", "mean_nll", "mean_ece", "mean_brier"):
            k = f"{prefix}_{name}"
            if k in metrics:
                result[k.replace("accuracy", "acc")] = float(metrics[k])
    if "test_mean_acc" not in result:  # point-estimate methods: the mean *is* the prediction
        for prefix in ("test", "val"):
            for name in ("acc", "nll", "ece", "brier"):
                result[f"{prefix}_mean_{name}"] = result[f"{prefix}_{name}"]
    write_json(path, result)
    if verbose:
        print(f"[{script}] {key}: test acc {result['test_acc']:.4f} (mean {result['test_mean_acc']:.4f}) "
              f"val acc {result['val_acc']:.4f} fit_flipped {result['fit_flipped']} "
              f"h_med {hess.get('hess_median', float('nan')):.3g} train {train_s:.0f}s eval {eval_s:.0f}s",
              flush=True)
    return result


# -------------------------------------------------------------------------------------------------------------------
# small helpers for the report scripts
# -------------------------------------------------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float]:
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if len(a) == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def fmt_pm(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    m, s = mean_std(values)
    if math.isnan(m):
        return "–"
    if sum(v is not None for v in values) == 1:  # one run has no spread to show
        return f"{m * scale:.{digits}f}"
    return f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"


def run_parallel(jobs: list[dict[str, Any]], workers: int = 2) -> list[dict[str, Any]]:
    """Run `run(**job)` for each job with at most `workers` processes (each one thread); cached jobs return at once.

    The order of `jobs` is the order of execution (put the most informative first).
    """
    todo = [j for j in jobs if cached(**{k: v for k, v in j.items() if k in _CACHED_KEYS}) is None]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} cached, {len(todo)} to train with {workers} worker(s)",
          flush=True)
    if workers <= 1 or len(todo) <= 1:
        for j in todo:
            run(**j)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with ctx.Pool(workers, maxtasksperchild=1) as pool:
            for _ in pool.imap_unordered(_run_job, todo):
                pass
    return [run(**j) for j in jobs]


_CACHED_KEYS = ("script", "method", "hyperparams", "noise", "seed", "epochs", "dataset", "batch_size",
                "eval_mc_samples")


def _run_job(job: dict[str, Any]) -> str:
    try:
        return run(**job)["key"]
    except Exception as e:  # report and go on: a missing method or a diverged run must not stop the batch
        print(f"FAILED {job}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return ""
