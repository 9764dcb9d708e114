"""Predicting with the posterior learned from scratch: Bayesian model averaging at τ = 1 against the posterior mean.

The image example (scikit-learn digits, 40 % symmetric noise, a small BatchNorm ResNet trained from scratch) with its
posterior temperature fixed at 1, so that `evaluate()` scores BMA over the learned posterior (32 draws, each with
BatchNorm statistics of its own, `varsmooth.prediction.batchnorm`) and the posterior mean side by side on the clean
test split; then the saved model, reloaded, scores how well its mutual information (MI) flags inputs it has not seen:
uniform-noise 8×8 images and CIFAR-10 test images turned grayscale 8×8, against the test digits (AUROC, 300 each).

Settings: the library's default and the posterior-width options the default was weighed against (ess as a multiple of
the training-set size N = 1,149, a longer Hessian window, with and without a lower learning rate, two MC samples per
step, the prior precision δ from 0 to a floor on h), and the default on clean labels. Each run also reports both
predictions' NLL on the example's validation split, whose labels are as noisy as the training labels.
3 seeds each. The table is the frontier of mean accuracy against BMA NLL.

The same comparison on MNIST (robustness.py's CNN, 20 epochs, sym-40 and pair-40; `--part mnist`): the sweep's
default-rule runs (robustness.py's cache) against a Hessian window of the whole run, at the default and a lower
learning rate (8 draws at τ = 1, as the sweep predicts).

    OMP_NUM_THREADS=1 python benchmarks/bma_from_scratch.py          # runs cached in results/bma_from_scratch/runs
    OMP_NUM_THREADS=1 python benchmarks/bma_from_scratch.py --part mnist
    python benchmarks/bma_from_scratch.py --report                   # the tables, into benchmarks/README.md
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)
from default_posterior import MNIST_EPOCHS, MNIST_TRAIN_SIZE  # noqa: E402

SCRIPT = "bma_from_scratch"
OUT_DIR = common.RESULTS_DIR / SCRIPT
ROOT = Path(__file__).resolve().parent.parent
SEEDS = (0, 1, 2)
TRAIN_SIZE = 1149  # the image example's training split
#: setting -> the example's flags on top of its defaults
SETTINGS: dict[str, list[str]] = {
    "default": [],
    "ess 2N": ["--ess", str(2 * TRAIN_SIZE)],
    "ess 4N": ["--ess", str(4 * TRAIN_SIZE)],
    "hessian_window 0.3": ["--hessian_window", "0.3"],
    # h0 kept at e^-1 = 37 % at the end (σ ≈ 0.07 where the data adds nothing), and a lower rate, alone and together
    "hessian_window 1": ["--hessian_window", "1"],
    "learning_rate 0.1": ["--learning_rate", "0.1"],
    "hessian_window 1, learning_rate 0.1": ["--hessian_window", "1", "--learning_rate", "0.1"],
    "mc_samples 2": ["--mc_samples", "2"],
    # a floor on the precision where h0 has decayed (to h0·β2^T ≈ 0.014 in most weights): σ² = 1/(ess·(h + δ)); δ
    # is also the prior's pull of the weights towards 0 (weight decay)
    "prior_precision 0": ["--prior_precision", "0"],
    "prior_precision 0.005": ["--prior_precision", "0.005"],
    "prior_precision 0.02": ["--prior_precision", "0.02"],
    "default, clean labels": ["--noise_type", "none"],
    "hessian_window 1, learning_rate 0.1, clean labels": ["--hessian_window", "1", "--learning_rate", "0.1",
                                                          "--noise_type", "none"],
}
OOD_SIZE = 300
#: bumped when a run records other numbers, so that cached runs of an older version are not mixed in
VERSION = 4  # 4: the noisy validation split's accuracy too
#: MNIST: robustness.py's set-up (common.run), its noises where the rule's BMA and mean differ most
MNIST_NOISES = ("sym40", "pair40")


def run(setting: str, seed: int) -> dict[str, Any]:
    path = OUT_DIR / "runs" / f"{setting.replace(' ', '_').replace(',', '')}_s{seed}.json"
    if path.is_file() and json.loads(path.read_text()).get("version") == VERSION:
        return json.loads(path.read_text())
    flags = [*SETTINGS[setting], "--seed", str(seed), "--posterior_temperature", "1", "--label_noise_samples", "0"]
    with tempfile.TemporaryDirectory(prefix="varsmooth-bma-") as tmp:
        folder = Path(tmp) / "run"
        command = [sys.executable, "examples/train_image_classification.py", "--output_dir", str(folder), *flags]
        print(f"[{SCRIPT}] {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
        metrics = json.loads((folder / "all_results.json").read_text())
        # the example's Trainer trains on the GPU when there is one (no use_cpu flag is passed)
        result = {"setting": setting, "seed": seed, "flags": flags, "version": VERSION,
                  "commit": common.code_commit(), "device": "cuda" if common.torch.cuda.is_available() else "cpu",
                  **{k: metrics[k] for k in ("test_accuracy", "test_nll", "test_mean_accuracy", "test_mean_nll",
                                             "test_posterior_samples_averaged", "eval_nll", "eval_mean_nll",
                                             "eval_accuracy", "eval_mean_accuracy")},
                  **ood_auroc(folder, seed)}
    common.write_json(path, result)
    return result


def ood_auroc(folder: Path, seed: int) -> dict[str, float]:
    """From the saved model: the AUROC of its MI and predictive entropy (BMA at τ = 1 with the saved draws) for noise
    images and grayscale CIFAR-10 against the test digits of the run's split; BMA at narrower temperatures, each draw
    with statistics of its own recomputed as the trainer does (from the training images in order, batches of the
    example's 128), and BMA at τ = 1 with the mean's statistics for every draw (what prediction did before)."""
    import numpy as np
    import torch
    from PIL import Image
    from sklearn.metrics import roc_auc_score
    from transformers import AutoImageProcessor

    sys.path.insert(0, str(ROOT / "examples"))
    from example_utils.data import default_data_dir, load_cifar10n, load_digits_dataset, train_eval_splits
    from varsmooth import VariationalModel
    from varsmooth.prediction.batchnorm import draw_batchnorm_statistics
    from varsmooth.prediction.bma import predictive_distribution

    model = VariationalModel.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)

    def pixels(images: list) -> torch.Tensor:
        return processor([im.convert("L") for im in images], return_tensors="pt")["pixel_values"]

    rng = np.random.default_rng(0)
    digits = load_digits_dataset(seed=seed)
    x_test, y_test = pixels(digits["test"]["image"]), torch.as_tensor(digits["test"]["label"])
    unseen = {
        "noise": pixels([Image.fromarray((rng.random((8, 8)) * 255).astype(np.uint8), mode="L")
                         for _ in range(OOD_SIZE)]),
        "cifar10": pixels([im.resize((8, 8)) for im in
                           load_cifar10n(default_data_dir(), "aggre", max_train=10,
                                         max_test=OOD_SIZE)["test"]["image"]]),
    }
    result = {}
    with torch.no_grad():
        test = model(pixel_values=x_test)
        for name, x in unseen.items():
            out = model(pixel_values=x)
            truth = np.r_[np.zeros(len(y_test)), np.ones(len(x))]
            for kind in ("mutual_information", "entropy"):
                score = np.r_[getattr(test, kind).numpy(), getattr(out, kind).numpy()]
                result[f"{'mi' if kind == 'mutual_information' else kind}_auroc_{name}"] = float(
                    roc_auc_score(truth, score))

        def scores(probs: torch.Tensor) -> tuple[float, float]:
            accuracy = (probs.argmax(-1) == y_test).float().mean().item()
            return accuracy, -probs[torch.arange(len(y_test)), y_test].clamp_min(1e-30).log().mean().item()

        train = pixels(train_eval_splits(digits, train_val_split=0.2, seed=seed,
                                         stratify_by_column="label")["train"]["image"])
        batches = [{"pixel_values": train[i:i + 128]} for i in range(0, len(train), 128)]
        network, posterior, draws = model.model, model.posterior, model.num_samples
        for tau in (0.25, 0.5):
            buffers = draw_batchnorm_statistics(network, posterior, lambda: iter(batches), draws, model.seed,
                                                temperature=tau)
            out = predictive_distribution(network, posterior, {"pixel_values": x_test}, draws, model.seed, buffers,
                                          tau)
            result[f"accuracy_tau{tau:g}"], result[f"nll_tau{tau:g}"] = scores(out.probs)
        # τ = 1 with the mean's statistics for every draw (no draw buffers: the old behaviour)
        out = predictive_distribution(network, posterior, {"pixel_values": x_test}, draws, model.seed)
        result["accuracy_mean_statistics"], result["nll_mean_statistics"] = scores(out.probs)
        noise = predictive_distribution(network, posterior, {"pixel_values": unseen["noise"]}, draws, model.seed)
        truth = np.r_[np.zeros(len(y_test)), np.ones(OOD_SIZE)]
        result["mi_auroc_noise_mean_statistics"] = float(roc_auc_score(
            truth, np.r_[out.mutual_information.numpy(), noise.mutual_information.numpy()]))
    return result


def _column(runs: list[dict[str, Any]], key: str, scale: float = 100.0, digits: int = 1) -> str:
    return common.fmt_pm([r[key] for r in runs], scale=scale, digits=digits)


def report() -> str:
    rows = ["| setting | mean acc % | BMA acc % | mean NLL | BMA NLL | BMA NLL τ = 0.5 | BMA NLL τ = 0.25 "
            "| noisy val acc %: mean / BMA | noisy val NLL: mean / BMA | MI AUROC noise "
            "| MI AUROC CIFAR-10 | τ = 1, mean's statistics: acc % / NLL / MI AUROC noise |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shown: list[dict[str, Any]] = []
    for setting in SETTINGS:
        runs = [run(setting, seed) for seed in SEEDS]
        shown += runs
        col = functools.partial(_column, runs)
        rows.append(f"| {setting} | {col('test_mean_accuracy')} | {col('test_accuracy')} | "
                    f"{col('test_mean_nll', 1.0, 3)} | {col('test_nll', 1.0, 3)} | {col('nll_tau0.5', 1.0, 3)} | "
                    f"{col('nll_tau0.25', 1.0, 3)} | {col('eval_mean_accuracy')} / {col('eval_accuracy')} | "
                    f"{col('eval_mean_nll', 1.0, 3)} / {col('eval_nll', 1.0, 3)} | "
                    f"{col('mi_auroc_noise', 1.0, 2)} | {col('mi_auroc_cifar10', 1.0, 2)} | "
                    f"{col('accuracy_mean_statistics')} / {col('nll_mean_statistics', 1.0, 2)} / "
                    f"{col('mi_auroc_noise_mean_statistics', 1.0, 2)} |")
    return ("BMA: 32 draws at τ = 1, each with its own BatchNorm statistics (what `evaluate()` and the saved model "
            "do); clean test split; `noisy val`: the example's validation split, labels as noisy as the training "
            "labels (clean in the clean-label rows), on which settings are chosen; mean ± sd over seeds "
            + ", ".join(map(str, SEEDS)) + ".\n\n" + "\n".join(rows) + "\n\n" + common.stamp_line(shown))


# -- MNIST ----------------------------------------------------------------------------------------------------------
def mnist_settings() -> dict[str, tuple[str, dict[str, Any]]]:
    """setting -> (the script whose cache holds its runs, IVON's hyperparameters for `common.run`). The default is
    the library's rule for this run's length, given explicitly as robustness.py gives it, so that the sweep's own
    runs count here; the others keep h0 at e^-1 (a Hessian window of the whole run), at the default learning rate
    (common.IVON_BASE's 0.2) and at 0.1."""
    import robustness
    from varsmooth.presets import beta2_for_window

    rule = robustness.ivon_setting(MNIST_EPOCHS, MNIST_TRAIN_SIZE)
    whole_run = {**rule, "beta2": round(beta2_for_window(MNIST_EPOCHS * common.steps_per_epoch(MNIST_TRAIN_SIZE, 64),
                                                         1.0), 9)}
    return {"default (the rule)": ("robustness", rule), "hessian_window 1": (SCRIPT, whole_run),
            "hessian_window 1, learning_rate 0.1": (SCRIPT, {**whole_run, "learning_rate": 0.1})}


def mnist_jobs() -> list[dict[str, Any]]:
    return [dict(script=script, method="ivon", hyperparams=hp, noise=noise, seed=seed, epochs=MNIST_EPOCHS)
            for seed in SEEDS for noise in MNIST_NOISES for script, hp in mnist_settings().values()]


def mnist_report() -> str:
    rows = ["| noise | setting | n | mean acc % | BMA acc % | mean NLL | BMA NLL | noisy val NLL: mean / BMA "
            "| flipped labels fitted % | σ median |", "|---|---|---|---|---|---|---|---|---|---|"]
    shown: list[dict[str, Any]] = []
    for noise in MNIST_NOISES:
        for setting, (script, hp) in mnist_settings().items():
            runs = [r for seed in SEEDS if (r := common.cached(script, "ivon", hp, noise, seed, MNIST_EPOCHS))]
            if not runs:
                continue
            shown += runs
            col = functools.partial(_column, runs)
            sigma = common.fmt_pm([r["hessian"]["posterior_std_median"] for r in runs], scale=1.0, digits=3)
            rows.append(f"| {noise} | {setting} | {len(runs)} | {col('test_mean_acc')} | {col('test_acc')} | "
                        f"{col('test_mean_nll', 1.0, 3)} | {col('test_nll', 1.0, 3)} | "
                        f"{col('val_mean_nll', 1.0, 3)} / {col('val_nll', 1.0, 3)} | {col('fit_flipped')} | {sigma} |")
    return ("MNIST, robustness.py's CNN and set-up (9,000 noisy training labels, 20 epochs = 2,820 steps); BMA: 8 "
            "draws at τ = 1 (the sweep's); clean test split; `noisy val NLL`: the noisy validation split; mean ± sd "
            "over the seeds run (n). The default's runs are the sweep's own.\n\n" + "\n".join(rows) + "\n\n"
            # before runs recorded a device, `common.run` trained with use_cpu=True
            + common.stamp_line(shown, unrecorded_device="cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="Write the tables from the cached runs.")
    parser.add_argument("--part", choices=["digits", "mnist"], action="append", default=[],
                        help="What to train (default: the image example's digits); repeat for both.")
    parser.add_argument("--workers", type=int, default=2, help="Runs trained at once (one thread each).")
    args = parser.parse_args()
    parts = args.part or (["digits"] if not args.report else [])
    if "digits" in parts:
        with ThreadPoolExecutor(args.workers) as pool:  # each run is a subprocess; the threads only wait on them
            list(pool.map(lambda job: run(*job), [(setting, seed) for setting in SETTINGS for seed in SEEDS]))
    if "mnist" in parts:
        common.run_parallel(mnist_jobs(), workers=args.workers)
    tables = {SCRIPT: report(), f"{SCRIPT}_mnist": mnist_report()}
    for name, table in tables.items():
        (OUT_DIR / f"{name.replace(SCRIPT, 'frontier')}.md").write_text(table + "\n")
        if args.report:
            common.write_readme_section(name, table)
        print(table)


if __name__ == "__main__":
    main()
