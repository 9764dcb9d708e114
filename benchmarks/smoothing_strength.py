"""IVON's smoothing strength chosen like label smoothing's α (`ivon_smoothing`), on real label noise with pretrained
models.

    OMP_NUM_THREADS=1 python benchmarks/smoothing_strength.py                      # train what is missing, then report
    OMP_NUM_THREADS=1 python benchmarks/smoothing_strength.py --tasks cifar10n-worse --seeds 0 1 2
    python benchmarks/smoothing_strength.py --report                              # tables from the cached runs only

The tasks, models, data, optimizer settings and seeds are `real_noise.py`'s (`--plan fair`: IVON's learning rate and
starting ess as chosen there on noisy validation), and its four LoRA tasks (lora.py's set-up: IVON at the `lora`
preset's defaults, ERM, LS and SAM on AdamW-LoRA; nothing tuned but α and ρ). IVON trains at `ivon_smoothing` α ∈ {0
(off: ess as chosen), 0.1, 0.3, 0.5}, LS's grid, and α is chosen per seed on the same noisy validation split by the same
rule: four trainings per seed for each. ERM, LS and SAM (ρ from real_noise.py's grid, chosen by the same rule) train
here too, on the same seeds, labels, batch order and code. The report ends with issue 40's count: on how many tasks IVON
at its chosen strength is at least the most accurate of these baselines in accuracy and NLL.

Every IVON run also measures what it smooths: the mean ‖ε̄_i‖₁ over the first `NOISE_EXAMPLES` training
examples (not the 128-example probe the knob targets), with `NOISE_SAMPLES` posterior draws, beside LS's 2α(1 − 1/K)
at its chosen α and beside the knob's target on those examples, α·mean ‖p̂_i − 1/K‖₁ (p̂_i the posterior mean's
prediction). It also measures whether its mutual information, and the entropy of the same prediction, flag what it
has not seen (`ood_auroc`: AUROC against the other text data set's test sentences and random-token sentences on the
text tasks, against MNIST digits and uniform-noise images on CIFAR-10N). ERM, LS and SAM measure the entropy's, the
reference for IVON's. A run cached before its task had these scores is trained again to measure them. Runs are
cached under benchmarks/results/smoothing_strength/runs/.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)
import real_noise  # noqa: E402

SCRIPT = "smoothing_strength"
#: IVON's grid: LS's, with 0 meaning the knob off (as α = 0 is LS's ERM run)
STRENGTHS = (0.0, *real_noise.LS_GRID)
NOISE_EXAMPLES = 1000
NOISE_SAMPLES = 32
#: sentences of each out-of-distribution set of `ood_auroc`
OOD_SIZE = 500
BATCH = 256
#: the report's seeds (the tables cover every task and seed, whichever a run of the script trains)
SEEDS = (0, 1, 2)
#: IVON's runs compared with the baselines (key of `task_rows`' rows -> name): the count's, and the text example's
IVON_ROWS = {"ivon_chosen": "IVON (strength chosen)", "ivon_example": "IVON at the text example's defaults"}
BASELINES = {"erm": "ERM", "ls": "LS (α chosen)", "sam": "SAM (ρ chosen)"}
TASKS = ("cifar10n-worse", "cifar10n-random1", "cifar10n-aggre", "trec-sym30", "sst2-sym30",
         "sst2-clean-lora", "sst2-sym30-lora", "trec-clean-lora", "trec-sym30-lora")


def ood_sets(tokenizer: Any, test: Any, task: str) -> dict[str, list[dict[str, Any]]]:
    """The test split's inputs and `OOD_SIZE` inputs of each set `ood_auroc` scores against them: for a text task the
    other text data set's test sentences and random-token sentences (text_ood.py's), for a CIFAR-10N task
    uniform-noise images and MNIST digits through the same frozen bottom (`real_noise.cifar_ood_features`)."""
    import numpy as np

    if real_noise.Task.parse(task).kind == "image":
        ood = real_noise.cifar_ood_features(OOD_SIZE)
        return {"test": [{"features": test[i]["features"]} for i in range(len(test))],
                **{name: [{"features": x} for x in features] for name, features in ood.items()}}
    from example_utils.data import load_text_dataset
    from text_ood import encode_sentences, random_token_sentences

    other = {"sst2": "trec", "trec": "sst2"}[task.split("-")[0]]
    texts = list(load_text_dataset(other)["test"].shuffle(seed=0).select(range(OOD_SIZE))["text"])
    other_rows = encode_sentences(tokenizer, texts, real_noise.TEXT["max_length"])
    test_rows = [{k: v for k, v in row.items() if k in other_rows[0]} for row in test]
    return {"test": test_rows, other: other_rows,
            "noise": random_token_sentences(tokenizer, [len(r["input_ids"]) for r in test_rows], OOD_SIZE,
                                            np.random.default_rng(0))}


def ood_auroc(trainer: Any, val: Any, test: Any, task: str) -> dict[str, float]:
    """AUROC ("mi_auroc_<set>") of the mutual information (the learned posterior at τ = 1, `EVAL_MC_SAMPLES`
    draws) of the test inputs against each out-of-distribution set of `ood_sets` (the uncertainty column issue 40 asks
    of these tables), and of the entropy of the same prediction ("entropy_auroc_<set>"): whether the draws disagree
    on what the model has not seen, and whether the averaged prediction is any less sure of it. A point estimate
    (ERM, LS, SAM) has the entropy only: the reference for IVON's. `val` is unused: the signature is
    `real_noise.run`'s `analyze`."""
    import numpy as np
    import torch

    from varsmooth.metrics.ood import auroc
    from varsmooth.prediction.bma import predictive_distribution

    sets = ood_sets(getattr(trainer.data_collator, "tokenizer", None), test, task)
    model, posterior = trainer.accelerator.unwrap_model(trainer.model), trainer.posterior()
    model.eval()
    scores: dict[str, dict[str, np.ndarray]] = {"mi": {}, "entropy": {}}
    with torch.no_grad():
        for name, rows in sets.items():
            batches = (trainer._prepare_inputs(trainer.data_collator(rows[i:i + BATCH]))
                       for i in range(0, len(rows), BATCH))
            out = [predictive_distribution(model, posterior, batch, real_noise.EVAL_MC_SAMPLES) for batch in batches]
            scores["entropy"][name] = np.concatenate([o.entropy.float().cpu().numpy() for o in out])
            if out[0].mutual_information is not None:
                scores["mi"][name] = np.concatenate([o.mutual_information.float().cpu().numpy() for o in out])
    # auroc takes confidences (in-distribution high): the negated uncertainty
    return {f"{score}_auroc_{name}": auroc(-values["test"], -values[name])
            for score, values in scores.items() if values for name in sets if name != "test"}


def measure_smoothing(trainer: Any, val: Any, test: Any, task: str) -> dict[str, Any]:
    """The run's analysis: the mean ‖ε̄‖₁ and mean ‖p̂ − 1/K‖₁ on the first training examples, the final ess, the
    knob's updates and `ood_auroc`."""
    import torch

    from varsmooth.label_noise import SmoothingStrengthCallback, mean_label_noise

    rows = torch.utils.data.Subset(trainer.train_dataset, range(min(NOISE_EXAMPLES, len(trainer.train_dataset))))
    loader = torch.utils.data.DataLoader(rows, batch_size=256, collate_fn=trainer.data_collator)
    batches = (trainer._prepare_inputs(batch) for batch in loader)
    sums = mean_label_noise(trainer.accelerator.unwrap_model(trainer.model), trainer.posterior(), batches,
                            NOISE_SAMPLES, seed=0)
    knob = next((c for c in trainer.callback_handler.callbacks if isinstance(c, SmoothingStrengthCallback)), None)
    return {"noise_l1": sums.noise_l1 / sums.count, "distance_from_uniform": sums.distance_from_uniform / sums.count,
            "ess": trainer.ivon.param_groups[0]["ess"], "updates": knob.history if knob is not None else [],
            **ood_auroc(trainer, val, test, task)}


def example_ivon(task: str) -> dict[str, Any] | None:
    """A text task's IVON as the text example gives it (`real_noise.example_defaults`), knob off: its word embeddings
    in the posterior with their mean frozen, with β2 0.97 and lr 0.1 (the `finetune` preset), or β2 0.99 and the
    `lora` preset's other settings with LoRA. The benchmark's own IVON keeps the embeddings frozen (lr and ess chosen
    on noisy validation, or the `lora` preset); this row is what users of the example get. None for an image task."""
    parsed = real_noise.Task.parse(task)
    if parsed.kind != "text":
        return None
    return {real_noise.AT_DEFAULTS: True, **real_noise.example_defaults("text", "ivon", lora=parsed.lora)}


def jobs(task: str, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """(method, hyperparameters) of every training of one seed: IVON at each strength (and at the text example's
    defaults), ERM, LS at each α and SAM at each ρ."""
    example = example_ivon(task)
    return ([("ivon", {"ivon_smoothing": s} if s else {}) for s in STRENGTHS] + ([("ivon", example)] if example else [])
            + [("erm", {})] + [("ls", {"smoothing": a}) for a in real_noise.LS_GRID]
            + [("sam", {"sam_rho": rho}) for rho in real_noise.SAM_GRID])


def hyperparams(task: str, method: str, hp: dict[str, Any]) -> dict[str, Any]:
    """`hp` with the optimizer settings of real_noise.py's `--plan fair`; a run at an example's defaults has its own."""
    return dict(hp) if hp.get(real_noise.AT_DEFAULTS) else real_noise.fair_hyperparams(task, method, hp)


def train(task: str, method: str, hp: dict[str, Any], seed: int) -> dict[str, Any]:
    """The run, trained unless cached. A run cached before `ood_auroc` measured its task is trained again (the same
    seed, data and settings, now with its OOD scores); the log says whether its metrics repeat, which they do unless
    the code or a dependency changed the training since (the CIFAR-10N runs, benchmarks/README.md)."""
    analyze = functools.partial(measure_smoothing if method == "ivon" else ood_auroc, task=task)
    before = cached(task, method, hp, seed)
    remeasure = (before is not None and before.get("diverged") is None
                 and not any(key.startswith("entropy_auroc_") for key in before.get("analysis") or {}))
    run = real_noise.run(task, method, hyperparams(task, method, hp), seed, analyze=analyze,
                         script=SCRIPT, force=remeasure)
    if remeasure:
        print(f"{task} {method} {hp} seed {seed} trained again for ood_auroc: test acc {before['test_acc']:.4f} -> "
              f"{run['test_acc']:.4f}, NLL {before['test_nll']:.4f} -> {run['test_nll']:.4f}", flush=True)
    return run


def cached(task: str, method: str, hp: dict[str, Any], seed: int) -> dict[str, Any] | None:
    """The run of this script's cache (ERM and LS too: rerun with the IVON runs' code and features, since a
    recomputation of real_noise.py's frozen features or a change of the prediction moves a run by up to ~2 pp)."""
    path = real_noise.run_path(task, method, hyperparams(task, method, hp), seed, script=SCRIPT)
    return json.loads(path.read_text()) if path.is_file() else None


def _chosen(runs: list[tuple[float, dict[str, Any] | None]]) -> tuple[float, dict[str, Any]] | None:
    """The (strength, run) with the best noisy-validation score (real_noise's rule); None while one is missing."""
    if any(r is None for _, r in runs):
        return None
    return max(runs, key=lambda sr: real_noise._val_score(sr[1]))


def _ls_noise(alpha: float, num_classes: int) -> float:
    from varsmooth.label_noise import label_smoothing_noise

    return label_smoothing_noise(alpha, num_classes) if alpha else 0.0


def _num_classes(task: str) -> int:
    return 10 if task.startswith("cifar10n") else {"sst2": 2, "trec": 6}[task.split("-")[0]]


def task_rows(task: str, seeds: list[int]) -> list[dict[str, Any]]:
    """Per seed: ERM, LS (α chosen), SAM (ρ chosen, as real_noise.py: among its grid only), IVON off, IVON (strength
    chosen), each fixed strength, IVON at the text example's defaults; None where not cached (or not a text task)."""
    rows, example = [], example_ivon(task)
    for seed in seeds:
        erm = cached(task, "erm", {}, seed)
        ls = _chosen([(0.0, erm)] + [(a, cached(task, "ls", {"smoothing": a}, seed)) for a in real_noise.LS_GRID])
        ivon = [(s, cached(task, "ivon", {"ivon_smoothing": s} if s else {}, seed)) for s in STRENGTHS]
        sam = _chosen([(rho, cached(task, "sam", {"sam_rho": rho}, seed)) for rho in real_noise.SAM_GRID])
        rows.append({"seed": seed, "erm": erm, "ls": ls, "sam": sam, "ivon": dict(ivon), "ivon_chosen": _chosen(ivon),
                     "ivon_example": cached(task, "ivon", example, seed) if example else None})
    return rows


def _mean_se(values: list[float]) -> str:
    mean, sd = common.mean_std(values)
    return f"{mean:.3g} ± {sd / max(1, len(values)) ** 0.5:.2g}" if len(values) > 1 else f"{mean:.3g}"


def _partial(values: list[float], runs: list[dict[str, Any]]) -> str:
    """How many of the row's runs a column's cell averages, where not all of them measured it."""
    return f" ({len(values)} of {len(runs)} seeds)" if values and len(values) < len(runs) else ""


def task_table(task: str, seeds: list[int]) -> str:
    rows = task_rows(task, seeds)
    k = _num_classes(task)
    lines = [f"#### {task}", ""]
    if real_noise.Task.parse(task).lora:
        lines += [f"LoRA (r {real_noise.LORA['lora_r']} on {' and '.join(real_noise.LORA['target_modules'])}): IVON "
                  f"at the `lora` preset's defaults, ERM, LS and SAM on AdamW-LoRA (lr "
                  f"{real_noise.LORA_BASE['adamw']['learning_rate']:g}); nothing tuned but α and ρ.", ""]
    ivon_runs = [run for r in rows for run in r["ivon"].values() if run]
    # the OOD sets where the task's IVON runs measured them (runs trained since `ood_auroc` covers the task)
    ood = sorted({key.removeprefix("mi_auroc_") for run in ivon_runs for key in run.get("analysis") or {}
                  if key.startswith("mi_auroc_")})
    lines += ["| method | trainings per seed | seeds | acc % | NLL | ECE % | mean ‖ε̄‖₁ (IVON measured; LS 2α(1 − 1/K)) "
              "| IVON's target α·mean ‖p̂ − 1/K‖₁ | strength chosen per seed |"
              + "".join(f" AUROC vs {name}: MI / entropy |" for name in ood),
              "|---|---|---|---|---|---|---|---|---|" + "---|" * len(ood)]

    def auroc_cell(name: str, runs: list[dict[str, Any]]) -> str:
        values = {score: [analysis[key] for run in runs
                          if (key := f"{score}_auroc_{name}") in (analysis := run.get("analysis") or {})]
                  for score in ("mi", "entropy")}
        if not any(values.values()):
            return "–"
        return " / ".join(f"{_mean_se(v)}{_partial(v, runs)}" if v else "–" for v in values.values())

    def line(name: str, trainings: str, runs: list[dict[str, Any]], noise: list[float], target: list[float],
             chosen: str) -> None:
        if not runs:
            return
        uncertainty = [auroc_cell(o, runs) for o in ood]
        lines.append(f"| {name} | {trainings} | {len(runs)} | {_mean_se([100 * r['test_acc'] for r in runs])} | "
                     f"{_mean_se([r['test_nll'] for r in runs])} | {_mean_se([100 * r['test_ece'] for r in runs])} | "
                     f"{_mean_se(noise) if noise else '–'} | {_mean_se(target) if target else '–'} | {chosen} |"
                     + "".join(f" {cell} |" for cell in uncertainty))

    def target(strength: float, run: dict[str, Any]) -> list[float]:
        """The knob's target on the run's measured examples (runs of the knob off have none)."""
        distance = run["analysis"].get("distance_from_uniform")
        return [strength * distance] if strength and distance is not None else []

    erm = [r["erm"] for r in rows if r["erm"]]
    line("erm", "1", erm, [], [], "–")
    ls = [r["ls"] for r in rows if r["ls"]]
    line("ls (α chosen)", str(len(real_noise.LS_GRID) + 1), [run for _, run in ls],
         [_ls_noise(a, k) for a, _ in ls], [], ", ".join(f"{a:g}" for a, _ in ls))
    sam = [r["sam"] for r in rows if r["sam"]]
    line("sam (ρ chosen)", str(len(real_noise.SAM_GRID)), [run for _, run in sam], [], [],
         ", ".join(f"{rho:g}" for rho, _ in sam))
    chosen = [r["ivon_chosen"] for r in rows if r["ivon_chosen"]]
    line("ivon (strength chosen)", str(len(STRENGTHS)), [run for _, run in chosen],
         [run["analysis"]["noise_l1"] for _, run in chosen], [t for s, run in chosen for t in target(s, run)],
         ", ".join(f"{s:g}" for s, _ in chosen))
    for s in STRENGTHS:
        runs = [r["ivon"][s] for r in rows if r["ivon"].get(s)]
        name = "ivon (knob off)" if s == 0 else f"ivon (ivon_smoothing={s:g}; LS's ‖ε‖₁ {_ls_noise(s, k):.3g})"
        line(name, "1", runs, [run["analysis"]["noise_l1"] for run in runs],
             [t for run in runs for t in target(s, run)], "–")
    example = [r["ivon_example"] for r in rows if r["ivon_example"]]
    line("ivon (the text example's defaults, knob off)", "1", example, [run["analysis"]["noise_l1"] for run in example],
         [], "–")
    lines.append("")
    for (ivon, ivon_name), (key, name) in itertools.product(IVON_ROWS.items(), BASELINES.items()):
        paired = paired_difference(rows, key, ivon)
        if paired is not None:
            lines.append(f"{ivon_name} − {name}, paired over {paired['seeds']} seeds: accuracy "
                         f"{paired['acc']:+.2f} ± {paired['acc_se']:.2f} pp (SE; "
                         f"{'separated' if paired['separated'] else 'not separated'} at 2 SE), NLL "
                         f"{paired['nll']:+.3f} ± {paired['nll_se']:.3f}; ahead in accuracy on "
                         f"{paired['ahead']}/{paired['seeds']} seeds.")
    return "\n".join(lines)


def _run(row: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The row's run of `key` (a chosen one's (setting, run) pair gives its run)."""
    value = row[key]
    return value[1] if isinstance(value, tuple) else value


def paired_difference(rows: list[dict[str, Any]], baseline: str, ivon: str = "ivon_chosen") -> dict[str, Any] | None:
    """IVON's run `ivon` (a key of `IVON_ROWS`) − `baseline` over the seeds where both ran: mean accuracy (pp) and NLL
    differences with their standard errors, whether the accuracy difference is beyond 2 SE, and on how many seeds
    IVON is ahead."""
    both = [(_run(r, ivon), _run(r, baseline)) for r in rows if r[ivon] and r[baseline]]
    if not both:
        return None
    diff = [100 * (a["test_acc"] - b["test_acc"]) for a, b in both]
    dnll = [a["test_nll"] - b["test_nll"] for a, b in both]
    (acc, acc_sd), (nll, nll_sd) = common.mean_std(diff), common.mean_std(dnll)
    n = len(diff)
    return {"seeds": n, "acc": acc, "acc_se": acc_sd / n ** 0.5, "nll": nll, "nll_se": nll_sd / n ** 0.5,
            "separated": n > 1 and abs(acc) > 2 * acc_sd / n ** 0.5, "ahead": sum(d > 0 for d in diff)}


def summary(tasks: list[str], seeds: list[int], ivon: str = "ivon_chosen") -> str:
    """Issue 40's count: on how many tasks IVON's run `ivon` (a key of `IVON_ROWS`; the count's own is the strength
    chosen) is at least the best baseline (ERM, LS and SAM chosen on noisy validation; best by mean accuracy) in both
    mean accuracy and mean NLL, and on how many of those its accuracy lead is beyond 2 SE (paired over seeds). Only
    tasks where every one of them has run on every seed."""
    verdicts, good, separated = [], 0, 0
    for task in tasks:
        rows = task_rows(task, seeds)
        if not all(r[ivon] and r["erm"] and r["ls"] and r["sam"] for r in rows):
            continue
        paired = {key: paired_difference(rows, key, ivon) for key in BASELINES}
        best = min(paired, key=lambda key: paired[key]["acc"])  # the smallest IVON lead: the most accurate baseline
        lead = paired[best]
        verdict = f"{task}: vs {best.upper()} {lead['acc']:+.2f} pp, NLL {lead['nll']:+.3f}"
        if lead["acc"] >= 0 and lead["nll"] <= 0:
            good += 1
            separated += lead["separated"]
            verdict += " (at least as good in both" + (", separated)" if lead["separated"] else ")")
        verdicts.append(verdict)
    if not verdicts:
        return ""
    return (f"**{IVON_ROWS[ivon]} against the most accurate baseline of each task** (ERM, LS or SAM chosen): at "
            f"least as good in accuracy and NLL on {good} of {len(verdicts)} tasks, its accuracy lead beyond 2 SE on "
            f"{separated}. " + "; ".join(verdicts) + ".")


def report(tasks: list[str], seeds: list[int]) -> str:
    """The tables of the tasks with at least one cached run, and the count."""
    trained = [t for t in tasks if any(r["erm"] or any(r["ivon"].values()) for r in task_rows(t, seeds))]
    counts = [summary(tasks, seeds, key) for key in IVON_ROWS]
    shown = [_run(row, key) for t in trained for row in task_rows(t, seeds)
             for key in ("erm", "ls", "sam", "ivon_example")] + [
        run for t in trained for row in task_rows(t, seeds) for run in row["ivon"].values()]
    # the runs are real_noise.py's (`real_noise.run`), which trained with use_cpu=True before it recorded a device
    stamp = common.stamp_line(shown, unrecorded_device="cpu")
    text = "\n\n".join([*(task_table(t, seeds) for t in trained), *filter(None, counts), stamp]).strip()
    common.write_readme_section(SCRIPT, text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, help="The tasks to train.")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="The seeds to train.")
    parser.add_argument("--report", action="store_true",
                        help="Only write the tables (of every task and seed) from the cached runs.")
    args = parser.parse_args()
    if not args.report:
        for seed in args.seeds:  # seed-major: a partial run still gives paired rows
            for task in args.tasks:
                for method, hp in jobs(task, seed):
                    train(task, method, hp, seed)
    print(report(list(TASKS), list(SEEDS)))


if __name__ == "__main__":
    main()
