"""Label-noise robustness on real data: IVON with ONE fixed setting vs the best-tuned baselines.

For every noise and seed: IVON (one setting for all noise levels, no tuning), label smoothing best of its α grid,
SAM best of its ρ grid (grids: `grids.DEFAULT_GRIDS`), ERM, and the other baselines of the
library (GCE, OLS, logistic-normal, ALASCA) at their published defaults. Baseline hyperparameters are chosen per
(noise, seed) by accuracy on the *noisy* validation split, never on the clean test set. Reported: clean-test
accuracy, NLL and ECE, mean ± std over seeds; JSON + markdown table + plot in benchmarks/results/robustness/.

    OMP_NUM_THREADS=1 python benchmarks/robustness.py --quick            # digits, 3 noises, 2 seeds, < 10 min
                                                                         # on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/robustness.py                    # MNIST, 10 noises, 3 seeds: many hours
    OMP_NUM_THREADS=1 python benchmarks/robustness.py --noises sym40,pair40,cw0.4 --methods ivon,ls,erm
    OMP_NUM_THREADS=1 python benchmarks/robustness.py --fig6             # fixed vs learned Hessian (Fig. 6 of [1])
    OMP_NUM_THREADS=1 python benchmarks/robustness.py --fig10            # Hessian-init sensitivity (Fig. 10 of [1])
    python benchmarks/robustness.py --report-only [--quick]              # tables/plot from cached runs

The full sweep's report also writes its accuracy and calibration tables into benchmarks/studies/robustness.md (and
the headline table of the repository's README.md) and the results summary's figures accuracy_vs_noise.png and
calibration_vs_noise.png; `--fig6` and `--fig10` write their tables into benchmarks/studies/robustness.md.

Runs are cached in benchmarks/results/robustness/runs/ (resumable; interrupt and rerun at will).

[1] Variational Learning Induces Adaptive Label Smoothing (2025).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import common  # noqa: E402

SCRIPT = "robustness"
OUT_DIR = common.RESULTS_DIR / SCRIPT
FULL_NOISES = ["sym20", "sym40", "sym60", "pair20", "pair40", "cw0.1", "cw0.2", "cw0.3", "cw0.4", "cw0.5"]
QUICK_NOISES = ["sym40", "pair40", "cw0.4"]
#: execution order of the full sweep (all seeds of a noise before the next): the paper's headline settings first, so an
#: interrupted sweep leaves complete 3-seed columns rather than one seed of everything (κ 0.5 early: the paper's
#: class-wise claim is about κ 0.4-0.5)
RUN_PRIORITY = ["sym40", "pair40", "cw0.4", "sym20", "pair20", "cw0.5", "sym60", "cw0.2", "cw0.1", "cw0.3"]
OTHER_BASELINES = ["gce", "ols", "logistic_normal", "alasca"]
HESS_INITS_FIG10 = [0.01, 0.05, 0.1, 0.2, 0.5, 1.0]
HESS_INITS_FIG6 = [0.05, 0.2, 0.5]


def grids(quick: bool) -> dict[str, list[dict]]:
    """Baseline grids of the papers (grids.py; α = 0 of LS is ERM and is shared with it)."""
    from grids import DEFAULT_GRIDS

    ls = [a for a in DEFAULT_GRIDS["ls"]["smoothing"] if a > 0]
    rho = list(DEFAULT_GRIDS["sam"]["sam_rho"])
    if quick:  # the quick mode trims the grids to keep within 10 minutes; the full mode runs them whole
        ls, rho = [0.3, 0.7, 0.9], [0.05, 0.2]
    return {"ls": [{"smoothing": a} for a in ls], "sam": [{"sam_rho": r} for r in rho]}


def ivon_setting(epochs: int, n_train: int, batch_size: int = 64) -> dict:
    """IVON's one fixed setting for every noise level: the default rule chosen in training_length.py."""
    import training_length as tl

    return tl.default_rule_hyperparams(epochs, n_train, batch_size)


def plan(a: argparse.Namespace) -> tuple[str, int, list[str], list[int], list[tuple[str, str, dict]]]:
    """(dataset, epochs, noises, seeds, [(family, method, hyperparams)])."""
    dataset = "digits" if a.quick else "mnist"
    epochs = a.epochs or (30 if a.quick else 20)
    noises = a.noises.split(",") if a.noises else (QUICK_NOISES if a.quick else FULL_NOISES)
    seeds = list(range(a.seeds if a.seeds else (2 if a.quick else 3)))
    n_train = len(common.load_data(dataset).y_train)
    fams = a.methods.split(",") if a.methods else ["ivon", "ivon_S1", "erm", "ls", "sam",
                                                    *([] if a.quick else [*OTHER_BASELINES[2:], "erm_lr0.01"]),
                                                    *OTHER_BASELINES[:2]]
    g = grids(a.quick)
    specs: list[tuple[str, str, dict]] = []
    ivon_hp = ivon_setting(epochs, n_train)
    if a.fig6:
        specs.append(("ivon", "ivon", ivon_hp))
        for h in HESS_INITS_FIG6:
            specs.append((f"ivon_fixed_h{h:g}", "ivon_fixed_hessian", {"hess_init": h}))
        return dataset, epochs, noises, seeds, specs
    if a.ivon_check:  # which IVON rule, on noisy validation: S1 vs the window rule with several prior std caps
        import training_length as tl

        T = epochs * common.steps_per_epoch(n_train, 64)
        window = {"beta2": tl.window_beta2(tl.SELECTED_WINDOW, T), "clip_radius": tl.CLIP}
        specs.append(("ivon_S1", "ivon", {}))
        for sigma_p in (None, 1.0, 1 / 3):  # None: library prior precision 2e-4
            hp = (dict(window) if sigma_p is None
                  else {**window, "prior_precision": round(1 / (n_train * sigma_p ** 2), 8)})
            specs.append((f"ivon_W{tl.SELECTED_WINDOW:g}c" + ("" if sigma_p is None else f"_sp{sigma_p:.2g}"), "ivon",
                          hp))
        return dataset, epochs, noises, seeds, specs
    if a.fig10:
        for h in HESS_INITS_FIG10:
            specs.append((f"ivon_h{h:g}", "ivon", {**ivon_hp, "hess_init": h}))
        return dataset, epochs, noises, seeds, specs
    for fam in fams:
        if fam == "ivon":
            specs.append(("ivon", "ivon", ivon_hp))
        elif fam == "ivon_S1":  # the library's default IVON arguments (the authors' CIFAR recipe), BMA prediction
            specs.append(("ivon_S1", "ivon", {}))
        elif fam in ("ls", "sam"):
            specs += [(fam, fam, hp) for hp in g[fam]]
        elif fam == "alasca":  # the reference warms up over 30 of 200 epochs; keep that fraction
            specs.append((fam, fam, {"alasca_warmup_epochs": round(0.15 * epochs, 2)}))
        elif fam == "erm_lr0.01":  # control for logistic-normal's lower step size: the same lr with plain cross-entropy
            specs.append((fam, "erm", {"learning_rate": 0.01}))
        elif fam == "logistic_normal":
            # its loss regresses the logits onto targets of ≈ 6-7 (Englesson et al. 2023, Logistic-Normal Likelihoods
            # for Heteroscedastic Label Noise), so its gradients are several times cross-entropy's: with the shared SGD
            # lr 0.05 the CNN dies in the first steps on MNIST (loss stuck at 30, chance accuracy on every noise,
            # 3 seeds); lr 0.01 trains it
            specs.append((fam, fam, {"learning_rate": 0.01}))
        else:
            specs.append((fam, fam, {}))
    return dataset, epochs, noises, seeds, specs


def select(results: list[tuple[str, str, dict, dict]]) -> dict:
    """family -> chosen run by noisy-val accuracy (ties: lower noisy-val NLL). LS includes ERM as α = 0."""
    fam_runs: dict[str, list] = {}
    for fam, _method, hp, r in results:
        fam_runs.setdefault(fam, []).append((hp, r))
        if fam == "erm":
            fam_runs.setdefault("ls", []).append(({"smoothing": 0.0}, r))
    return {fam: max(runs, key=lambda x: (x[1]["val_acc"], -x[1]["val_nll"])) for fam, runs in fam_runs.items()}


def _as_predicted(fam: str, r: dict) -> dict:
    """The "ivon" row uses the prediction mode of the rule (training_length.IVON_PREDICTION); BMA kept aside.
    Other IVON rows (the authors' recipe, the Fig. 6/10 variants) predict by BMA, as the paper does."""
    import training_length as tl

    r = {**r, "test_bma_acc": r["test_acc"]}
    if fam == "ivon" and tl.IVON_PREDICTION == "mean":
        for k in ("acc", "nll", "ece", "brier"):
            r[f"test_{k}"], r[f"val_{k}"] = r[f"test_mean_{k}"], r[f"val_mean_{k}"]
    return r


LABELS = {"ivon": "IVON, hessian_window=0.1 rule (one setting)",
          "ivon_S1": "IVON, library defaults (authors' recipe), BMA", "erm": "ERM", "ls": "LS, best α on noisy val",
          "sam": "SAM, best ρ on noisy val",
          "erm_lr0.01": "ERM at lr 0.01 (control for logistic-normal's lr)", "gce": "GCE (q 0.7)", "ols": "OLS (α 0.5)",
          "logistic_normal": "Logistic-normal (lr 0.01)", "alasca": "ALASCA"}


def collect(dataset: str, epochs: int, noises: list[str], seeds: list[int], specs: list) -> dict:
    """family -> noise -> [the chosen run of each seed] from the cached runs (baselines chosen on noisy validation)."""
    table: dict = {}
    for noise in noises:
        for seed in seeds:
            res, missing = [], set()
            for fam, method, hp in specs:
                r = common.cached(SCRIPT, method, hp, noise, seed, epochs, dataset=dataset)
                if r is not None:
                    res.append((fam, method, hp, r))
                else:
                    missing |= {fam, "ls"} if fam == "erm" else {fam}
            res = [(fam, m, hp, _as_predicted(fam, r)) for fam, m, hp, r in res]
            for fam, (hp, r) in select(res).items():
                # a best-of-grid over part of the grid (interrupted sweep) is not the family's result
                if fam in missing:
                    continue
                table.setdefault(fam, {}).setdefault(noise, []).append({"seed": seed, "hp": hp, **{
                    k: r[k] for k in ("test_acc", "test_nll", "test_ece", "test_bma_acc", "val_acc", "fit_flipped")},
                    **common.stamp_fields(r)})
    return table


def report(dataset: str, epochs: int, noises: list[str], seeds: list[int], specs: list, tag: str) -> dict:
    table = collect(dataset, epochs, noises, seeds, specs)
    fams = [f for f in dict.fromkeys(s[0] for s in specs)] + (
        ["ls"] if any(s[0] == "erm" for s in specs) and not any(s[0] == "ls" for s in specs) else [])
    fams = [f for f in fams if f in table]
    md = [f"# Robustness to label noise: {dataset}, small CNN, {epochs} epochs ({tag})", "",
          "Clean-test accuracy % (mean ± std over seeds; IVON: prediction mode of the default rule, see "
          "training_length.IVON_PREDICTION). Baseline hyperparameters "
          "picked per (noise, seed) on the noisy validation split. n = seeds done.", ""]
    for metric, scale, d, title in (("test_acc", 100, 2, "Clean-test accuracy %"), ("test_nll", 1, 3, "Clean-test NLL"),
                                    ("test_ece", 100, 1, "Clean-test ECE %"),
                                    ("val_acc", 100, 2, "Noisy-validation accuracy % (what selection sees)")):
        md += [f"## {title}", "", "| method | " + " | ".join(noises) + " |", "|---|" + "---|" * len(noises)]
        for fam in fams:
            cells = []
            for noise in noises:
                rows = table[fam].get(noise, [])
                cells.append(f"{common.fmt_pm([r[metric] for r in rows], scale, d)} (n={len(rows)})" if rows else "–")
            md.append(f"| {LABELS.get(fam, fam)} | " + " | ".join(cells) + " |")
        md.append("")
    if "ivon" in table:
        md += ["## Paired gap IVON − best baseline (test accuracy, pp; baseline chosen on noisy val)", "",
               "| vs | " + " | ".join(noises) + " |", "|---|" + "---|" * len(noises)]
        for fam in [f for f in fams if f != "ivon"]:
            cells = []
            for noise in noises:
                a = {r["seed"]: r["test_acc"] for r in table["ivon"].get(noise, [])}
                b = {r["seed"]: r["test_acc"] for r in table[fam].get(noise, [])}
                d = [a[s] - b[s] for s in a if s in b]
                cells.append(common.fmt_pm(d) if d else "–")
            md.append(f"| {LABELS.get(fam, fam)} | " + " | ".join(cells) + " |")
        md.append("")
    md += ["## Chosen hyperparameters (per seed)", ""]
    for fam in ("ls", "sam"):
        if fam in table:
            md.append(f"* {fam}: " + "; ".join(f"{n}: " + ", ".join(str(list(r['hp'].values())[0])
                                                                    for r in table[fam][n])
                                                for n in noises if n in table[fam]))
    md.append("")
    out = OUT_DIR / tag
    common.write_json(out / "summary.json", {"dataset": dataset, "epochs": epochs, "noises": noises, "seeds": seeds,
                                             "table": table})
    _plot(table, fams, noises, out / "robustness.png", f"{dataset}, {epochs} epochs")
    md += ["![accuracy vs noise](robustness.png)", ""]
    (out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if tag == "full":
        common.write_readme_section("robustness", sweep_table(table, noises, SWEEP_COLUMNS))
        common.write_readme_section("robustness_calibration", calibration_table(table, noises, HEADLINE_COLUMNS))
        common.write_readme_section("headline", sweep_table(table, noises, HEADLINE_COLUMNS),
                                    readme=common.REPO_ROOT / "README.md")
        noise_rate_figure(table, OUT_DIR / "accuracy_vs_noise.png")
        calibration_figure(table, OUT_DIR / "calibration_vs_noise.png")
    elif tag == "full_fig6":
        common.write_readme_section("fig6", fig6_table(dataset, epochs, noises, seeds))
    elif tag == "full_fig10":
        common.write_readme_section("fig10", fig10_table(dataset, epochs, noises, seeds))
    return table


#: the columns of the sweep's tables in the READMEs: family -> header
SWEEP_COLUMNS = {"ivon": "IVON rule, mean", "ivon_S1": "IVON defaults, BMA", "erm": "ERM", "erm_lr0.01": "ERM lr 0.01",
                 "ls": "LS (val)", "sam": "SAM (val)", "gce": "GCE", "logistic_normal": "LN (lr 0.01)", "ols": "OLS",
                 "alasca": "ALASCA"}
HEADLINE_COLUMNS = {k: SWEEP_COLUMNS[k] for k in ("ivon", "ivon_S1", "erm", "ls", "sam", "gce", "logistic_normal")}


def noise_label(noise: str) -> str:
    """sym40 -> sym-40, pair20 -> pair-20, cw0.4 -> κ 0.4 (the class-wise noise's κ)."""
    for prefix, shown in (("sym", "sym-"), ("pair", "pair-"), ("cw", "κ ")):
        if noise.startswith(prefix):
            return shown + noise[len(prefix):]
    return noise


def sweep_table(table: dict, noises: list[str], columns: dict[str, str]) -> str:
    """Clean-test accuracy %, mean ± std over seeds, a row per noise; the best mean of a row in bold."""
    fams = [f for f in columns if f in table]
    lines = ["| noise | " + " | ".join(columns[f] for f in fams) + " |", "|---|" + "---|" * len(fams)]
    for noise in noises:
        values = {f: [r["test_acc"] for r in table[f].get(noise, [])] for f in fams}
        means = {f: common.mean_std(v)[0] for f, v in values.items() if v}
        best = max(means, key=means.get) if means else None
        cells = [(f"**{common.fmt_pm(values[f], 100, 1)}**" if f == best else common.fmt_pm(values[f], 100, 1))
                 if values[f] else "–" for f in fams]
        lines.append(f"| {noise_label(noise)} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", _stamp(table, noises, fams)])


def _stamp(table: dict, noises: list[str], fams: list[str]) -> str:
    """The stamp of the runs behind a sweep table's cells (the chosen run of each family, noise and seed)."""
    # before runs recorded a device, `run` trained with use_cpu=True
    return common.stamp_line((r for f in fams for n in noises for r in table[f].get(n, [])), unrecorded_device="cpu")


def calibration_table(table: dict, noises: list[str], columns: dict[str, str]) -> str:
    """Clean-test NLL and ECE %, mean over seeds, a row per noise (cells `NLL / ECE`); the lowest NLL of a row in
    bold."""
    fams = [f for f in columns if f in table]
    lines = ["| noise | " + " | ".join(columns[f] for f in fams) + " |", "|---|" + "---|" * len(fams)]
    for noise in noises:
        rows = {f: table[f].get(noise, []) for f in fams}
        nll = {f: common.mean_std([r["test_nll"] for r in rs])[0] for f, rs in rows.items() if rs}
        best = min(nll, key=nll.get) if nll else None
        cells = []
        for f in fams:
            if not rows[f]:
                cells.append("–")
                continue
            ece = 100 * common.mean_std([r["test_ece"] for r in rows[f]])[0]
            cell = f"{nll[f]:.2f} / {ece:.0f}"
            cells.append(f"**{cell}**" if f == best else cell)
        lines.append(f"| {noise_label(noise)} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: clean-test NLL / ECE %, mean over the seeds of the sweep's table above; the lowest NLL of a "
              "row in bold. A model of noisy labels that predicts as uncertainly as they are is under-confident on "
              "clean ones: a large ECE here is mostly that (LS's most of all), so read the NLL first.",
              "", _stamp(table, noises, fams)]
    return "\n".join(lines)


#: the methods of the summary's figures: family -> (label, colour, line style)
FIGURE_METHODS = {"ivon": ("IVON, hessian_window rule (posterior mean)", "tab:red", "-"),
                  "ivon_S1": ("IVON, library defaults (BMA)", "tab:red", ":"),
                  "erm": ("ERM", "k", "-"), "ls": ("LS, α chosen on noisy val", "tab:blue", "-"),
                  "sam": ("SAM, ρ chosen on noisy val", "tab:green", "-"), "gce": ("GCE", "tab:purple", "--"),
                  "logistic_normal": ("logistic-normal", "tab:orange", "--")}
#: the panels of the summary's figures: (title, noise prefix, x label)
FIGURE_PANELS = (("symmetric", "sym", "noise rate %"), ("pair-flip", "pair", "noise rate %"),
                 ("class-wise (Eq. 20-21)", "cw", "κ"))


def _sweep_panels(table: dict, metrics: list[tuple[str, float, str]], path: Path, title: str) -> None:
    """One row of panels per metric (key, scale, y label), one panel per kind of noise, x = the noise rate; a line per
    method of FIGURE_METHODS with its seeds' mean ± std. Matplotlib's Agg backend, 100 dpi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noises = sorted({n for per in table.values() for n in per})
    fig, axes = plt.subplots(len(metrics), len(FIGURE_PANELS), figsize=(9.5, 2.7 * len(metrics) + 0.8), squeeze=False)
    for row, (key, scale, ylabel) in enumerate(metrics):
        for ax, (panel, prefix, xlabel) in zip(axes[row], FIGURE_PANELS):
            kind = sorted((n for n in noises if n.startswith(prefix)), key=lambda n: float(n[len(prefix):]))
            x = [float(n[len(prefix):]) for n in kind]
            for fam, (label, color, style) in FIGURE_METHODS.items():
                if fam not in table:
                    continue
                values = [[scale * r[key] for r in table[fam].get(n, [])] for n in kind]
                mean = [np.mean(v) if v else np.nan for v in values]
                std = [np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values]
                ax.errorbar(x, mean, yerr=std, color=color, linestyle=style, marker="o", markersize=3, capsize=2,
                            label=label)
            ax.set_title(f"{panel}" if row == 0 else "", fontsize=10)
            ax.set_xticks(x)
            ax.set_xlabel(xlabel)
            if ax is axes[row][0]:
                ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.65 / (2.7 * len(metrics) + 0.8), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, pil_kwargs={"optimize": True})
    plt.close(fig)


def noise_rate_figure(table: dict, path: Path) -> Path:
    """The summary's figure of clean-test accuracy against the noise rate, by method and kind of noise, from the full
    sweep's table (`collect`, or the `table` of results/robustness/full/summary.json)."""
    _sweep_panels(table, [("test_acc", 100, "clean-test accuracy %")], path,
                  "MNIST, 9k noisy labels, 20 epochs: clean-test accuracy (mean ± std over 3 seeds)")
    return path


def calibration_figure(table: dict, path: Path) -> Path:
    """The summary's calibration figure: clean-test NLL and ECE against the noise rate, by method and kind of noise,
    from the same table as `noise_rate_figure`."""
    _sweep_panels(table, [("test_nll", 1, "clean-test NLL"), ("test_ece", 100, "clean-test ECE %")], path,
                  "MNIST, 9k noisy labels, 20 epochs: calibration on the clean test set (mean ± std over 3 seeds)")
    return path


def _seed_runs(method: str, hp: dict, noise: str, seeds: list[int], dataset: str, epochs: int) -> list[dict]:
    runs = [common.cached(SCRIPT, method, hp, noise, s, epochs, dataset=dataset) for s in seeds]
    return [r for r in runs if r is not None]


def fig6_table(dataset: str, epochs: int, noises: list[str], seeds: list[int]) -> str:
    """Fixed vs learned Hessian: clean-test accuracy per noise, noisy-val accuracy (mean over the noises) and the share
    of flipped labels fitted on sym-40, for the rule (mean and BMA), the library defaults and each fixed h0."""
    rule = ivon_setting(epochs, len(common.load_data(dataset).y_train))
    rows = [("learned, `hessian_window=0.1` rule (posterior mean)", "ivon", rule, "mean_"),
            ("learned, same rule, BMA", "ivon", rule, ""), ("library defaults (β2 0.99999), BMA", "ivon", {}, ""),
            *[(f"fixed h0 = {h:g}, BMA", "ivon_fixed_hessian", {"hess_init": h}, "") for h in HESS_INITS_FIG6]]
    flip_noise = "sym40" if "sym40" in noises else noises[0]
    lines = ["| IVON | " + " | ".join(noise_label(n) for n in noises)
             + f" | noisy-val acc, mean of the {len(noises)} noises "
               f"| flipped labels fitted, {noise_label(flip_noise)} |",
             "|---|" + "---|" * (len(noises) + 2)]
    shown: list[dict] = []
    for label, method, hp, mode in rows:
        runs = {n: _seed_runs(method, hp, n, seeds, dataset, epochs) for n in noises}
        shown += [r for n in noises for r in runs[n]]
        val = [r[f"val_{mode}acc"] for n in noises for r in runs[n]]
        lines.append(f"| {label} | " + " | ".join(common.fmt_pm([r[f"test_{mode}acc"] for r in runs[n]], 100, 1)
                                                  for n in noises)
                     + f" | {100 * common.mean_std(val)[0]:.1f} | "
                     + f"{100 * common.mean_std([r['fit_flipped'] for r in runs[flip_noise]])[0]:.1f} % |")
    return "\n".join([*lines, "", common.stamp_line(shown, unrecorded_device="cpu")])


def fig10_table(dataset: str, epochs: int, noises: list[str], seeds: list[int]) -> str:
    """Hessian-init sensitivity of the rule: accuracy at the posterior mean and by BMA per noise, and the median over
    runs (all noises and seeds) of the median Hessian at the end of training."""
    rule = ivon_setting(epochs, len(common.load_data(dataset).y_train))
    header = [f"{noise_label(n)} {mode}" for n in noises for mode in ("mean", "BMA")]
    lines = ["| h0 | " + " | ".join(header) + " | median h at the end |", "|---|" + "---|" * (len(header) + 1)]
    shown: list[dict] = []
    for h in HESS_INITS_FIG10:
        runs = {n: _seed_runs("ivon", {**rule, "hess_init": h}, n, seeds, dataset, epochs) for n in noises}
        shown += [r for n in noises for r in runs[n]]
        cells = [common.fmt_pm([r[key] for r in runs[n]], 100, 1)
                 for n in noises for key in ("test_mean_acc", "test_acc")]
        h_end = [r["hessian"]["hess_median"] for n in noises for r in runs[n]]
        lines.append(f"| {h:g} | " + " | ".join(cells) + f" | {np.median(h_end):.2g} |")
    return "\n".join([*lines, "", common.stamp_line(shown, unrecorded_device="cpu")])


def _plot(table: dict, fams: list[str], noises: list[str], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(noises) + 2), 5))
    x = np.arange(len(noises))
    w = 0.8 / max(1, len(fams))
    for i, fam in enumerate(fams):
        m = [np.mean([r["test_acc"] for r in table[fam].get(n, [])]) * 100 if table[fam].get(n) else np.nan
             for n in noises]
        s = [np.std([r["test_acc"] for r in table[fam].get(n, [])], ddof=1) * 100 if len(table[fam].get(n, [])) > 1
             else 0 for n in noises]
        ax.bar(x + (i - (len(fams) - 1) / 2) * w, m, w, yerr=s, label=LABELS.get(fam, fam), capsize=2)
    ax.set_xticks(x, noises)
    ax.set_ylabel("clean test accuracy %")
    ax.set_title(title)
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))  # below the axes: bars stay visible
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="scikit-learn digits, 3 noises, 2 seeds, trimmed grids")
    p.add_argument("--noises", default=None, help="comma-separated: clean, sym<pct>, pair<pct>, cw<kappa>")
    p.add_argument("--methods", default=None,
                   help="comma-separated families: ivon,erm,ls,sam,gce,ols,logistic_normal,alasca")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (0..n-1)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--fig6", action="store_true", help="fixed (β2 = 1, several h0) vs learned Hessian")
    p.add_argument("--fig10", action="store_true", help="IVON with hess_init in %s" % HESS_INITS_FIG10)
    p.add_argument("--ivon-check", action="store_true", help="IVON rule variants (S1, window rule with prior std caps)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    try:
        dataset, epochs, noises, seeds, specs = plan(a)
    except common.DataUnavailable as e:
        print(f"SKIP: {e}")
        return
    tag = ("quick" if a.quick else "full") + ("_fig6" if a.fig6 else "_fig10" if a.fig10
                                               else "_ivoncheck" if a.ivon_check else "")
    if not a.report_only:
        order = sorted(noises, key=lambda n: RUN_PRIORITY.index(n) if n in RUN_PRIORITY else len(RUN_PRIORITY))
        jobs = [dict(method=m, hyperparams=hp, noise=n, seed=s, epochs=epochs, dataset=dataset, script=SCRIPT)
                for n in order for s in seeds for (_, m, hp) in specs]
        common.run_parallel(jobs, workers=a.workers)
    report(dataset, epochs, report_noises(a, dataset, epochs, noises, seeds, specs), seeds, specs, tag)


def report_noises(a: argparse.Namespace, dataset: str, epochs: int, noises: list[str], seeds: list[int],
                  specs: list) -> list[str]:
    """The report's columns: the noises asked for, plus every other noise of the mode whose comparison has run (each
    spec on at least one seed), so that resuming part of a sweep with --noises does not shrink the committed report."""
    def ran(noise: str) -> bool:
        return all(any(common.cached(SCRIPT, m, hp, noise, s, epochs, dataset=dataset) for s in seeds)
                   for _, m, hp in specs)

    default = QUICK_NOISES if a.quick else FULL_NOISES
    return [n for n in dict.fromkeys([*default, *noises]) if n in noises or ran(n)]


if __name__ == "__main__":
    main()
