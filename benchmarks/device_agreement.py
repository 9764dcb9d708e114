"""Do the robustness sweep's GPU runs agree with the CPU? Rerun some of them on the CPU and compare.

Part of the MNIST sweep (`robustness.py`) was trained on a GPU (`VARSMOOTH_BENCH_DEVICE=cuda`) and shares the cache
keys of the CPU runs: the device is recorded but is not part of the experiment. This script checks that assumption:
it takes the seed-0 GPU runs, one per (method, hyperparameters) on the first noise that has it, retrains each on the
CPU under its own cache (benchmarks/results/device_agreement/runs/) and reports both results side by side. Floating
point differs between devices, so runs are not bit-identical; agreement means differences of the size of the
seed-to-seed spread, not larger.

    OMP_NUM_THREADS=1 python benchmarks/device_agreement.py --runs 6 --workers 2
    python benchmarks/device_agreement.py --runs 6 --report      # the table from the cached runs only
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SCRIPT = "device_agreement"
SOURCE = common.RESULTS_DIR / "robustness" / "runs"
OUT_DIR = common.RESULTS_DIR / SCRIPT
_JOB_KEYS = ("method", "hyperparams", "noise", "seed", "epochs", "dataset", "batch_size", "eval_mc_samples")


def gpu_runs(n: int) -> list[dict]:
    """`n` seed-0 GPU runs of the sweep, distinct (method, hyperparameters), taking the methods in turn (a method at
    its defaults apart from the method with set hyperparameters; file-name order within) so that a few runs cover
    every method."""
    by_method: dict[tuple[str, bool], list[dict]] = {}
    seen = set()
    for path in sorted(SOURCE.glob("*.json")):
        r = json.loads(path.read_text())
        c = r["config"]
        ident = (c["method"], json.dumps(c["hyperparams"], sort_keys=True))
        if r.get("device") == "cuda" and c["seed"] == 0 and ident not in seen:
            seen.add(ident)
            by_method.setdefault((c["method"], bool(c["hyperparams"])), []).append(r)
    in_turn = [r for rnd in itertools.zip_longest(*by_method.values()) for r in rnd if r is not None]
    return in_turn[:n]


def seed_runs(config: dict) -> list[dict]:
    """The sweep's runs of `config` on every seed it has (0, 1, 2, ...), whichever device trained them."""
    runs, seed = [], 0
    while (r := common.cached("robustness", **{**{k: config[k] for k in _JOB_KEYS}, "seed": seed})) is not None:
        runs.append(r)
        seed += 1
    return runs


def report(gpu: list[dict], cpu: list[dict]) -> str:
    """report.md and the `device_agreement` section of benchmarks/README.md: each GPU run beside its CPU rerun."""
    lines = ["Clean-test accuracy and NLL, and noisy-validation accuracy (the selection metric). GPU: the committed "
             "sweep run; CPU: retrained by `device_agreement.py`. Same data, labels, initialisation and batch order; "
             "the devices round differently and IVON draws its weight noise from the device's own generator. The "
             "yardstick is the seed-to-seed spread of the same configuration in the sweep (std of clean-test accuracy "
             "over its seeds; a seed also redraws the noisy labels). Two independent runs with spread σ differ by "
             "1.13·√2·σ ≈ 1.6σ on average.", "",
             "| run | test acc % GPU / CPU | GPU − CPU pp | seed std pp (n) | test NLL GPU / CPU | "
             "noisy-val acc % GPU / CPU |", "|---|---|---|---|---|---|"]
    diffs, ratios = [], []
    for g, c in zip(gpu, cpu):
        seeds = [r["test_acc"] for r in seed_runs(g["config"])]
        std = 100 * common.mean_std(seeds)[1]  # 0 for a single seed: no yardstick, no ratio
        diffs.append(100 * (g["test_acc"] - c["test_acc"]))
        if std > 0:
            ratios.append(abs(diffs[-1]) / std)
        lines.append(f"| {g['key'].rsplit('_', 1)[0]} | {100 * g['test_acc']:.2f} / {100 * c['test_acc']:.2f} | "
                     f"{diffs[-1]:+.2f} | {std:.2f} ({len(seeds)}) | {g['test_nll']:.3f} / {c['test_nll']:.3f} | "
                     f"{100 * g['val_acc']:.1f} / {100 * c['val_acc']:.1f} |")
    abs_diffs = [abs(d) for d in diffs]
    lines += ["", f"GPU − CPU test accuracy: mean {common.mean_std(diffs)[0]:+.2f} pp, mean |difference| "
              f"{common.mean_std(abs_diffs)[0]:.2f} pp, largest {max(abs_diffs):.2f} pp; |difference| / seed std: mean "
              f"{common.mean_std(ratios)[0]:.2f}, largest {max(ratios, default=float('nan')):.2f}.",
              # mixed devices by design; before runs recorded a device, `common.run` trained with use_cpu=True
              "", common.stamp_line([*gpu, *cpu], unrecorded_device="cpu")]
    text = "\n".join(lines)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "report.md").write_text("# GPU vs CPU: the same sweep runs on both devices\n\n" + text + "\n")
    common.write_readme_section("device_agreement", text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="how many GPU runs to retrain on the CPU")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only the table, from the cached CPU reruns (no training)")
    a = p.parse_args()
    if common.bench_device() != "cpu" and not a.report:
        sys.exit("device_agreement.py retrains on the CPU: unset VARSMOOTH_BENCH_DEVICE.")
    gpu = gpu_runs(a.runs)
    if not gpu:
        sys.exit(f"No GPU runs in {SOURCE}: nothing to compare.")
    jobs = [{**{k: r["config"][k] for k in _JOB_KEYS}, "script": SCRIPT, "verbose": False} for r in gpu]
    if a.report:
        cpu = [common.cached(**{k: v for k, v in job.items() if k != "verbose"}) for job in jobs]
        if any(c is None for c in cpu):
            sys.exit(f"Not every CPU rerun is cached in {OUT_DIR / 'runs'}: run without --report first.")
    else:
        cpu = common.run_parallel(jobs, workers=a.workers)
    print(report(gpu, cpu))


if __name__ == "__main__":
    main()
