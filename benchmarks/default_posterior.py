"""The default posterior: does IVON's posterior learn in the runs users make, and what does the learning default cost?

Before this study β2 defaulted to each preset's fixed value (the authors' 0.99999 for `scratch` and `lora`, 0.999 for
`finetune`): in the image example's 1,080 steps the Hessian moved 1 % from h0, σ stayed at its initial value, τ = 0
was chosen and the label-noise export was zero. Runs too short for the preset's β2 now take the run-length rule
β2 = 1 − 1/max(c·T, 300) (`hessian_window` = c, varsmooth.presets). This script compares, 3 seeds each, on the clean
test labels:

* ``fixed``: the preset's β2 given explicitly (the default before this study);
* ``rule c``: the run-length rule with `hessian_window` = c (0.1, the library's; other c as candidates);

the library's default (`varsmooth.presets.default_beta2`) is the preset's β2 where it moves the Hessian within the
run (1 − β2^T ≥ 0.1) and the rule with c = 0.1 elsewhere;

on
* the image example at its defaults (scikit-learn digits, 40 % symmetric noise; `examples/train_image_classification.py
  --seed s`), and the text example at its defaults with its word embeddings frozen, as they were until 2026-11-29
  (`examples/train_text_classification.py --seed s --word_embeddings frozen`);
* MNIST with a small CNN, 20 epochs (benchmarks/common.py `run`, the sweep of robustness.py): sym-40, pair-40,
  class-wise κ = 0.4; fixed = the authors' recipe (common.IVON_BASE), rule = the same with `beta2` unset;
* benchmarks/lora.py's four tasks under the `lora` preset (IVON-LoRA, r = 8 on query/value, 189 steps);
* the image example's default run with 0, 20, 30 and 40 % symmetric noise (`--part noise-rates`): whether ε̄ is
  larger for ambiguous examples, against where the posterior mean's confidence sits relative to the peak of ‖ε̄‖₁.

Columns: test accuracy, NLL and ECE of the prediction each run reports (examples: at the chosen posterior temperature
τ; MNIST and LoRA: BMA at τ = 1, and at the posterior mean); the median relative change of IVON's Hessian from h0
(computed from the saved σ for the examples, from the optimizer for the others); for the examples also τ and the
label-noise export's spread (90th/10th percentile of ‖ε̄‖₁) and its Spearman correlation with the predictive entropy
at the posterior mean.

    OMP_NUM_THREADS=1 python benchmarks/default_posterior.py --part examples      # runs cached in
                                                                                  # results/default_posterior/
    OMP_NUM_THREADS=1 python benchmarks/default_posterior.py --part noise-rates   # the image example at 0-40 % noise
    OMP_NUM_THREADS=1 python benchmarks/default_posterior.py --part mnist
    OMP_NUM_THREADS=1 python benchmarks/default_posterior.py --part lora
    python benchmarks/default_posterior.py --report                               # the tables from the cached runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)

SCRIPT = "default_posterior"
OUT_DIR = common.RESULTS_DIR / SCRIPT
ROOT = Path(__file__).resolve().parent.parent
SEEDS = (0, 1, 2)
#: example -> (script, the preset's fixed β2 = the old default)
EXAMPLES = {"image": ("examples/train_image_classification.py", 0.99999),
            "text": ("examples/train_text_classification.py", 0.999)}
#: training examples of each example's default run (for --ess as a multiple of N)
EXAMPLE_TRAIN_SIZES = {"image": 1149, "text": 1920}
MNIST_NOISES = ("sym40", "pair40", "cw0.4")
MNIST_EPOCHS = 20
MNIST_TRAIN_SIZE = 9000  # common.load_mnist's training split
LORA_FIXED = "ivon-lora"  # lora.py's IVON-LoRA with the preset's fixed β2 (0.99999, given explicitly there)
LORA_RULE = "ivon-lora-default"  # the same with β2 unset: the run-length rule
#: symmetric noise rates of the image example's default run for the adaptivity table (0.4 is its default)
NOISE_RATES = (0.0, 0.2, 0.3, 0.4)
#: where the export's ‖ε̄‖₁ peaks in the posterior mean's confidence (varsmooth.label_noise.compute.noise_adaptivity)
PEAK_FACTS = ("mean_confidence_median", "noise_l1_peak_confidence", "below_noise_peak_share")


def _setting_name(window: float | None, ess_factor: float = 1.0) -> str:
    name = "fixed" if window is None else f"rule c={window:g}"
    return name if ess_factor == 1.0 else f"{name}, ess {ess_factor:g}N"


# -- the examples -------------------------------------------------------------------------------------------------
def run_example(example: str, seed: int, window: float | None, ess_factor: float = 1.0,
                noise_rate: float | None = None) -> dict[str, Any]:
    """One example run at its defaults (+ `--beta2` of the preset for `fixed`, `--hessian_window` for a rule,
    `--ess` = `ess_factor` × the training-set size when the factor is not 1, and symmetric noise at `noise_rate`
    (0: none) instead of the example's own when it is given)."""
    script, fixed_beta2 = EXAMPLES[example]
    setting = _setting_name(window, ess_factor)
    name = f"{example}_{setting.replace(' ', '_').replace('=', '').replace(',', '')}_s{seed}"
    if noise_rate is not None:
        name += f"_sym{noise_rate:g}"
    path = OUT_DIR / "runs" / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="varsmooth-default-posterior-") as tmp:
        result = _run_example_in(Path(tmp) / name, script, example, seed, window, fixed_beta2, ess_factor, setting,
                                 noise_rate)
    # the example's Trainer trains on the GPU when there is one (no use_cpu flag is passed)
    result.update(commit=common.code_commit(), device="cuda" if common.torch.cuda.is_available() else "cpu")
    common.write_json(path, result)
    return result


def _run_example_in(folder: Path, script: str, example: str, seed: int, window: float | None, fixed_beta2: float,
                    ess_factor: float, setting: str, noise_rate: float | None) -> dict:
    flags = ["--beta2", str(fixed_beta2)] if window is None else ["--hessian_window", str(window)]
    if example == "text":  # as the text example was when these ran (its IVON_FINETUNE has put them in the posterior
        flags += ["--word_embeddings", "frozen"]  # since 2026-11-29: text_ood.py)
    if ess_factor != 1.0:
        flags += ["--ess", str(ess_factor * EXAMPLE_TRAIN_SIZES[example])]
    if noise_rate is not None:
        flags += (["--noise_type", "none"] if noise_rate == 0
                  else ["--noise_type", "symmetric", "--noise_rate", str(noise_rate)])
    command = [sys.executable, script, "--seed", str(seed), "--output_dir", str(folder), *flags]
    print(f"[{SCRIPT}] {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    metrics = json.loads((folder / "all_results.json").read_text())
    # what comes after training, from the run's own log lines (τ's choice, the label-noise export)
    tau_s = re.search(r"Posterior temperature \S+ chosen by .* in ([0-9.]+) s", done.stderr)
    export_s = re.search(r"Wrote the label noise of .*, ([0-9.]+) s\)", done.stderr)
    result = {"example": example, "setting": setting, "seed": seed,
              "command": [script, "--seed", str(seed), *flags], "test_acc": metrics["test_accuracy"],
              "test_nll": metrics["test_nll"], "test_ece": metrics["test_ece"],
              "test_mean_acc": metrics.get("test_mean_accuracy"),
              "posterior_temperature": metrics.get("test_posterior_temperature"),
              "train_s": metrics.get("train_runtime"), "tau_s": float(tau_s.group(1)) if tau_s else None,
              "export_s": float(export_s.group(1)) if export_s else None, **posterior_facts(folder)}
    if noise_rate is not None:
        result["noise_rate"] = noise_rate
    return result


def posterior_facts(folder: Path) -> dict[str, Any]:
    """What the run's label-noise summary says about its posterior (the Hessian's movement from h0 and the share the
    data set, recovered from the saved σ by `DiagonalGaussianPosterior.summary`) and about its export (the spread and
    adaptivity of ‖ε̄‖₁, `varsmooth.label_noise.compute.noise_adaptivity`)."""
    summary = json.loads((folder / "label_noise_summary.json").read_text())
    adaptivity = summary["adaptivity"]
    return {"hess_change_median": summary["hess_change_median"], "hess_data_share": summary.get("hess_data_share"),
            "sigma_mean": summary["posterior_std_mean"], "noise_l1_mean": summary["all"]["noise_l1"]["mean"],
            "noise_l1_q90_over_q10": adaptivity["noise_l1_q90_over_q10"],
            "noise_entropy_spearman": adaptivity["noise_l1_entropy_spearman"], **{k: adaptivity[k] for k in PEAK_FACTS}}


# -- MNIST and LoRA (the benchmark runners) ---------------------------------------------------------------------
def mnist_jobs() -> list[dict[str, Any]]:
    """fixed: the authors' recipe (common.IVON_BASE: β2 = 0.99999); rule: the default rule's β2 and clip_radius for
    this run's length, given explicitly as robustness.py gives them, so that its cached runs count here."""
    import robustness

    rule = robustness.ivon_setting(MNIST_EPOCHS, MNIST_TRAIN_SIZE)
    return [dict(script="robustness", method="ivon", hyperparams=hp, noise=noise, seed=seed, epochs=MNIST_EPOCHS)
            for seed in SEEDS for noise in MNIST_NOISES for hp in ({}, rule)]


def mnist_row(result: dict[str, Any]) -> dict[str, Any]:
    setting = "fixed" if "beta2" not in result["config"]["hyperparams"] else "rule c=0.1"
    return {"task": f"MNIST {result['config']['noise']}", "setting": setting, "seed": result["config"]["seed"],
            "test_acc": result["test_acc"], "test_nll": result["test_nll"], "test_ece": result["test_ece"],
            "test_mean_acc": result["test_mean_acc"], "hess_change_median": _hessian_change(result),
            # before runs recorded a device, `common.run` trained with use_cpu=True
            "device": "cpu", **common.stamp_fields(result)}


def _hessian_change(result: dict[str, Any]) -> float | None:
    """|h_median − h0|/h0 from the run's Hessian summary (runs cached before `hess_change_median` was logged)."""
    hessian = result.get("hessian", {})
    if "hess_change_median" in hessian:
        return hessian["hess_change_median"]
    return (abs(hessian["hess_median"] - common.IVON_BASE["hess_init"]) / common.IVON_BASE["hess_init"]
            if "hess_median" in hessian else None)


def lora_row(result: dict[str, Any]) -> dict[str, Any]:
    setting = "fixed" if result["config"]["method"] == LORA_FIXED else "rule c=0.1"
    return {"task": f"LoRA {result['config']['task']}", "setting": setting, "seed": result["config"]["seed"],
            "test_acc": result["test_acc"], "test_nll": result["test_nll"], "test_ece": result["test_ece"],
            "test_mean_acc": result.get("test_mean_acc"),
            "hess_change_median": result["hessian"].get("hess_change_median"),
            # before runs recorded a device, lora.py trained with use_cpu=True
            "device": "cpu", **common.stamp_fields(result)}


# -- report -------------------------------------------------------------------------------------------------------
def _cached_rows() -> list[dict[str, Any]]:
    rows = [json.loads(p.read_text()) for p in sorted((OUT_DIR / "runs").glob("*.json"))]
    out = []
    for r in rows:
        if "noise_rate" not in r:
            out.append({**r, "task": f"{r['example']} example (defaults)"})
    for job in mnist_jobs():
        cached = common.cached(**{k: v for k, v in job.items() if k in common._CACHED_KEYS})
        if cached is not None:
            out.append(mnist_row(cached))
    import lora

    for task in lora.TASKS:
        for name in (LORA_FIXED, LORA_RULE):
            for seed in SEEDS:  # the first of lora's versions with these clean-test metrics that has the run
                keys = [common.run_key(dataset=task, noise="", method=name, hyperparams=lora.METHODS[name][1],
                                       epochs=lora.SETUP["epochs"], seed=seed, setup=lora.SETUP, version=version)
                        for version in lora.TEST_VERSIONS]
                paths = [lora.OUT_DIR / "runs" / f"{key}.json" for key in keys]
                path = next((p for p in paths if p.is_file()), None)
                if path is not None:
                    out.append(lora_row(json.loads(path.read_text())))
    return out


def report() -> str:
    rows = _cached_rows()
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["setting"]), []).append(r)
    lines = [
        "# The default posterior: the presets' fixed β2 against the run-length rule",
        "",
        f"Written by `benchmarks/{SCRIPT}.py --report` from the cached runs; the set-up is in the script's docstring. "
        "Clean test labels; mean ± sd over seeds (n = seeds run). `Δh`: median relative change of IVON's Hessian from "
        "h0 (below 0.1 the library warns that it hardly moved). Examples: the prediction the run reports (at the "
        "chosen τ); MNIST and LoRA: BMA at τ = 1 (`mean acc`: at the posterior mean). `‖ε̄‖₁ q90/q10` and `ρ(ε̄, H)`: "
        "the spread of the label-noise export and its Spearman correlation with the predictive entropy at the mean. "
        "`fixed`: the preset's β2 (the default before issue 31); `rule c`: the run-length rule with "
        "`hessian_window` = c. The default (`varsmooth.presets.default_beta2`) keeps the preset's β2 where "
        "1 − β2^T ≥ 0.1 (the text example: 0.999 over 180 steps) and takes the rule with c = 0.1 elsewhere.",
        "",
        "| task | setting | n | acc % | NLL | ECE % | mean acc % | Δh | τ | ‖ε̄‖₁ mean | ‖ε̄‖₁ q90/q10 | ρ(ε̄, H) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pm(values: list[Any], scale: float = 1.0, digits: int = 3) -> str:
        values = [v for v in values if v is not None]
        return common.fmt_pm(values, scale=scale, digits=digits) if values else "–"

    for (task, setting), rs in sorted(groups.items()):
        col = lambda k: [r.get(k) for r in rs]  # noqa: B023, E731
        default = "fixed" if task.startswith("text") else "rule c=0.1"  # what varsmooth.presets.default_beta2 picks
        setting = f"**{setting} (default)**" if setting == default else setting
        taus = sorted({r.get("posterior_temperature") for r in rs if r.get("posterior_temperature") is not None})
        lines.append(
            f"| {task} | {setting} | {len(rs)} | {pm(col('test_acc'), 100, 1)} | {pm(col('test_nll'))} | "
            f"{pm(col('test_ece'), 100, 1)} | {pm(col('test_mean_acc'), 100, 1)} | {pm(col('hess_change_median'))} | "
            f"{', '.join(f'{t:g}' for t in taus) or '–'} | {pm(col('noise_l1_mean'))} | "
            f"{pm(col('noise_l1_q90_over_q10'), digits=2)} | {pm(col('noise_entropy_spearman'), digits=2)} |"
        )
    return "\n".join([*lines, "", common.stamp_line(rows)]) + "\n"


def noise_rate_report() -> str:
    """ρ(‖ε̄‖₁, entropy at the mean) of the image example's default run against its symmetric noise rate."""
    rows = [json.loads(p.read_text()) for p in sorted((OUT_DIR / "runs").glob("image_*_sym*.json"))]
    lines = [
        "Written by `benchmarks/default_posterior.py --part noise-rates --report`: the image example's default run "
        "(the library's default posterior) with `--noise_type symmetric --noise_rate r` (r = 0: `--noise_type none`; "
        "0.4 is the default). `conf. median`: median confidence max_k p̄_k of the posterior mean on the training "
        "examples; `peak at`: the confidence where ‖ε̄‖₁ is largest (the median of the confidence decile with the "
        "largest mean ‖ε̄‖₁); `below peak`: the share of examples predicted less confidently than that "
        "(`varsmooth.label_noise.compute.noise_adaptivity`).",
        "",
        "| noise rate | n | acc % | NLL | Δh | ‖ε̄‖₁ q90/q10 | ρ(ε̄, H) | conf. median | peak at | below peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pm(values: list[Any], scale: float = 1.0, digits: int = 3) -> str:
        return common.fmt_pm(values, scale=scale, digits=digits)

    for rate in sorted({r["noise_rate"] for r in rows}):
        rs = [r for r in rows if r["noise_rate"] == rate]
        col = lambda k: [r[k] for r in rs]  # noqa: B023, E731
        lines.append(
            f"| {rate:g} | {len(rs)} | {pm(col('test_acc'), 100, 1)} | {pm(col('test_nll'))} | "
            f"{pm(col('hess_change_median'), digits=2)} | {pm(col('noise_l1_q90_over_q10'), digits=2)} | "
            f"{pm(col('noise_entropy_spearman'), digits=2)} | {pm(col('mean_confidence_median'), digits=3)} | "
            f"{pm(col('noise_l1_peak_confidence'), digits=3)} | {pm(col('below_noise_peak_share'), 100, 0)} % |"
        )
    return "\n".join([*lines, "", common.stamp_line(rows)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["examples", "noise-rates", "mnist", "lora"], action="append", default=[])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    parser.add_argument("--windows", nargs="+", type=float, default=[0.1],
                        help="hessian_window values of the rule runs of the examples (0.1 = the library default)")
    parser.add_argument("--ess-factors", nargs="+", type=float, default=[1.0],
                        help="ess of the rule runs of the examples as a multiple of the training-set size "
                             "(1 = the default)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--report", action="store_true")
    a = parser.parse_args(argv)
    if "examples" in a.part:
        for seed in a.seeds:
            for example in a.examples:
                run_example(example, seed, None)
                for window in a.windows:
                    for factor in a.ess_factors:
                        run_example(example, seed, window, factor)
    if "noise-rates" in a.part:
        for seed in a.seeds:
            for rate in NOISE_RATES:
                run_example("image", seed, 0.1, noise_rate=rate)
    if "mnist" in a.part:  # cached by robustness.py where it ran them
        common.run_parallel([j for j in mnist_jobs() if j["seed"] in a.seeds], workers=1)
    if "lora" in a.part:
        import lora

        for seed in a.seeds:
            for task in lora.TASKS:
                for name in (LORA_FIXED, LORA_RULE):
                    lora.run(task, name, seed)
    if a.report or not a.part:
        text, rates = report(), noise_rate_report()
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "README.md").write_text(f"{text}\n{rates}")
        common.write_readme_section(SCRIPT, "\n".join(text.splitlines()[2:]))  # the table, under the README's heading
        common.write_readme_section(f"{SCRIPT}_noise_rates", rates)
        print(text, rates, sep="\n")


if __name__ == "__main__":
    main()
