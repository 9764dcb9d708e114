"""Long fine-tunes against early stopping: the comparison users make when they train long enough to memorise (issue 63).

Three-epoch fine-tunes end before AdamW memorises the wrong labels, so every method ties. Users who train longer
stop early on their validation split. Here each task runs 16 epochs (1,008 steps at batch 16) on the user's path of
`hf_finetune.py` (`from_pretrained`, every weight trainable, nothing but the run's length and batch named):

* `cifar10n-worse`: EfficientNet-Lite0 (`AutoModelForImageClassification`) on 1,000 CIFAR-10 images at 64 px with
  their CIFAR-10N "worse" human labels (40 % wrong; CC BY-NC 4.0), 400 noisy validation images, 1,000 clean test;
* `sst2-sym30`, `trec-sym30`: all-MiniLM-L6-v2 (`AutoModelForSequenceClassification`, 6 layers, BERT pooler) on
  1,000 training sentences of SST-2 / TREC with 30 % symmetric noise, 400 more with their own noise as validation,
  the datasets' clean test splits (1,821 / 500).

Methods, each at its defaults:

* `ivon`: `VariationalTrainer` with no preset named (it chooses `finetune` from the loaded weights), predicting by
  Bayesian model averaging (8 samples);
* `erm`: AdamW at HF's defaults (5e-5, linear decay), evaluated and saved every epoch with `load_best_model_at_end`
  and `metric_for_best_model="eval_loss"` on the noisy validation split. One run gives both AdamW rows: the final
  weights (kept when the last step ends) and the early-stopped ones (the checkpoint of lowest validation loss, as
  `EarlyStoppingCallback` with a patience that outlasts the run would keep);
* `ls`: label smoothing at AdamW's defaults, α chosen on seed 0 among `LS_ALPHAS` by noisy-validation accuracy (the
  rule of `hf_finetune.choose_rate`), then run on the other seeds.

Per run: clean-test accuracy, NLL and ECE (scored once, after training and every choice), the share of the
wrongly-labelled training examples the model predicts as labelled after each epoch (at the weights training holds:
IVON's mean), and IVON's mean ‖ε̄‖₁ of its label-noise export (the library's default samples) beside LS's
‖ε_LS‖₁ = 2α(1 − 1/K). Runs are cached under benchmarks/results/long_finetune/runs/ with their commit and device;
`--report` writes the table into benchmarks/README.md and the figure `memorisation.png`, training nothing.

    OMP_NUM_THREADS=1 python benchmarks/long_finetune.py --workers 2
    python benchmarks/long_finetune.py --report
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)
import hf_finetune  # noqa: E402

# isort: split
from transformers import TrainerCallback  # noqa: E402

SCRIPT = "long_finetune"
OUT_DIR = common.RESULTS_DIR / SCRIPT
TASKS = ("cifar10n-worse", "sst2-sym30", "trec-sym30")
NUM_CLASSES = {"cifar10n-worse": 10, "sst2-sym30": 2, "trec-sym30": 6}
SEEDS = [0, 1, 2]
LS_ALPHAS = (0.1, 0.3, 0.5)
#: 16 epochs of 1,000 examples at batch 16: 1,008 steps, within a CPU session's reach
SIZES = {**hf_finetune.SIZES, "n_train": 1000, "batch_size": 16, "epochs": 16}


def build(task: str, seed: int) -> tuple[Any, tuple[Any, Any, Any], Any]:
    """(model, (train, validation, test), collator) of `task`, the training split with its `is_corrupted` column."""
    import numpy as np
    import torch
    from transformers import DataCollatorWithPadding

    torch.manual_seed(seed)  # the new head
    if task == "cifar10n-worse":
        return hf_finetune.image_model(), hf_finetune.image_data(SIZES["n_train"]), None
    from example_utils.data import load_text_dataset

    dataset = task.split("-")[0]
    try:
        raw = load_text_dataset(dataset, data_dir=common.DATA_DIR)
    except FileNotFoundError as error:
        raise common.DataUnavailable(str(error)) from None
    rows = list(zip(raw["train"]["text"], raw["train"]["label"]))
    rows = [rows[i] for i in np.random.RandomState(0).permutation(len(rows))]
    n, n_val = SIZES["n_train"], SIZES["n_val"]
    model, tokenizer = hf_finetune.text_model(NUM_CLASSES[task])
    splits = hf_finetune.noisy_text_splits(rows[:n], rows[n:n + n_val],
                                           list(zip(raw["test"]["text"], raw["test"]["label"])), tokenizer)
    return model, splits, DataCollatorWithPadding(tokenizer)


class WrongLabelsFitted(TrainerCallback):
    """A `TrainerCallback`: after each epoch, the share of the wrongly-labelled training examples that the model
    predicts as labelled, at the weights training holds (IVON's mean: its samples live inside the step)."""

    def __init__(self, wrong: Any, collator: Any, batch_size: int = 64) -> None:
        from torch.utils.data import DataLoader
        from transformers import default_data_collator

        self.batches = list(DataLoader(wrong, batch_size=batch_size, collate_fn=collator or default_data_collator))
        self.history: list[tuple[float, float]] = []

    def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        import torch

        was_training, hits, total = model.training, 0, 0
        model.eval()
        with torch.no_grad():
            for batch in self.batches:
                inputs = {k: v.to(args.device) for k, v in batch.items() if k != "labels"}
                labels = batch["labels"].to(args.device)
                hits += int((model(**inputs).logits.argmax(-1) == labels).sum())
                total += len(labels)
        model.train(was_training)
        self.history.append((float(state.epoch), hits / total))


class FinalWeights(TrainerCallback):
    """A `TrainerCallback` keeping a copy of the weights the last step ends with, before `load_best_model_at_end`
    replaces them."""

    def __init__(self) -> None:
        self.state_dict: dict[str, Any] | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step == state.max_steps:
            self.state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_path(task: str, method: str, hyperparams: dict[str, Any], seed: int) -> Path:
    blob = json.dumps({"task": task, "method": method, "hp": hyperparams, "seed": seed, "sizes": SIZES},
                      sort_keys=True)
    key = f"{task}_{method}_{common._slug(hyperparams)}_s{seed}_{hashlib.sha1(blob.encode()).hexdigest()[:10]}"
    return OUT_DIR / "runs" / f"{key}.json"


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def run(task: str, method: str, hyperparams: dict[str, Any], seed: int) -> dict[str, Any]:
    """One run (cached): the scores of its final weights (and, for AdamW, of its early-stopped ones)."""
    path = run_path(task, method, hyperparams, seed)
    if path.is_file():
        return json.loads(path.read_text())
    from varsmooth import VariationalTrainer, VariationalTrainingArguments

    commit = common.code_commit()  # the code this run starts with (the tree may change while it trains)
    model, (train, val, test), collator = build(task, seed)
    wrong = train.filter(lambda row: row["is_corrupted"]).remove_columns("is_corrupted")
    train = train.remove_columns("is_corrupted")
    fitted, final = WrongLabelsFitted(wrong, collator), FinalWeights()
    early_stopping = method == "erm"
    with tempfile.TemporaryDirectory() as out:
        args = VariationalTrainingArguments(
            output_dir=out, num_train_epochs=SIZES["epochs"], per_device_train_batch_size=SIZES["batch_size"],
            eval_mc_samples=SIZES["eval_mc_samples"], seed=seed, method=method, method_config=hyperparams or None,
            use_cpu=common.bench_device() == "cpu", report_to=[], logging_steps=50, disable_tqdm=True,
            **(dict(eval_strategy="epoch", save_strategy="epoch", save_total_limit=1, load_best_model_at_end=True,
                    metric_for_best_model="eval_loss", greater_is_better=False) if early_stopping
               else dict(save_strategy="no")))
        trainer = VariationalTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                                     data_collator=collator,
                                     callbacks=[fitted, final] if early_stopping else [fitted])
        start = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - start
        result: dict[str, Any] = {}
        if early_stopping:
            evals = [h for h in trainer.state.log_history if "eval_loss" in h]
            best = min(evals, key=lambda h: h["eval_loss"])
            # the test metrics carry the trainer's epoch (the last): the best checkpoint's goes last
            result["early_stopped"] = {**_numbers(trainer.evaluate(test, metric_key_prefix="test")),
                                       "epoch": best["epoch"], "step": best["step"]}
            result["validation_curve"] = [(h["epoch"], h["eval_loss"], h["eval_accuracy"]) for h in evals]
            trainer.model.load_state_dict(final.state_dict)
        result.update(_numbers(trainer.evaluate()))
        result.update(_numbers(trainer.evaluate(test, metric_key_prefix="test")))
        if method == "ivon":
            noise = trainer.label_noise()
            result["mean_noise_l1"] = float(statistics.fmean(noise["noise_l1"]))
    result.update({
        "task": task, "method": method, "hyperparams": hyperparams, "seed": seed,
        "preset": getattr(trainer.args.method_config, "ivon_preset", None),
        "learning_rate": trainer.args.learning_rate, "steps": trainer.state.global_step,
        "wrong_labels_fitted": fitted.history, "train_runtime": output.metrics["train_runtime"],
        "train_and_after_seconds": seconds, "device": common.bench_device(), "commit": commit,
        "versions": common._versions(), "sizes": SIZES,
    })
    common.write_json(path, result)
    return result


def _cached(task: str, method: str, hyperparams: dict[str, Any], seed: int) -> dict[str, Any] | None:
    path = run_path(task, method, hyperparams, seed)
    return json.loads(path.read_text()) if path.is_file() else None


def chosen_alpha(task: str) -> float | None:
    """LS's α for `task`: the candidate of best noisy-validation accuracy on seed 0 (None until all have run)."""
    runs = {a: _cached(task, "ls", {"smoothing": a}, 0) for a in LS_ALPHAS}
    if any(r is None for r in runs.values()):
        return None
    return max(LS_ALPHAS, key=lambda a: runs[a]["eval_accuracy"])


def jobs(seeds: list[int]) -> list[dict[str, Any]]:
    """The runs still to do, seed-major; LS's later seeds once its α is chosen (a second call schedules them)."""
    todo = []
    for seed in seeds:
        for task in TASKS:
            todo += [{"task": task, "method": m, "hyperparams": {}, "seed": seed} for m in ("ivon", "erm")]
            if seed == 0:
                todo += [{"task": task, "method": "ls", "hyperparams": {"smoothing": a}, "seed": 0} for a in LS_ALPHAS]
            elif (alpha := chosen_alpha(task)) is not None:
                todo.append({"task": task, "method": "ls", "hyperparams": {"smoothing": alpha}, "seed": seed})
    return [j for j in todo if _cached(**j) is None]


def _rows(task: str, seeds: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Each reported method's runs (and their scores) on `task`: IVON, AdamW final, AdamW early-stopped, LS."""
    alpha = chosen_alpha(task)
    runs = {m: [r for s in seeds if (r := _cached(task, m, hp, s))]
            for m, hp in (("ivon", {}), ("erm", {}), ("ls", {"smoothing": alpha}))}
    return {"IVON (defaults)": runs["ivon"], "AdamW": runs["erm"],
            "AdamW + early stopping": [{**r, **r["early_stopped"]} for r in runs["erm"]],
            f"LS (α = {alpha:g})" if alpha is not None else "LS": runs["ls"] if alpha is not None else []}


def report(seeds: list[int] = SEEDS) -> str:
    present = sorted({r["seed"] for task in TASKS for runs in _rows(task, seeds).values() for r in runs})
    lines = [f"{SIZES['epochs']} epochs (1,008 steps at batch {SIZES['batch_size']}), mean ± std over seeds "
             f"{present}; clean test, scored once after training. Early stopping: the checkpoint of lowest noisy-"
             "validation loss, evaluated every epoch. ‖ε̄‖₁: IVON's mean label noise of its export; LS's "
             "2α(1 − 1/K). Fitted: the share of the wrongly-labelled training examples predicted as labelled "
             "after the last epoch (AdamW + early stopping: at its best epoch, read from the curve).", "",
             "| task | method | runs | test acc % | NLL | ECE | ‖ε̄‖₁ | wrong labels fitted % | stopped at epoch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task in TASKS:
        for name, runs in _rows(task, seeds).items():
            if not runs:
                continue
            if name.startswith("LS"):
                alpha = runs[0]["hyperparams"]["smoothing"]
                noise = f"{2 * alpha * (1 - 1 / NUM_CLASSES[task]):.3f}"
            elif name.startswith("IVON"):  # two significant digits: a narrow posterior's is orders below LS's
                values = [r["mean_noise_l1"] for r in runs]
                noise = f"{statistics.fmean(values):.2g}" + (f" ± {statistics.stdev(values):.1g}"
                                                              if len(values) > 1 else "")
            else:
                noise = "0"
            stopped = "–"
            fitted = [r["wrong_labels_fitted"][-1][1] for r in runs]
            if "early" in name:
                epochs = [r["epoch"] for r in runs]
                fitted = [dict(r["wrong_labels_fitted"])[r["epoch"]] for r in runs]
                stopped = hf_finetune._cell_values(epochs, 1, 1)
            lines.append(f"| {task} | {name} | {len(runs)} | {hf_finetune._cell(runs, 'test_accuracy', 100, 1)} | "
                         f"{hf_finetune._cell(runs, 'test_nll')} | {hf_finetune._cell(runs, 'test_ece')} | {noise} | "
                         f"{hf_finetune._cell_values(fitted)} | {stopped} |")
    # the early-stopped rows are AdamW's runs again
    runs = [r for task in TASKS for name, rows in _rows(task, seeds).items() if "early" not in name for r in rows]
    lines += ["", common.stamp_line(runs), "", "Figure: `results/long_finetune/memorisation.png` (the share of wrong "
              "labels fitted after each epoch, mean over seeds)."]
    return "\n".join(lines)


def figure(seeds: list[int] = SEEDS) -> Path:
    """The share of wrong training labels fitted after each epoch, one panel per task, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(4 * len(TASKS), 3.2), sharey=True)
    for ax, task in zip(axes, TASKS):
        for name, runs in _rows(task, seeds).items():
            if not runs or "early" in name:
                continue
            curves = [dict(r["wrong_labels_fitted"]) for r in runs]
            epochs = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(epochs, [100 * statistics.fmean(c[e] for c in curves) for e in epochs], label=name)
            if name == "AdamW":  # where early stopping stopped
                for r in runs:
                    ax.axvline(r["early_stopped"]["epoch"], color="grey", lw=0.6, ls=":")
        ax.set_title(task)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("wrong training labels fitted (%)")
    for ax in axes:  # per panel: LS's α is each task's own
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = OUT_DIR / "memorisation.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_job(job: dict[str, Any]) -> None:
    try:
        r = run(**job)
        print(f"{job}: test acc {r.get('test_accuracy')}, {r['train_runtime']:.0f} s", flush=True)
    except common.DataUnavailable as error:
        print(f"skipped {job}: {error}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="Write the table and figure from the cached runs only.")
    cli = parser.parse_args()
    if not cli.report:
        import multiprocessing as mp

        for _ in range(2):  # the second pass runs LS's later seeds, once seed 0 has chosen its α
            with mp.get_context("spawn").Pool(cli.workers, maxtasksperchild=1) as pool:
                list(pool.imap_unordered(_run_job, jobs(cli.seeds)))
    common.write_readme_section(SCRIPT, report())
    figure()
    print(report())


if __name__ == "__main__":
    main()
