"""Learning rates of the non-IVON methods for the image example's from-scratch default (issue 32).

The image example trains a small ResNet from scratch on scikit-learn's digits with 40 % symmetric label noise. At
TrainingArguments' 5e-5 (a fine-tuning rate) AdamW barely trains it. This runs the example itself, as a user does
(`examples/train_image_classification.py --method M --learning_rate LR`), for each method and rate. Each method's
rate is chosen by the negative log-likelihood on the example's *noisy* validation split (held out of the noisy
training labels; a proper scoring rule, where accuracy on a few hundred noisy labels ties), never on the clean test
split; the test scores are reported beside it. A rate chosen at the grid's top edge extends the grid by one rate.

    OMP_NUM_THREADS=1 python benchmarks/example_learning_rates.py                 # erm, ls, gce, sam; seed 0
    OMP_NUM_THREADS=1 python benchmarks/example_learning_rates.py --methods erm --seeds 0,1

Runs are cached under benchmarks/results/example_learning_rates/runs/; report.md and summary.json next to them.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_image_classification.py"
RESULTS = REPO / "benchmarks" / "results" / "example_learning_rates"
RATES = (5e-5, 1e-4, 3e-4, 1e-3, 3e-3)
#: one rate more when the top of RATES wins
EXTENSION = 1e-2


def _commit() -> str:
    """common.code_commit(), imported only when a run is recorded (common imports torch; this driver needs none)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import code_commit

    return code_commit()


def run(method: str, lr: float, seed: int) -> dict:
    """The example's default run for `method` at `lr` (cached): its printed validation and test metrics, and time."""
    path = RESULTS / "runs" / f"{method}_lr{lr:g}_seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, str(EXAMPLE), "--method", method, "--learning_rate", str(lr), "--seed", str(seed),
             "--output_dir", out, "--eval_strategy", "no", "--label_noise_samples", "0", "--disable_tqdm", "true",
             "--use_cpu", "true"], capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{method} at lr {lr} failed:\n{result.stderr[-3000:]}")
    (line,) = [json.loads(x) for x in result.stdout.splitlines() if x.startswith('{"eval_')]
    losses = [float(ast.literal_eval(x)["loss"]) for x in result.stdout.splitlines() if x.startswith("{'loss'")]
    record = {"method": method, "learning_rate": lr, "seed": seed, "seconds": round(seconds, 1),
              "final_train_loss": losses[-1] if losses else None, "device": "cpu",  # --use_cpu true
              "commit": _commit(),
              **{k: line[k] for k in ("eval_accuracy", "eval_nll", "test_accuracy", "test_nll") if k in line}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="erm,ls,gce,sam")
    parser.add_argument("--seeds", default="0")
    options = parser.parse_args()
    rows, chosen = [], {}
    for method in options.methods.split(","):
        for seed in (int(s) for s in options.seeds.split(",")):
            runs = [run(method, lr, seed) for lr in RATES]
            if min(runs, key=lambda r: r["eval_nll"])["learning_rate"] == RATES[-1]:
                runs.append(run(method, EXTENSION, seed))
            best = min(runs, key=lambda r: r["eval_nll"])
            chosen[f"{method}/seed{seed}"] = best["learning_rate"]
            rows += [{**r, "chosen": r is best} for r in runs]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps({"chosen_by_noisy_validation_nll": chosen, "runs": rows},
                                                     indent=2))
    lines = ["# Learning rates of the image example's non-IVON methods (from scratch, digits, 40 % symmetric noise)",
             "", "Chosen by NLL on the noisy validation split; test = the clean test split, scored apart; "
             "s = wall time of the run on a shared 2-core machine (other jobs running, so only a rough cost). "
             "The methods not swept here (gls, ols, alasca, logistic_normal) train with ERM's rate "
             "(`TrainingMethod.scratch_learning_rate`).",
             "",
             "| method | seed | lr | final train loss | val acc (noisy) | val NLL | test acc | test NLL | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['seed']} | {r['learning_rate']:g}{' (chosen)' if r['chosen'] else ''} | "
                     f"{r['final_train_loss']} | {r['eval_accuracy']:.4f} | {r['eval_nll']:.4f} | "
                     f"{r['test_accuracy']:.4f} | {r['test_nll']:.4f} | {r['seconds']} |")
    (RESULTS / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
