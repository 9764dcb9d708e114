"""benchmarks/lora.py: the `lora` preset's variant is chosen among the IVON-LoRA candidates on the noisy validation
split alone (`chosen_variant`), and the report shows the validation scores and the choice before the test scores.
The choice and report checks read synthetic runs (no training); the check against the committed page is slow-tier."""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import lora  # noqa: E402
from test_benchmarks import block, regenerate  # noqa: E402


def fake(task: str, method: str, val: tuple[float, float] | None, test_acc: float = 0.5, seed: int = 0,
         version: int = lora.VERSION) -> dict[str, Any]:
    """A run as `lora.run` caches it: `val` = (val_acc, val_nll), None for a run without validation metrics."""
    run = {"config": {"task": task, "method": method, "seed": seed, "setup": lora.SETUP, "version": version},
           "test_acc": test_acc, "test_nll": 1.0 - test_acc, "test_ece": 0.1, "test_mean_acc": test_acc,
           "trainable_parameters": 25_346, "s_per_step": 1.0, "diverged": None, "device": "cpu", "commit": "abc1234",
           "hessian": {"hess_median": 1e-3}, "settings": {"hess_init": 1e-3}}
    if val is not None:
        run["val_acc"], run["val_nll"] = val
    return run


def runs_of(val: dict[str, tuple[float, float]], test: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Seed-0 runs of every candidate on every task, with the same validation (and test accuracy) on each task."""
    return [fake(task, v, val[v], (test or {}).get(v, 0.5)) for v in lora.CANDIDATES for task in lora.TASKS]


def test_the_rule_is_the_highest_mean_validation_accuracy_then_the_lower_nll() -> None:
    val = {"ivon-lora": (0.55, 0.69), "ivon-lora-default": (0.56, 0.69), "ivon-lora-lr1": (0.80, 0.45),
           "ivon-lora-lr1-window": (0.79, 0.40)}
    assert lora.chosen_variant(lora.validation_scores(runs_of(val))) == "ivon-lora-lr1"
    # the mean over the four tasks decides: lr1-window 3 points behind on one task, 2 ahead on the three others
    runs = runs_of(val)
    for r in runs:
        if r["config"]["method"] == "ivon-lora-lr1-window":
            r["val_acc"] = 0.77 if r["config"]["task"] == "trec-sym30" else 0.82
    assert lora.chosen_variant(lora.validation_scores(runs)) == "ivon-lora-lr1-window"
    # equal accuracy: the lower NLL; equal on both: the first candidate
    val["ivon-lora-lr1-window"] = (0.80, 0.40)
    assert lora.chosen_variant(lora.validation_scores(runs_of(val))) == "ivon-lora-lr1-window"
    val["ivon-lora-lr1-window"] = (0.80, 0.45)
    assert lora.chosen_variant(lora.validation_scores(runs_of(val))) == "ivon-lora-lr1"
    # the scores are the validation metrics of seed 0, per task
    scores = lora.validation_scores(runs_of(val))
    assert set(scores) == set(lora.CANDIDATES) and all(set(s) == set(lora.TASKS) for s in scores.values())
    assert scores["ivon-lora"]["trec-clean"] == {"val_acc": 0.55, "val_nll": 0.69}


def test_the_choice_does_not_follow_the_test_scores() -> None:
    val = {"ivon-lora": (0.55, 0.69), "ivon-lora-default": (0.56, 0.69), "ivon-lora-lr1": (0.80, 0.45),
           "ivon-lora-lr1-window": (0.79, 0.40)}
    # on the test split ivon-lora-default, then ivon-lora-lr1-window would win: the choice stays lr1
    for test in ({"ivon-lora-default": 0.95}, {"ivon-lora-lr1-window": 0.95, "ivon-lora-lr1": 0.10}, {}):
        assert lora.chosen_variant(lora.validation_scores(runs_of(val, test))) == "ivon-lora-lr1"
    # what the choice reads carries no test metric, and a test metric handed to it directly is refused
    scores = lora.validation_scores(runs_of(val, {"ivon-lora-default": 0.95}))
    assert {k for s in scores.values() for m in s.values() for k in m} == set(lora.VAL_KEYS)
    scores["ivon-lora-default"]["sst2-clean"]["test_acc"] = 0.95
    with pytest.raises(ValueError, match="noisy-validation"):
        lora.chosen_variant(scores)
    with pytest.raises(ValueError, match="no candidate"):
        lora.chosen_variant({"adamw-lora": {}})
    assert list(inspect.signature(lora.chosen_variant).parameters) == ["validation"]


def test_runs_without_validation_metrics_choose_nothing() -> None:
    val = {"ivon-lora": (0.55, 0.69), "ivon-lora-default": (0.56, 0.69), "ivon-lora-lr1": (0.80, 0.45),
           "ivon-lora-lr1-window": (0.79, 0.40)}
    runs = runs_of(val)
    # version-1 runs (test metrics only, or with a val key) and runs of other seeds are not read: a cache of them
    # chooses nothing, and they do not change the choice of a complete version-2 cache
    old = [fake(t, v, None, 0.99, version=1) for v in lora.CANDIDATES for t in lora.TASKS]
    stale = [fake(t, "ivon-lora", (0.99, 0.01), version=1) for t in lora.TASKS]
    other_seed = [fake(t, "ivon-lora-default", (0.99, 0.01), seed=1) for t in lora.TASKS]
    assert lora.validation_scores(old + stale) == {}
    assert lora.chosen_variant(lora.validation_scores(old + stale + other_seed)) is None
    assert lora.chosen_variant(lora.validation_scores(runs + old + stale + other_seed)) == "ivon-lora-lr1"
    # a candidate whose run on one task lacks validation metrics: nothing is chosen until it has them
    missing = next(r for r in runs if r["config"]["method"] == "ivon-lora" and r["config"]["task"] == "trec-sym30")
    del missing["val_acc"], missing["val_nll"]
    scores = lora.validation_scores(runs)
    assert "trec-sym30" not in scores["ivon-lora"] and lora.chosen_variant(scores) is None
    del scores["ivon-lora"]["sst2-clean"]["val_nll"]  # a metric missing is a task not run
    assert lora.chosen_variant(scores) is None


def test_the_report_shows_validation_the_choice_then_test(tmp_path, monkeypatch) -> None:
    # validation picks lr1-window, test accuracy would pick ivon-lora-lr1; one adamw-full run is missing
    val = {"ivon-lora": (0.55, 0.69), "ivon-lora-default": (0.56, 0.69), "ivon-lora-lr1": (0.78, 0.45),
           "ivon-lora-lr1-window": (0.79, 0.40)}
    runs = runs_of(val, {"ivon-lora-lr1": 0.90, "ivon-lora-lr1-window": 0.80})
    runs += [fake(t, "adamw-lora", (0.77, 0.5), 0.79) for t in lora.TASKS]
    runs += [fake(t, "adamw-full", (0.77, 0.5), 0.85) for t in lora.TASKS[:3]]
    runs += [fake("sst2-clean", "ivon-lora-lr1", None, 0.2, version=1)]  # an earlier run: shown apart, labelled
    folder = tmp_path / "lora"
    (folder / "runs").mkdir(parents=True)
    for i, r in enumerate(runs):
        (folder / "runs" / f"{i}.json").write_text(json.dumps(r))
    monkeypatch.setattr(lora, "_results_dir", lambda device: folder)
    written = block("lora", regenerate(lambda: lora.report("cpu"), tmp_path, monkeypatch))
    head, earlier = written.split("**Earlier runs (cache version 1)")
    assert ("Chosen: **`ivon-lora-lr1-window`**, ahead of `ivon-lora-lr1` by 1.00 points of mean validation accuracy "
            "(seed 0 only). The choice agrees with the current `lora` preset") in head
    assert "| ivon-lora-lr1-window | " + "79.0 / 0.400 | " * 4 + "79.00 | 0.400 |" in head
    # the validation table and the choice come before the test table
    assert head.index("Chosen:") < head.index("**Then the clean test split, scored once**") < head.index("| task |")
    assert "Not run yet: adamw-full on trec-sym30 (seed 0)." in head
    assert "| sst2-clean | ivon-lora-lr1 | 1 | 25,346 | 90.00 |" in head and "20.00" not in head
    assert "| sst2-clean | ivon-lora-lr1 | 1 | 25,346 | 20.00 |" in earlier
    assert json.loads((folder / "summary.json").read_text())["chosen"] == "ivon-lora-lr1-window"
    # before every candidate ran: no choice, and the missing runs are named
    for path in (folder / "runs").glob("*.json"):
        if json.loads(path.read_text())["config"]["method"] == "ivon-lora-default":
            path.unlink()
    lora.report("cpu")  # the pages are the copies under tmp_path still
    written = block("lora", tmp_path / "benchmarks")
    assert "Chosen:" not in written
    assert "Not chosen yet: not run yet at seed 0: ivon-lora-default on sst2-clean" in written
    assert "| ivon-lora-default | not run yet | not run yet | not run yet | not run yet | – | – |" in written


@pytest.mark.slow  # reads the committed page, as the benchmarks' table checks do
def test_the_lora_preset_is_the_chosen_variant() -> None:
    chosen = re.search(r"Chosen: \*\*`([a-z0-9-]+)`\*\*", block("lora"))
    if chosen is None:
        pytest.skip("the variant is not chosen yet (not every candidate has validation metrics on every task)")
    assert lora.preset_variant() == chosen.group(1)
