"""Issue 22: calibration, selective prediction and out-of-distribution detection of IVON against the standard
baselines, on clean labels and with 40 % symmetric label noise.

Tasks (every test number is on clean labels; choices are made on the noisy validation split only):

* ``mnist``: the reference CNN of common.py on the 9,000-image MNIST subset (1,000 noisy validation images, the clean
  10k test set), ``EPOCHS["mnist"]`` epochs. Out-of-distribution: a fixed random 2,000 CIFAR-10 test images in grayscale
  resized to 28×28, normalised as MNIST.
* ``sst2``: all-MiniLM-L6-v2 cut to two layers, as real_noise.py (its text set-up and data code), on the first
  ``TEXT_TRAIN`` of its shuffled SST-2 training sentences for ``EPOCHS["sst2"]`` epochs (smaller than real_noise.py's
  2,000 × 3 to fit the CPU budget), scored on its 1,000 test sentences; out-of-distribution: the 500 TREC test
  questions.

Methods, each with the cost of its trainings:

* IVON: Bayesian model average over ``MC_SAMPLES`` posterior draws (MNIST: common.IVON_BASE with the run-length
  Hessian rule ``hessian_window=0.1``, as the few-epoch runs of training_length.py need; SST-2: real_noise.py's
  fine-tuning preset).
* ERM, and ERM + temperature scaling: one temperature fitted by NLL on the noisy validation split (Guo et al. 2017).
* LS: label smoothing with α from ``real_noise.LS_GRID`` or 0 (= ERM), chosen per seed on noisy validation accuracy
  (ties: NLL), as real_noise.py chooses it; costs the whole grid.
* MC-dropout: ``MC_SAMPLES`` dropout masks (Gal & Ghahramani 2016). MNIST: a separate training of the CNN with dropout
  ``DROPOUT`` on its hidden features; SST-2: the ERM run itself (MiniLM trains with dropout 0.1), no extra training.
* Ensemble: ``ENSEMBLE`` ERM runs on the same noisy labels from different initial weights (SST-2: different
  classifier initialisations and batch orders), probabilities averaged (Lakshminarayanan et al. 2017).

Metrics: accuracy, NLL, ECE (15 bins), AURC (abstaining by the maximum probability) on the clean test set, and OOD
AUROC / FPR95 for the maximum probability, entropy, mutual information (methods with several predictions) and energy
(logits: ERM's, IVON's at the posterior mean, the ensemble's mean logits, MC-dropout's deterministic ones), all from
`varsmooth.metrics`.

    OMP_NUM_THREADS=1 python benchmarks/uncertainty.py --tasks mnist sst2 --seeds 0 1 2   # train (resumable) + report
    python benchmarks/uncertainty.py --report                                            # tables from the cached runs

Each training is cached by common.run (MNIST) or here (SST-2) as JSON under results/uncertainty/runs/, its predictions
on validation, test and OOD data as .npz under results/uncertainty/cache/ (not tracked); the per-method metrics of
every (task, noise, seed) go to results/uncertainty/metrics.json, from which the report is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)

SCRIPT = "uncertainty"
OUT_DIR = common.RESULTS_DIR / SCRIPT
CACHE_DIR = OUT_DIR / "cache"
METRICS_FILE = OUT_DIR / "metrics.json"
NOISES = ("clean", "sym40")
EPOCHS = {"mnist": 2, "sst2": 2}
TEXT_TRAIN = 1000
MC_SAMPLES = 8
ENSEMBLE = 5
DROPOUT = 0.25
MNIST_OOD = 2000
IVON_MNIST = {"hessian_window": 0.1}
#: seeds of the ensemble members' initial weights: member m of seed s starts from ENSEMBLE_INIT * m + s (member 0 is
#: the ERM run itself)
ENSEMBLE_INIT = 1000


def _real_noise() -> Any:
    import real_noise

    return real_noise


# -------------------------------------------------------------------------------------------------------------------
# predictions
# -------------------------------------------------------------------------------------------------------------------
def predict(trainer: Any, dataset: Any) -> dict[str, np.ndarray]:
    """probs (the method's prediction), logits (the deterministic logits, for the energy) and mutual_information of
    `trainer`'s model on `dataset`, as `evaluate()` predicts them."""
    from varsmooth.evaluation import predictive_outputs

    return {k: v.astype(np.float32) for k, v in predictive_outputs(trainer, dataset).items()}


def _save_predictions(name: str, splits: dict[str, dict[str, np.ndarray]]) -> str:
    path = CACHE_DIR / f"{name}.npz"
    common.write_npz(path, {f"{split}_{k}": v for split, arrays in splits.items() for k, v in arrays.items()})
    return path.name


def load_predictions(run: dict[str, Any]) -> dict[str, dict[str, np.ndarray]] | None:
    path = CACHE_DIR / run["analysis"]["predictions"]
    if not path.is_file():
        return None
    with np.load(path) as f:
        out: dict[str, dict[str, np.ndarray]] = {}
        for key in f.files:
            split, name = key.split("_", 1)
            out.setdefault(split, {})[name] = f[key]
    return out


# -------------------------------------------------------------------------------------------------------------------
# MNIST
# -------------------------------------------------------------------------------------------------------------------
_OOD: dict[str, Any] = {}


def mnist_ood() -> common.ArrayDataset:
    """CIFAR-10 test images (a fixed random MNIST_OOD of them) in grayscale, 28×28, normalised as MNIST."""
    if "mnist" not in _OOD:
        from example_utils.data import load_cifar10n

        try:
            test = load_cifar10n(common.DATA_DIR, max_train=1, max_test=MNIST_OOD, seed=0)["test"]
        except FileNotFoundError as error:
            raise common.DataUnavailable(str(error)) from None
        pixels = np.stack([np.asarray(im.convert("L").resize((28, 28))) for im in test["image"]])
        x = ((pixels.astype(np.float32) / 255.0 - 0.1307) / 0.3081)[:, None]
        _OOD["mnist"] = common.ArrayDataset(x, np.zeros(len(x), dtype=np.int64))
    return _OOD["mnist"]


def mnist_jobs(noise: str, seed: int) -> list[dict[str, Any]]:
    """The trainings of one (noise, seed): (role, common.run keywords)."""
    base = dict(noise=noise, seed=seed, epochs=EPOCHS["mnist"], dataset="mnist", eval_mc_samples=MC_SAMPLES,
                history_every=0, script=SCRIPT)
    ls_grid = _real_noise().LS_GRID
    return ([{"role": "ivon", "method": "ivon", "hyperparams": IVON_MNIST, **base},
             {"role": "erm", "method": "erm", "hyperparams": {}, **base}]
            + [{"role": f"ls{a:g}", "method": "ls", "hyperparams": {"smoothing": a}, **base} for a in ls_grid]
            + [{"role": "dropout", "method": "erm", "hyperparams": {}, "dropout": DROPOUT, **base}]
            + [{"role": f"member{m}", "method": "erm", "hyperparams": {}, "init_seed": ENSEMBLE_INIT * m + seed, **base}
               for m in range(1, ENSEMBLE)])


def run_mnist(job: dict[str, Any]) -> dict[str, Any]:
    job = dict(job)
    role = job.pop("role")
    name = f"mnist_{job['noise']}_{role}_s{job['seed']}"
    ood = mnist_ood()

    def analyze(trainer: Any, val: Any, test: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        if role == "dropout":  # predicted with MC dropout when the methods are scored (`mc_dropout_predictions`)
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            torch.save(trainer.model.state_dict(), CACHE_DIR / f"{name}.pt")
            return {"predictions": f"{name}.npz", "weights": f"{name}.pt"}
        splits = {split: predict(trainer, data) for split, data in (("val", val), ("test", test), ("ood", ood))}
        return {"predictions": _save_predictions(name, splits), "predict_s": time.perf_counter() - t0}

    result = common.run(**job, analyze=analyze)
    if not (CACHE_DIR / result["analysis"].get("weights", result["analysis"]["predictions"])).is_file():
        # the cache is not tracked: a fresh checkout retrains
        result = common.run(**job, analyze=analyze, force=True)
    return {**result, "role": role}


# -------------------------------------------------------------------------------------------------------------------
# SST-2 (TREC as OOD)
# -------------------------------------------------------------------------------------------------------------------
_TEXT: dict[tuple[str, int], dict[str, Any]] = {}


def text_data(noise: str, seed: int) -> dict[str, Any]:
    """real_noise.py's SST-2 data (its noisy validation split and test subset) with the first TEXT_TRAIN training
    sentences, and the TREC test questions as OOD."""
    if (noise, seed) not in _TEXT:
        rn = _real_noise()
        try:
            data = rn.text_data("sst2", noise, seed)
            ood = rn.text_data("trec", "clean", 0)["test"]
        except rn.Unavailable as error:
            raise common.DataUnavailable(str(error)) from None
        train = data["train"].select(range(TEXT_TRAIN))
        train = train.remove_columns([c for c in ("clean_label", "is_corrupted") if c in train.column_names])
        _TEXT[(noise, seed)] = {**data, "train": train, "ood": ood}
    return _TEXT[(noise, seed)]


def text_jobs(noise: str, seed: int) -> list[dict[str, Any]]:
    ls_grid = _real_noise().LS_GRID
    base = {"noise": noise, "seed": seed}
    return ([{"role": "ivon", "method": "ivon", "hyperparams": {}, "init_seed": seed, **base},
             {"role": "erm", "method": "erm", "hyperparams": {}, "init_seed": seed, **base}]
            + [{"role": f"ls{a:g}", "method": "ls", "hyperparams": {"smoothing": a}, "init_seed": seed, **base}
               for a in ls_grid]
            + [{"role": "dropout", "method": "erm", "hyperparams": {}, "init_seed": seed, **base}]
            + [{"role": f"member{m}", "method": "erm", "hyperparams": {}, "init_seed": ENSEMBLE_INIT * m + seed, **base}
               for m in range(1, ENSEMBLE)])


def _text_config(job: dict[str, Any]) -> dict[str, Any]:
    setup = {**_real_noise().TEXT, "n_train": TEXT_TRAIN, "epochs": EPOCHS["sst2"]}
    return {"task": "sst2", "noise": job["noise"], "method": job["method"], "hyperparams": job["hyperparams"],
            "seed": job["seed"], "init_seed": job["init_seed"], "setup": setup, "version": 1}


def text_path(job: dict[str, Any]) -> Path:
    config = _text_config(job)
    key = common.run_key(dataset="sst2", noise=job["noise"], method=job["method"], hyperparams=job["hyperparams"],
                         epochs=config["setup"]["epochs"], seed=job["seed"], init_seed=job["init_seed"],
                         setup=config["setup"], version=config["version"])
    return OUT_DIR / "runs" / f"{key}.json"


def run_text(job: dict[str, Any]) -> dict[str, Any]:
    """Train (or load) one SST-2 run as real_noise.run does (its set-up, optimizers and presets), with the classifier
    initialised from `init_seed`; the MC-dropout role is the ERM run itself, scored with dropout on."""
    if job["role"] == "dropout":
        erm = run_text({**job, "role": "erm"})
        return {**erm, "role": "dropout",
                "analysis": {**erm["analysis"],
                             "predictions": erm["analysis"]["weights"].replace(".pt", "_mcdropout.npz")}}
    from transformers import DataCollatorWithPadding
    from transformers.trainer_callback import PrinterCallback

    from varsmooth import VariationalTrainer
    from varsmooth.methods import learns_posterior

    rn = _real_noise()
    path = text_path(job)
    if path.is_file():
        result = json.loads(path.read_text())
        if (CACHE_DIR / result["analysis"]["predictions"]).is_file():
            return {**result, "role": job["role"]}
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = _text_config(job)
    cfg = config["setup"]
    data = text_data(job["noise"], job["seed"])
    ivon = learns_posterior(job["method"])
    settings = rn.settings_for(rn.Task.parse("sst2-clean"), job["method"], job["hyperparams"])
    steps = math.ceil(TEXT_TRAIN / cfg["batch_size"]) * cfg["epochs"]
    model = rn._minilm(len(data["names"]), job["init_seed"])
    name = f"sst2_{job['noise']}_{job['method']}_{common._slug(job['hyperparams'])}_s{job['seed']}_i{job['init_seed']}"
    with tempfile.TemporaryDirectory(prefix="varsmooth-uncertainty-") as tmp:
        args = common.training_arguments(
            job["method"], output_dir=tmp, num_train_epochs=cfg["epochs"],
            per_device_train_batch_size=cfg["batch_size"],
            per_device_eval_batch_size=256, seed=job["init_seed"], data_seed=job["init_seed"],
            use_cpu=common.bench_device() == "cpu", report_to=[],
            save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            lr_scheduler_type="cosine", warmup_steps=int(0.1 * steps), eval_mc_samples=MC_SAMPLES if ivon else 0,
            eval_seed=0, **settings,
        )
        trainer = VariationalTrainer(model=model, args=args, train_dataset=data["train"],
                                     data_collator=DataCollatorWithPadding(data["tokenizer"]))
        trainer.remove_callback(PrinterCallback)
        training_loss, diverged, train_s = common.train_timed(trainer)
        t0 = time.perf_counter()
        splits = {split: predict(trainer, data[split]) for split in ("val", "test", "ood")}
        analysis = {"predictions": _save_predictions(name, splits), "predict_s": time.perf_counter() - t0}
        if job["method"] == "erm" and job["init_seed"] == job["seed"]:  # for the MC-dropout prediction of this run
            torch.save({k: v for k, v in trainer.model.state_dict().items()}, CACHE_DIR / f"{name}.pt")
            analysis["weights"] = f"{name}.pt"
    val_labels = np.asarray(data["val"]["label"])
    result = {"key": path.stem, "config": config, "settings": settings, "device": common.bench_device(),
              "commit": common.code_commit(),
              "train_s": train_s, "train_loss": training_loss,
              "diverged": diverged, "analysis": analysis, "versions": common._versions(),
              "val_acc": float((splits["val"]["probs"].argmax(-1) == val_labels).mean()),
              "val_nll": float(-np.log(np.clip(splits["val"]["probs"][np.arange(len(val_labels)), val_labels],
                                               1e-30, None)).mean())}
    common.write_json(path, result)
    print(f"[{SCRIPT}] {path.stem}: train {train_s:.0f}s val acc {result['val_acc']:.4f}", flush=True)
    return {**result, "role": job["role"]}


# -------------------------------------------------------------------------------------------------------------------
# MC dropout, from the saved weights of a run
# -------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def mc_dropout_predictions(task: str, run: dict[str, Any], noise: str, seed: int) -> None:
    """Predict val, test and OOD with `MC_SAMPLES` dropout masks
    (`varsmooth.prediction.mc_dropout.mc_dropout_predictive`) from the weights the run saved, and cache them as the
    run's predictions."""
    from transformers import DataCollatorWithPadding

    from varsmooth.prediction.mc_dropout import mc_dropout_predictive

    state = torch.load(CACHE_DIR / run["analysis"]["weights"], weights_only=True)
    if task == "mnist":
        data = common.load_data("mnist")
        model = common.SmallCNN(data.image_shape, data.num_classes, dropout=DROPOUT)
        sets = {"val": common.ArrayDataset(data.x_val, data.y_val),
                "test": common.ArrayDataset(data.x_test, data.y_test), "ood": mnist_ood()}
        collate = None
    else:
        data = text_data(noise, seed)
        model = _real_noise()._minilm(len(data["names"]), run["config"]["init_seed"])
        sets = {split: data[split].remove_columns([c for c in data[split].column_names
                                                   if c not in ("input_ids", "attention_mask", "token_type_ids")])
                for split in ("val", "test", "ood")}
        collate = DataCollatorWithPadding(data["tokenizer"])
    model.load_state_dict(state)
    model.eval()
    splits = {}
    for split, dataset in sets.items():
        parts: dict[str, list[np.ndarray]] = {"probs": [], "logits": [], "mutual_information": []}
        loader = torch.utils.data.DataLoader(dataset, batch_size=256, collate_fn=collate)
        for batch in loader:
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "label")}
            out = mc_dropout_predictive(model, inputs, MC_SAMPLES, seed=0)
            parts["probs"].append(out.probs.numpy())
            parts["logits"].append(out.mean_logits.numpy())
            parts["mutual_information"].append(out.mutual_information.numpy())
        splits[split] = {k: np.concatenate(v).astype(np.float32) for k, v in parts.items()}
    _save_predictions(Path(run["analysis"]["predictions"]).stem, splits)


# -------------------------------------------------------------------------------------------------------------------
# methods from the cached predictions
# -------------------------------------------------------------------------------------------------------------------
def _entropy(probs: np.ndarray) -> np.ndarray:
    return -(probs * np.log(np.clip(probs, 1e-30, None))).sum(-1)


def _temperature_scaled(pred: dict[str, dict[str, np.ndarray]],
                        val_labels: np.ndarray) -> tuple[dict[str, dict[str, np.ndarray]], float]:
    """`pred` with softmax(log p / T), T fitted by NLL on the noisy validation split (logits divided by T too)."""
    from varsmooth.temperature_scaling import TemperatureScaling

    scaling = TemperatureScaling.fit(np.log(np.clip(pred["val"]["probs"], 1e-30, None)), val_labels)
    out = {}
    for split, arrays in pred.items():
        log_probs = scaling.calibrate_log_probs(torch.as_tensor(np.log(np.clip(arrays["probs"], 1e-30, None))))
        out[split] = {**arrays, "probs": log_probs.exp().numpy(), "logits": arrays["logits"] / scaling.temperature}
    return out, scaling.temperature


def _ensemble(members: list[dict[str, dict[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """Average of the members' probabilities; MI = H[average] − mean member entropy; logits = the members' mean."""
    out = {}
    for split in members[0]:
        probs = np.stack([m[split]["probs"] for m in members])
        mean = probs.mean(0)
        out[split] = {"probs": mean, "logits": np.stack([m[split]["logits"] for m in members]).mean(0),
                      "mutual_information": np.clip(_entropy(mean) - _entropy(probs).mean(0), 0, None)}
    return out


def score(pred: dict[str, dict[str, np.ndarray]], test_labels: np.ndarray, with_mi: bool) -> dict[str, float]:
    from varsmooth.metrics import classification_metrics, ood_metrics

    test, ood = pred["test"], pred["ood"]
    metrics = classification_metrics(test["probs"], test_labels)
    metrics.update(ood_metrics(test["probs"], ood["probs"], logits_in=test["logits"], logits_out=ood["logits"],
                               **({"mutual_information_in": test["mutual_information"],
                                   "mutual_information_out": ood["mutual_information"]} if with_mi else {})))
    return metrics


def method_metrics(runs: dict[str, dict[str, Any]], val_labels: np.ndarray,
                   test_labels: np.ndarray) -> dict[str, dict[str, Any]]:
    """Metrics and cost of every method of one (task, noise, seed) from its runs by role; methods with a missing run
    are left out."""
    preds = {role: load_predictions(r) for role, r in runs.items()}
    train_s = {role: r["train_s"] for role, r in runs.items()}
    out: dict[str, dict[str, Any]] = {}

    def add(name: str, pred: dict | None, roles: list[str], with_mi: bool, **extra: Any) -> None:
        if pred is not None and all(role in runs for role in roles):
            out[name] = {**score(pred, test_labels, with_mi), "trainings": len(roles),
                         "train_s": float(sum(train_s[r] for r in roles)), **extra}

    if "ivon" in runs:
        add("IVON (BMA)", preds["ivon"], ["ivon"], True)
    if "erm" in runs:
        add("ERM", preds["erm"], ["erm"], False)
        scaled, temperature = _temperature_scaled(preds["erm"], val_labels)
        add("ERM + TS", scaled, ["erm"], False, temperature=temperature)
        grid = ["erm"] + sorted(r for r in runs if r.startswith("ls"))
        if len(grid) > 1:
            best = max(grid, key=lambda r: (runs[r]["val_acc"], -runs[r]["val_nll"]))
            add("LS (α on noisy val)", preds[best], grid, False,
                alpha=0.0 if best == "erm" else float(best.removeprefix("ls")))
    if "dropout" in runs:
        add("MC-dropout", preds["dropout"], ["dropout"], True)
    members = ["erm"] + [f"member{m}" for m in range(1, ENSEMBLE)]
    if all(m in runs for m in members):
        add(f"Ensemble ({ENSEMBLE})", _ensemble([preds[m] for m in members]), members, True)
    return out


# -------------------------------------------------------------------------------------------------------------------
# driver and report
# -------------------------------------------------------------------------------------------------------------------
def task_jobs(task: str, noise: str, seed: int) -> list[dict[str, Any]]:
    return mnist_jobs(noise, seed) if task == "mnist" else text_jobs(noise, seed)


def run_job(task: str, job: dict[str, Any]) -> dict[str, Any]:
    return run_mnist(job) if task == "mnist" else run_text(job)


def labels_of(task: str, noise: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(noisy validation labels, clean test labels) of one run."""
    if task == "mnist":
        data = common.load_data("mnist")
        return common.noisy_labels(data, noise, seed)[1], data.y_test
    data = text_data(noise, seed)
    return np.asarray(data["val"]["label"]), np.asarray(data["test"]["label"])


def evaluate_cell(task: str, noise: str, seed: int, train: bool) -> dict[str, dict[str, Any]]:
    runs = {}
    for job in task_jobs(task, noise, seed):
        try:
            result = run_job(task, job) if train else cached_job(task, job)
        except common.DataUnavailable as error:
            print(f"skipping {task}: {error}", flush=True)
            return {}
        if result is not None and job["role"] == "dropout" and load_predictions(result) is None:
            mc_dropout_predictions(task, result, noise, seed)
        if result is not None:
            runs[job["role"]] = result
    if not runs:
        return {}
    val_labels, test_labels = labels_of(task, noise, seed)
    return method_metrics(runs, val_labels, test_labels)


def cached_job(task: str, job: dict[str, Any]) -> dict[str, Any] | None:
    """The cached run of `job` whose predictions are on disk, or None (nothing is trained)."""
    if task == "mnist":
        config = dict(dataset=job["dataset"], method=job["method"], hyperparams=job["hyperparams"], noise=job["noise"],
                      seed=job["seed"], epochs=job["epochs"], batch_size=64, eval_mc_samples=job["eval_mc_samples"],
                      version=common.CACHE_VERSION)
        config.update({"init_seed": job["init_seed"]} if job.get("init_seed") is not None else {})
        config.update({"dropout": job["dropout"]} if job.get("dropout") else {})
        path = common.RESULTS_DIR / SCRIPT / "runs" / f"{common.run_key(**config)}.json"
    else:
        path = text_path(job)
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    if job["role"] == "dropout":  # predicted from its weights when scored
        if task == "sst2":
            result["analysis"]["predictions"] = result["analysis"]["weights"].replace(".pt", "_mcdropout.npz")
        return result if (CACHE_DIR / result["analysis"]["weights"]).is_file() else None
    return result if load_predictions(result) is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["mnist", "sst2"], choices=["mnist", "sst2"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--noises", nargs="+", default=list(NOISES), choices=list(NOISES))
    parser.add_argument("--report", action="store_true", help="only write the report from the cached runs")
    args = parser.parse_args()
    stored = json.loads(METRICS_FILE.read_text()) if METRICS_FILE.is_file() else {}
    for seed in args.seeds:  # seed-major: a stopped run still has complete seeds
        for task in args.tasks:
            for noise in args.noises:
                cell = evaluate_cell(task, noise, seed, train=not args.report)
                if len(cell) == len(METHOD_ORDER):  # only complete seeds: every method on the same seeds
                    stored[f"{task}|{noise}|{seed}"] = cell
                    common.write_json(METRICS_FILE, stored)
                    print(f"== {task} {noise} seed {seed}: " + ", ".join(
                        f"{m} acc {v['accuracy']:.4f} aurc {v['aurc']:.4f} ood {v['ood_max_prob_auroc']:.3f}"
                        for m, v in cell.items()), flush=True)
    common.write_readme_section(SCRIPT, report(stored))


METHOD_ORDER = ("ERM", "ERM + TS", "LS (α on noisy val)", "MC-dropout", f"Ensemble ({ENSEMBLE})", "IVON (BMA)")


def report(stored: dict[str, dict[str, dict[str, Any]]]) -> str:
    fmt = common.fmt_pm
    lines = ["## Uncertainty: calibration, selective prediction and OOD detection (issue 22)", "",
             "Written by `benchmarks/uncertainty.py` (see its docstring for the set-up). Mean ± std over the seeds "
             "shown; accuracy, ECE in %; NLL; AURC ×100 (lower is better); OOD AUROC ×100 (higher is better) and "
             "FPR95 in % (lower is better) by the maximum probability; cost = trainings × mean seconds of one "
             "training on one CPU thread of a shared, heavily loaded machine (the seconds vary by 3× between identical "
             "runs: the number of trainings is the reliable cost). Test metrics are on clean labels; with noisy "
             "training labels a calibrated model of the *noisy* labels is underconfident on clean ones, so ECE is "
             "large for every method and temperature scaling fitted on the noisy validation split does not remove "
             "it.", ""]
    for task in ("mnist", "sst2"):
        for noise in NOISES:
            cells = {int(k.split("|")[2]): v for k, v in stored.items() if k.startswith(f"{task}|{noise}|")}
            if not cells:
                lines += [f"### {task.upper()}, {noise}: no completed seed yet "
                          f"(run `benchmarks/uncertainty.py --tasks {task}`).", ""]
                continue
            seeds = sorted(cells)
            ood = "CIFAR-10 (grayscale 28×28)" if task == "mnist" else "TREC"
            lines += [f"### {task.upper()}, {'clean labels' if noise == 'clean' else '40 % symmetric noise'} "
                      f"(OOD: {ood}; seeds {', '.join(map(str, seeds))})", "",
                      "| method | accuracy | NLL | ECE | AURC | OOD AUROC | FPR95 | AUROC entropy | AUROC MI "
                      "| AUROC energy | cost |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for method in METHOD_ORDER:
                rs = [cells[s][method] for s in seeds if method in cells[s]]
                if not rs:
                    continue
                col = lambda key, scale=100.0, digits=2: fmt([r.get(key) for r in rs], scale, digits) if any(  # noqa: B023, E731
                    r.get(key) is not None for r in rs) else "–"  # noqa: B023
                cost = f"{rs[0]['trainings']} × {np.mean([r['train_s'] / r['trainings'] for r in rs]):.0f} s"
                lines.append(f"| {method} | {col('accuracy')} | {col('nll', 1.0, 3)} | {col('ece')} | {col('aurc')} | "
                             f"{col('ood_max_prob_auroc', 100.0, 1)} | {col('ood_max_prob_fpr95', 100.0, 1)} | "
                             f"{col('ood_entropy_auroc', 100.0, 1)} | "
                             f"{col('ood_mutual_information_auroc', 100.0, 1)} | "
                             f"{col('ood_energy_auroc', 100.0, 1)} | {cost} |")
            extra = []
            ls = [cells[s]["LS (α on noisy val)"]["alpha"] for s in seeds if "LS (α on noisy val)" in cells[s]]
            ts = [cells[s]["ERM + TS"]["temperature"] for s in seeds if "ERM + TS" in cells[s]]
            if ls:
                extra.append("LS α chosen: " + ", ".join(f"{a:g}" for a in ls))
            if ts:
                extra.append("ERM temperature: " + ", ".join(f"{t:.2f}" for t in ts))
            lines += ["", "; ".join(extra) + ".", ""] if extra else [""]
            lines += reading(cells, seeds)
    return "\n".join([*lines, "", _stamp(stored)])


def _stamp(stored: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The stamp of the cached runs of the cells shown (task, noise, seed): metrics.json keeps each cell's metrics,
    not its runs, so the runs are read back from the cache by their configuration."""
    shown = set(stored)
    runs = []
    for path in sorted((common.RESULTS_DIR / SCRIPT / "runs").glob("*.json")):
        run = json.loads(path.read_text())
        config = run["config"]
        if f"{config.get('task', config.get('dataset'))}|{config['noise']}|{config['seed']}" in shown:
            runs.append(run)
    return common.stamp_line(runs)


def reading(cells: dict[int, dict[str, dict[str, Any]]], seeds: list[int]) -> list[str]:
    """IVON against the one-training baselines (ERM + TS) and the tuned LS, per seed, on the selective-prediction and
    OOD columns: how often it is better, and the mean difference."""
    out = []
    for rival in ("ERM + TS", "LS (α on noisy val)", f"Ensemble ({ENSEMBLE})"):
        paired = [s for s in seeds if "IVON (BMA)" in cells[s] and rival in cells[s]]
        if not paired:
            continue
        parts = []
        for key, label, lower in (("aurc", "AURC", True), ("ood_max_prob_auroc", "OOD AUROC (max prob)", False),
                                  ("nll", "NLL", True)):
            diff = [cells[s]["IVON (BMA)"][key] - cells[s][rival][key] for s in paired]
            wins = sum((d < 0) if lower else (d > 0) for d in diff)
            scale = 1.0 if key == "nll" else 100.0
            parts.append(f"{label} {'lower' if lower else 'higher'} on {wins}/{len(paired)} seeds "
                         f"(mean difference {scale * np.mean(diff):+.2f})")
        cost = cells[paired[0]][rival]["trainings"]
        out.append(f"- IVON vs {rival} ({cost} training{'s' if cost > 1 else ''} against IVON's 1): "
                   + "; ".join(parts) + ".")
    means = {m: {k: np.mean([cells[s][m][k] for s in seeds if m in cells[s]]) for k in
                 ("ood_max_prob_auroc", "ood_mutual_information_auroc")
                 if all(k in cells[s][m] for s in seeds if m in cells[s])}
             for m in METHOD_ORDER if any(m in cells[s] for s in seeds)}
    if means and min(v["ood_max_prob_auroc"] for v in means.values()) >= 0.99:
        out.append("- Every method detects this OOD set by its maximum probability with AUROC ≥ 99 %: the OOD column "
                   "cannot tell the methods apart here.")
    inverted = [m for m, v in means.items() if v.get("ood_mutual_information_auroc", 1.0) < 0.5]
    if inverted:
        out.append(f"- The mutual information ranks the OOD inputs as *more* certain than the test inputs for "
                   f"{', '.join(inverted)} (AUROC below 50 %): their draws agree on the OOD inputs.")
    return out + [""] if out else []


if __name__ == "__main__":
    main()
