"""What the label-noise export costs at its defaults, against the training it follows (issue 63, item 5).

The export (`VariationalTrainer.label_noise`, `LabelNoiseCallback`) costs S + 1 evaluation passes over the training set
(S = `varsmooth.label_noise.EXPORT_NUM_SAMPLES` posterior draws, in antithetic pairs, and the posterior mean). Goal:
at most 0.5× the training time of a 3-epoch fine-tune and 0.25× that of the main job. This script

* runs the main job (the image example at its defaults, as the README's command does) with the export at S = 2, 4, 8,
  16 and 64 draws (`--label_noise_samples`; the seeded training is the same in each), reads the training time
  (`train_runtime`) and the export's seconds (`label_noise_summary.json`), and compares the per-example ‖ε̄‖₁ and
  the mean ‖ε̄‖₁ of each S with S = 64's (Spearman ρ; ratio of means): how much of the export a smaller S keeps;
* reads the export's seconds of the 3-epoch fine-tunes that benchmarks/hf_finetune.py timed at the default.

    OMP_NUM_THREADS=1 python benchmarks/export_defaults.py
    python benchmarks/export_defaults.py --report      # the table from the saved JSON only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)

RESULTS = common.RESULTS_DIR / "export_defaults.json"
SAMPLES = (2, 4, 8, 16, 64)
#: the export's budget, as a fraction of the training time
BUDGETS = {"main job": 0.25, "3-epoch fine-tune": 0.5}


def main_job(folder: Path) -> dict[str, Any]:
    """The README's main command with the export at each of `SAMPLES` draws (`--label_noise_samples`), into folders
    under `folder`: training is seeded, so every run trains the same posterior (checked: the same test NLL) and only
    the export differs."""
    import numpy as np
    import pyarrow.parquet as pq
    from scipy.stats import spearmanr

    from varsmooth.label_noise import EXPORT_NUM_SAMPLES

    runs = {}
    for samples in SAMPLES:
        out = folder / f"samples-{samples}"
        subprocess.run([sys.executable, str(common.REPO_ROOT / "examples" / "train_image_classification.py"),
                        "--output_dir", str(out), "--label_noise_samples", str(samples)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=common.REPO_ROOT,
                       stdout=subprocess.DEVNULL)
        summary = json.loads((out / "label_noise_summary.json").read_text())
        metrics = json.loads((out / "all_results.json").read_text())
        runs[samples] = {"train_runtime": metrics["train_runtime"], "test_nll": metrics["test_nll"],
                         "seconds": summary["export_seconds"], "num_examples": summary["num_examples"],
                         "noise_l1": np.asarray(pq.read_table(out / "label_noise.parquet").column("noise_l1"))}
    if len({r["test_nll"] for r in runs.values()}) != 1:
        nll = [r["test_nll"] for r in runs.values()]
        raise RuntimeError(f"The main job trained differently across runs: test NLL {nll}.")
    reference = runs[max(SAMPLES)]["noise_l1"]
    return {
        "default_num_samples": EXPORT_NUM_SAMPLES, "num_examples": runs[max(SAMPLES)]["num_examples"],
        "train_runtime": statistics.median(r["train_runtime"] for r in runs.values()),
        "exports": {s: {"seconds": r["seconds"], "train_runtime": r["train_runtime"],
                        "mean_noise_l1": float(r["noise_l1"].mean()),
                        "spearman_vs_64": float(spearmanr(r["noise_l1"], reference).statistic),
                        "mean_ratio_vs_64": float(r["noise_l1"].mean() / reference.mean())}
                    for s, r in runs.items()},
    }


def fine_tunes() -> list[dict[str, Any]]:
    """The export's seconds against the training time in benchmarks/hf_finetune.py's IVON runs at the defaults."""
    runs = []
    for path in sorted((common.RESULTS_DIR / "hf_finetune" / "runs").glob("*.json")):
        r = json.loads(path.read_text())
        if r["method"] == "ivon" and not r["hyperparams"] and "export_seconds" in r:
            runs.append({k: r[k] for k in ("task", "seed", "train_runtime", "export_seconds", "export_num_samples",
                                           "mean_noise_l1", "commit", "device")})
    return runs


def report() -> str:
    r = json.loads(RESULTS.read_text())
    job = r["main_job"]
    default = job["exports"][str(job["default_num_samples"])]
    lines = [f"The export at its default, S = {job['default_num_samples']} posterior draws, against the training it "
             "follows (seconds on one CPU thread; the fine-tunes ran two or more at a time on 2 shared cores, so their "
             "seconds vary with the load, which the training and the export of one run mostly shared):", "",
             "| run | training s | export s | export / training | budget |", "|---|---|---|---|---|",
             f"| main job ({job['num_examples']} examples) | {default['train_runtime']:.1f} | "
             f"{default['seconds']:.1f} | {default['seconds'] / default['train_runtime']:.2f} | "
             f"≤ {BUDGETS['main job']} |"]
    for task in ("text", "text-lora", "image"):
        runs = [f for f in fine_tunes() if f["task"] == task]
        if runs:
            ratio = [f["export_seconds"] / f["train_runtime"] for f in runs]
            lines.append(f"| 3-epoch fine-tune `{task}` (hf_finetune.py, seeds {sorted(f['seed'] for f in runs)}) | "
                         f"{statistics.fmean(f['train_runtime'] for f in runs):.0f} | "
                         f"{statistics.fmean(f['export_seconds'] for f in runs):.0f} | {statistics.fmean(ratio):.2f} "
                         f"(max {max(ratio):.2f}) | ≤ {BUDGETS['3-epoch fine-tune']} |")
    lines += ["", "What fewer draws keep, on the main job's posterior (against S = 64):", "",
              "| S | export s | export / training | mean ‖ε̄‖₁ | mean / S = 64's | Spearman ρ of per-example ‖ε̄‖₁ "
              "with S = 64 |", "|---|---|---|---|---|---|"]
    for s, e in job["exports"].items():
        lines.append(f"| {s} | {e['seconds']:.1f} | {e['seconds'] / e['train_runtime']:.2f} | "
                     f"{e['mean_noise_l1']:.4f} | {e['mean_ratio_vs_64']:.2f} | {e['spearman_vs_64']:.2f} |")
    stamps = sorted({f"{f['commit']} on {f['device']}" for f in fine_tunes()})
    lines += ["", f"Main job: commit {r['commit']}, {r['device']}; fine-tunes: {', '.join(stamps) or 'none'}.",
              "", common.stamp_line([r, *fine_tunes()])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", action="store_true", help="Rewrite the table from the saved JSON only.")
    cli = parser.parse_args()
    if not cli.report:
        with tempfile.TemporaryDirectory() as tmp:
            result = {"main_job": main_job(Path(tmp) / "main-job"), "commit": common.code_commit(), "device": "cpu",
                      "versions": common._versions()}
        common.write_json(RESULTS, result)
    text = report()
    common.write_readme_section("export_defaults", text)
    print(text)


if __name__ == "__main__":
    main()
