"""`VariationalTrainer.hyperparameter_search` (optuna) as HF users run it: IVON's smoothing strength (its effective
sample size λ = `ess`: the posterior's σ, and with it the label noise IVON induces, shrinks as 1/sqrt(λ)) against label
smoothing's α (`smoothing` of method='ls'), the same number of trials each, chosen by the default objective, the
loss on the *noisy* validation split; each trial's clean-test accuracy is measured beside it, never used to choose.

Set-up: common.py's digits (1,000 training images, 200 validation images, both with 40 % symmetric noise), its CNN,
20 epochs; IVON with IVON_BASE but β2 left to the library's run-length rule; LS with SGD_BASE.
TPE sampler of seed 0, one training seed.

    OMP_NUM_THREADS=1 python benchmarks/hp_search.py            # the search (cached), then the table
    OMP_NUM_THREADS=1 python benchmarks/hp_search.py --report   # the table from the cached result

The result goes to results/hp_search/search.json; the table to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import common  # noqa: E402

SCRIPT = "hp_search"
DATASET, NOISE, SEED, EPOCHS, BATCH, TRIALS = "digits", "sym40", 0, 20, 64, 8
RESULT = common.RESULTS_DIR / SCRIPT / "search.json"
#: per method: the base settings (common.py's, without what the run-length rule or the schedule replaces), the name of
#: the searched setting and its space as (low, high, log)
SEARCHES: dict[str, dict[str, Any]] = {
    "ivon": {"base": {k: v for k, v in common.IVON_BASE.items() if k != "beta2"}, "setting": "ess",
             "space": (100.0, 10000.0, True)},
    "ls": {"base": common.SGD_BASE, "setting": "smoothing", "space": (0.0, 0.9, False)},
}


class CleanTest(TrainerCallback):
    """At the end of each trial, after τ is chosen: the clean-test metrics of the trial's model (descriptive only)."""

    def __init__(self, test: Any) -> None:
        self.test, self.trainer, self.scores = test, None, []

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics = self.trainer.evaluate(self.test, metric_key_prefix="test")
        self.scores.append({"test_acc": metrics["test_accuracy"], "test_nll": metrics["test_nll"],
                            "posterior_temperature": getattr(self.trainer, "posterior_temperature", None)})


def search(method: str) -> list[dict[str, Any]]:
    """The trials of one method's search: the searched value, the objective (noisy-validation loss) and clean-test
    scores."""
    import optuna

    from varsmooth import VariationalTrainer

    torch.set_num_threads(1)
    setup = SEARCHES[method]
    data = common.load_data(DATASET)
    y_train, y_val = common.noisy_labels(data, NOISE, SEED)
    train, val = common.ArrayDataset(data.x_train, y_train), common.ArrayDataset(data.x_val, y_val)
    clean_test = CleanTest(common.ArrayDataset(data.x_test, data.y_test))
    settings = dict(setup["base"])
    settings["warmup_steps"] = settings.pop("warmup_epochs") * common.steps_per_epoch(len(y_train), BATCH)
    suggested: list[float] = []
    objectives: list[float] = []

    def hp_space(trial: Any) -> dict[str, float]:
        low, high, log = setup["space"]
        suggested.append(trial.suggest_float(setup["setting"], low, high, log=log))
        return {setup["setting"]: suggested[-1]}

    def model_init() -> torch.nn.Module:
        torch.manual_seed(SEED)  # every trial starts from the same weights
        return common.SmallCNN(data.image_shape, data.num_classes)

    with tempfile.TemporaryDirectory(prefix="varsmooth-hp-") as tmp:
        args = common.training_arguments(
            method, output_dir=tmp, num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
            per_device_eval_batch_size=1000, seed=SEED, data_seed=SEED, use_cpu=True, report_to=[], save_strategy="no",
            eval_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **settings)
        trainer = VariationalTrainer(model_init=model_init, args=args, train_dataset=train, eval_dataset=val,
                                     callbacks=[clean_test])
        clean_test.trainer = trainer

        def objective(metrics: dict[str, float]) -> float:  # the default one, recorded per trial
            objectives.append(trainer.default_objective(metrics))
            return objectives[-1]

        trainer.hyperparameter_search(hp_space=hp_space, compute_objective=objective, backend="optuna", n_trials=TRIALS,
                                      direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    return [{setup["setting"]: value, "val_loss": objective, **scores}
            for value, objective, scores in zip(suggested, objectives, clean_test.scores)]


def report(result: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["## Hyperparameter search: IVON's λ against LS's α (`hp_search.py`)", "",
             f"`trainer.hyperparameter_search(backend=\"optuna\", n_trials={TRIALS})` per method on digits with 40 % "
             f"symmetric noise ({EPOCHS} epochs, TPE of seed 0), each trial chosen by the default objective: the loss "
             "on the noisy validation split (for IVON at the τ chosen after training). The clean-test columns are "
             "measured beside it and chose nothing.", ""]
    summary = []
    for method, trials in result.items():
        setting = SEARCHES[method]["setting"]
        best = min(trials, key=lambda t: t["val_loss"])
        lines += [f"### {method} (searched: `{setting}`)", "",
                  f"| trial | {setting} | noisy-val loss | clean-test acc % | clean-test NLL |",
                  "|---|---|---|---|---|"]
        lines += [f"| {i}{' (best)' if t is best else ''} | {t[setting]:.4g} | {t['val_loss']:.4f} | "
                  f"{100 * t['test_acc']:.2f} | {t['test_nll']:.4f} |" for i, t in enumerate(trials)]
        lines.append("")
        summary.append(f"{method} {setting} = {best[setting]:.4g}: clean-test accuracy {100 * best['test_acc']:.2f} %, "
                       f"NLL {best['test_nll']:.4f}")
    lines += ["Chosen by noisy validation: " + "; ".join(summary) + ".", "",
              # every trial trained with use_cpu=True
              common.stamp_line([t for trials in result.values() for t in trials], unrecorded_device="cpu"), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="only write the table from the cached result")
    cli = parser.parse_args()
    if cli.report or RESULT.is_file():
        import json

        result = json.loads(RESULT.read_text())
    else:
        stamp = {"commit": common.code_commit(), "device": "cpu"}  # each trial is a run (use_cpu=True)
        result = {method: [{**trial, **stamp} for trial in search(method)] for method in SEARCHES}
        common.write_json(RESULT, result)
    assert all(math.isfinite(t["val_loss"]) for trials in result.values() for t in trials)
    common.write_readme_section(SCRIPT, report(result))


if __name__ == "__main__":
    main()
