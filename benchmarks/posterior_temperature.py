"""Posterior temperature (issue 24): is the BMA at the chosen τ better calibrated than at τ = 0 and τ = 1, and than
temperature scaling of the logits fitted on the same validation split?

For each run: train IVON, choose τ on a *noisy* validation split with `VariationalTrainer.select_posterior_temperature`
(the library's own path, over `TEMPERATURE_GRID`), then score on the clean test set:

* ``mean`` τ = 0 (the prediction at the posterior mean), ``bma`` τ = 1 (the learned posterior), ``chosen`` τ*;
* ``chosen_corrected`` τ chosen by the noise-corrected validation NLL (forward correction with the transition matrix
  of the injected noise, what the examples do; the synthetic-noise settings only: CIFAR-10N's human noise has none);
* ``ts_mean`` / ``ts_bma``: post-hoc temperature scaling (Guo et al. 2017) of the mean logits / of log P̂ at τ = 1,
  with T fitted by NLL on the same validation split (one evaluation of it instead of one per τ).

Settings:

* ``digits``: the image example's embedded default (scikit-learn digits, 40 % symmetric noise, its small ResNet, 30
  epochs, batch 32, IVON library defaults, 32 posterior samples), except that 20 % of the noisy training split is
  held out as the validation split (the example's own rule for a dataset without an eval split): the example evaluates
  on the test split, which must not choose τ here. Seed s: the example with ``--seed s --noise_seed s``.
* ``mnist_<noise>``: the MNIST sweep of robustness.py (9k noisy train, 1k noisy validation, clean 10k test, small CNN,
  20 epochs, IVON with the sweep's fixed setting, 8 posterior samples, ``common.run``).
* ``cifar10n_worse`` / ``cifar10n_worse_rule``: real_noise.py's CIFAR-10N worse run (EfficientNet-Lite0 fine-tuned on
  4000 images with the human labels, 40 % wrong; its 1000-image noisy validation split; 2000 clean test images; 8
  posterior samples), IVON with the fine-tuning preset / with the `hessian_window` rule on top, at the learning rate
  and ess that real_noise.py's `--plan fair` chose on the noisy validation split (run its tuning first). The run is
  that script's own run of seed s (its cached JSON gains the analysis): the test metrics at τ = 1 are its table's.

    OMP_NUM_THREADS=1 python benchmarks/posterior_temperature.py                         # all settings, 3 seeds
    OMP_NUM_THREADS=1 python benchmarks/posterior_temperature.py --settings digits,mnist_sym40
    python benchmarks/posterior_temperature.py --report-only                            # tables from cached runs

Runs are cached under benchmarks/results/posterior_temperature/runs/ (CIFAR-10N: real_noise.py's runs/); report.md
and summary.json next to them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
import real_noise  # noqa: E402

SCRIPT = "posterior_temperature"
OUT_DIR = common.RESULTS_DIR / SCRIPT
SETTINGS = ["digits", "mnist_sym40", "mnist_pair40", "mnist_cw0.4", "cifar10n_worse_rule", "cifar10n_worse"]
#: the CIFAR-10N settings: real_noise.py's task and the IVON hyperparameters on top of its chosen optimizer settings
CIFAR_SETTINGS = {"cifar10n_worse": ("cifar10n-worse", {}),
                  "cifar10n_worse_rule": ("cifar10n-worse", {"hessian_window": 0.1})}
PREDICTIONS = ["mean", "bma", "chosen", "chosen_corrected", "ts_mean", "ts_bma"]
LABELS = {"mean": "τ = 0 (mean)", "bma": "τ = 1 (BMA)", "chosen": "τ chosen (validation NLL)",
          "chosen_corrected": "τ chosen (noise-corrected validation NLL)", "ts_mean": "TS of mean logits",
          "ts_bma": "TS of BMA log-probs"}


def fit_logit_temperature(log_probs: np.ndarray, labels: np.ndarray) -> float:
    """T > 0 minimizing the NLL of softmax(log_probs / T) (temperature scaling, Guo et al. 2017, Sec. 4.2)."""
    from scipy.optimize import minimize_scalar

    z = torch.as_tensor(log_probs, dtype=torch.float64)
    y = torch.as_tensor(labels)

    def nll(log_t: float) -> float:
        return float(torch.nn.functional.cross_entropy(z / np.exp(log_t), y))

    return float(np.exp(minimize_scalar(nll, bounds=(-4.0, 4.0), method="bounded").x))


def injected_transition(noise: str, num_classes: int) -> np.ndarray:
    """T[i, j] = P(noisy j | clean i) of a synthetic noise spec of common.parse_noise ('sym40', 'pair40', 'cw0.4')."""
    from varsmooth.corruption.transition import classwise_transition, pairflip_transition, symmetric_transition

    noise_type, params = common.parse_noise(noise)
    if noise_type == "classwise":
        return classwise_transition(num_classes, params["kappa"], params["beta"])
    return {"symmetric": symmetric_transition, "pairflip": pairflip_transition}[noise_type](num_classes, params["rate"])


def analyzer(transition: np.ndarray | None) -> Any:
    """`analyze`, which also chooses τ by the noise-corrected NLL when the validation labels' `transition` is known."""
    return lambda trainer, val, test: analyze(trainer, val, test, transition)


def analyze(trainer: Any, val: Any, test: Any, transition: np.ndarray | None = None) -> dict[str, Any]:
    """Choose τ on `val`, then clean-test metrics of every prediction of PREDICTIONS (and the cost of each)."""
    from varsmooth.metrics import classification_metrics
    from varsmooth.prediction.temperature import PosteriorTemperature, check_transition_matrix

    def log_probs(dataset: Any, tau: float) -> tuple[np.ndarray, np.ndarray]:
        trainer.prepare_predictor(PosteriorTemperature(tau))
        out = trainer.predict(dataset)
        return out.predictions, out.label_ids

    t0 = time.perf_counter()
    report = trainer.select_posterior_temperature(val)
    select_s = time.perf_counter() - t0
    chosen = report["temperature"]
    corrected = None
    if transition is not None:
        trainer.eval_noise_transition = check_transition_matrix(transition)
        corrected = trainer.select_posterior_temperature(val)
        trainer.eval_noise_transition = None
    t0 = time.perf_counter()
    val_mean, y_val = log_probs(val, 0.0)
    val_bma, _ = log_probs(val, 1.0)
    temps = {"ts_mean": fit_logit_temperature(val_mean, y_val), "ts_bma": fit_logit_temperature(val_bma, y_val)}
    ts_s = time.perf_counter() - t0
    test_lp = {"mean": log_probs(test, 0.0), "bma": log_probs(test, 1.0), "chosen": log_probs(test, chosen)}
    if corrected is not None:
        test_lp["chosen_corrected"] = log_probs(test, corrected["temperature"])
    trainer.prepare_predictor(PosteriorTemperature.chosen(report))
    y_test = test_lp["mean"][1]
    test_lp["ts_mean"] = (torch.as_tensor(test_lp["mean"][0] / temps["ts_mean"]).log_softmax(-1).numpy(), y_test)
    test_lp["ts_bma"] = (torch.as_tensor(test_lp["bma"][0] / temps["ts_bma"]).log_softmax(-1).numpy(), y_test)
    val_ts = {k: classification_metrics(torch.as_tensor(v / temps[k]).softmax(-1).numpy(), y_val)["nll"]
              for k, v in (("ts_mean", val_mean), ("ts_bma", val_bma))}
    return {
        "temperature": chosen, "val_nll_grid": report["nll"], "val_nll_ts": val_ts, "logit_temperatures": temps,
        "num_samples": report["num_samples"], "select_s": select_s, "ts_fit_s": ts_s,
        **({"temperature_corrected": corrected["temperature"], "val_corrected_nll_grid": corrected["nll"]}
           if corrected else {}),
        "test": {k: classification_metrics(np.exp(lp), y) for k, (lp, y) in test_lp.items()},
    }


def digits_run(seed: int, force: bool = False) -> dict[str, Any]:
    """The image example's embedded default with a noisy validation split held out of its training split."""
    path = OUT_DIR / "runs" / f"digits_example_sym40_s{seed}.json"
    if path.is_file() and not force:
        return json.loads(path.read_text())
    import importlib.util

    from transformers import ViTImageProcessor

    from example_utils.data import load_digits_dataset
    from example_utils.models import create_image_classifier
    from varsmooth import VariationalTrainer
    from varsmooth.corruption import CorruptionArguments

    spec = importlib.util.spec_from_file_location("train_image_classification",
                                                  common.REPO_ROOT / "examples" / "train_image_classification.py")
    example = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(example)  # its dataclasses need the module registered first

    torch.set_num_threads(1)
    data = load_digits_dataset(seed=seed)
    data, reports = CorruptionArguments(noise_type="symmetric", noise_rate=0.4, noise_seed=seed).apply(
        data, label_column="label")
    held = data["train"].train_test_split(test_size=0.2, seed=seed, stratify_by_column="label")
    names = data["train"].features["label"].names
    torch.manual_seed(seed)  # the example leaves the initialisation to the global RNG; fixed here, per seed
    model = create_image_classifier(None, dict(enumerate(names)), num_channels=1)
    processor = ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False)

    def transform(batch: dict) -> dict:
        return {"pixel_values": processor([im.convert("L") for im in batch["image"]],
                                          return_tensors="pt")["pixel_values"],
                "labels": torch.as_tensor(batch["label"])}

    train, val, test = (d.with_transform(transform) for d in (held["train"], held["test"], data["test"]))
    with tempfile.TemporaryDirectory(prefix="varsmooth-temp-") as tmp:
        args = example.ExampleTrainingArguments(
            output_dir=tmp, seed=seed, use_cpu=True, eval_strategy="no", logging_strategy="no", disable_tqdm=True,
            label_noise_samples=0, posterior_temperature=1.0, dataloader_num_workers=0, report_to="none",
        )
        trainer = VariationalTrainer(model=model, args=args, train_dataset=train, processing_class=processor)
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        result = {"setting": "digits", "seed": seed, "n_train": len(train), "n_val": len(val), "n_test": len(test),
                  "realized_noise_train": float(np.mean(np.asarray(held["train"]["label"])
                                                        != np.asarray(held["train"]["clean_label"]))),
                  "epochs": args.num_train_epochs, "eval_mc_samples": args.eval_mc_samples, "train_s": train_s,
                  "hessian": trainer.hessian_summary(), "commit": common.code_commit(), "device": "cpu",
                  "analysis": analyze(trainer, val, test, reports["train"].intended_transition)}
    common.write_json(path, result)
    return result


def mnist_run(noise: str, seed: int, force: bool = False) -> dict[str, Any]:
    import robustness

    epochs, n_train = 20, 9000
    return common.run("ivon", robustness.ivon_setting(epochs, n_train), noise=noise, seed=seed, epochs=epochs,
                      dataset="mnist", history_every=0, script=SCRIPT, force=force,
                      analyze=analyzer(injected_transition(noise, 10)))


def _cifar_job(setting: str, seed: int) -> dict[str, Any]:
    """real_noise.py's own `--plan fair` run of this setting and seed (with its label-noise export on seed 0), so that
    one training serves both scripts: the analysis is added to that run's cached JSON."""
    task, hp = CIFAR_SETTINGS[setting]
    hyperparams = real_noise.fair_hyperparams(task, "ivon", hp)
    return next(j for j in real_noise.fair_jobs(task, sorted({0, seed}), real_noise.chosen_settings(task))
                if j["method"] == "ivon" and j["hyperparams"] == hyperparams and j["seed"] == seed)


def one(setting: str, seed: int, force: bool = False) -> dict[str, Any]:
    if setting == "digits":
        return digits_run(seed, force)
    if setting in CIFAR_SETTINGS:
        return real_noise.run(**_cifar_job(setting, seed), force=force, analyze=analyze)
    return mnist_run(setting.removeprefix("mnist_"), seed, force)


def cached(setting: str, seed: int) -> dict[str, Any] | None:
    if setting == "digits":
        path = OUT_DIR / "runs" / f"digits_example_sym40_s{seed}.json"
        return json.loads(path.read_text()) if path.is_file() else None
    if setting in CIFAR_SETTINGS:
        try:
            job = _cifar_job(setting, seed)
            path = real_noise.run_path(job["task_name"], job["method"], job["hyperparams"], job["seed"])
        except real_noise.Unavailable:
            return None
        return json.loads(path.read_text()) if path.is_file() else None
    import robustness

    return common.cached(SCRIPT, "ivon", robustness.ivon_setting(20, 9000), noise=setting.removeprefix("mnist_"),
                         seed=seed, epochs=20, dataset="mnist")


def report(settings: list[str], seeds: list[int]) -> None:
    md = ["# Posterior temperature vs temperature scaling of the logits", "",
          "Clean-test metrics, mean ± std over the seeds that ran (n). τ chosen by NLL on the noisy validation split "
          "over `varsmooth.prediction.temperature.TEMPERATURE_GRID`; TS = temperature scaling (Guo et al. 2017) fitted "
          "on the same split. Generated by `benchmarks/posterior_temperature.py` (see its docstring for the "
          "settings).", ""]
    summary: dict[str, Any] = {}
    shown: list[dict[str, Any]] = []
    for setting in settings:
        runs = [r for r in (cached(setting, s) for s in seeds) if r is not None and "analysis" in r]
        shown += runs
        if not runs:
            md += [f"## {setting}", "", "not run yet", ""]
            continue
        an = [r["analysis"] for r in runs]
        preds = [p for p in PREDICTIONS if all(p in a["test"] for a in an)]  # the corrected τ: synthetic noise only
        rows = {}
        for pred in preds:
            rows[pred] = {m: common.mean_std([a["test"][pred][m] for a in an])
                          for m in ("accuracy", "nll", "ece", "brier")}
        taus = [a["temperature"] for a in an]
        grid_keys = list(an[0]["val_nll_grid"])
        val_grid = {k: common.mean_std([a["val_nll_grid"][k] for a in an]) for k in grid_keys}
        summary[setting] = {"seeds": [r.get("seed", r.get("config", {}).get("seed")) for r in runs], "chosen_tau": taus,
                            "test": rows, "val_nll_grid": val_grid,
                            "logit_temperatures": [a["logit_temperatures"] for a in an]}
        md += [f"## {setting} (n = {len(runs)})", "",
               f"Chosen τ per seed: {', '.join(f'{t:g}' for t in taus)}; logit temperature T (TS of mean / of BMA) per "
               "seed: " + ", ".join(
                   f"{a['logit_temperatures']['ts_mean']:.2f} / {a['logit_temperatures']['ts_bma']:.2f}" for a in an)
               + ".", "",
               "| prediction | accuracy % | NLL | ECE % | Brier |", "|---|---|---|---|---|"]
        for pred in preds:
            r = rows[pred]
            md.append(f"| {LABELS[pred]} | {r['accuracy'][0] * 100:.2f} ± {r['accuracy'][1] * 100:.2f} | "
                      f"{r['nll'][0]:.4f} ± {r['nll'][1]:.4f} | {r['ece'][0] * 100:.2f} ± {r['ece'][1] * 100:.2f} | "
                      f"{r['brier'][0]:.4f} ± {r['brier'][1]:.4f} |")
        wins = {other: sum(a["test"]["chosen"]["nll"] < a["test"][other]["nll"] for a in an)
                for other in preds if other != "chosen"}
        summary[setting]["chosen_wins_test_nll"] = wins
        worse = {m: sum(a["test"]["chosen"][m] > a["test"]["mean"][m] for a in an) for m in ("nll", "ece", "brier")}
        worse["accuracy"] = sum(a["test"]["chosen"]["accuracy"] < a["test"]["mean"]["accuracy"] for a in an)
        summary[setting]["chosen_worse_than_mean"] = worse
        md += ["", "Seeds where τ chosen has the lower clean-test NLL than: "
               + ", ".join(f"{LABELS[k]} {v}/{len(an)}" for k, v in wins.items()) + ".",
               "Is the BMA at the chosen τ ever worse than the mean prediction (τ = 0) on the clean test set? "
               + ("No" if not any(worse.values()) else "Yes")
               + f": worse NLL on {worse['nll']}/{len(an)} seeds, worse ECE on {worse['ece']}/{len(an)}, "
               f"worse Brier on {worse['brier']}/{len(an)}, lower accuracy on {worse['accuracy']}/{len(an)}. "
               f"Temperature scaling of the mean logits has the lower NLL than τ chosen on "
               f"{len(an) - wins['ts_mean']}/{len(an)} seeds.",
               "", "Validation NLL over the grid (mean over seeds): "
               + ", ".join(f"τ={k}: {v[0]:.4f}" for k, v in val_grid.items()) + ".", ""]
        if "chosen_corrected" in preds:
            taus_c = [a["temperature_corrected"] for a in an]
            worse_c = {m: sum(a["test"]["chosen_corrected"][m] > a["test"]["mean"][m] for a in an)
                       for m in ("nll", "ece", "brier")}
            better = sum(a["test"]["chosen_corrected"]["nll"] < a["test"]["chosen"]["nll"] for a in an)
            summary[setting]["chosen_corrected_tau"] = taus_c
            summary[setting]["chosen_corrected_worse_than_mean"] = worse_c
            md[-1:] = [f"τ chosen by the noise-corrected validation NLL per seed: "
                       f"{', '.join(f'{t:g}' for t in taus_c)}; "
                       f"its BMA is worse than the mean prediction on the clean test set in NLL on "
                       f"{worse_c['nll']}/{len(an)} seeds, ECE {worse_c['ece']}/{len(an)}, "
                       f"Brier {worse_c['brier']}/{len(an)}; it has the lower "
                       f"clean-test NLL than τ chosen by the plain validation NLL on {better}/{len(an)} seeds.", ""]
    # every source trained with use_cpu=True before it recorded a device (digits_run, `common.run`, real_noise.py)
    md += [common.stamp_line(shown, unrecorded_device="cpu"), ""]
    common.write_json(OUT_DIR / "summary.json", {"settings": settings, "seeds": seeds, "table": summary})
    (OUT_DIR / "report.md").write_text("\n".join(md) + "\n")
    # benchmarks/README.md: the same tables, one heading level down, without the report's title
    common.write_readme_section(SCRIPT, "\n".join(line.replace("## ", "#### ", 1) if line.startswith("## ") else line
                                                  for line in md[2:]))
    print("\n".join(md))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {SETTINGS}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--force", action="store_true", help="retrain cached runs")
    a = parser.parse_args(argv)
    settings = a.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {SETTINGS}")
    seeds = list(range(a.seeds))
    if not a.report_only:
        for setting in settings:
            for seed in seeds:
                t0 = time.perf_counter()
                try:
                    r = one(setting, seed, a.force)
                except (common.DataUnavailable, real_noise.Unavailable) as error:
                    print(f"skipping {setting}: {error}", flush=True)
                    break
                print(f"{setting} seed {seed}: τ = {r['analysis']['temperature']:g} ({time.perf_counter() - t0:.0f}s)",
                      flush=True)
    report(settings, seeds)


if __name__ == "__main__":
    main()
