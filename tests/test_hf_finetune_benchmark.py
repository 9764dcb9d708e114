"""benchmarks/hf_finetune.py and export_defaults.py: the rate is chosen on the noisy validation split alone, and the
committed tables are what the reports compute from the committed runs (no training here)."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import export_defaults  # noqa: E402
import hf_finetune  # noqa: E402
from test_benchmarks import block  # noqa: E402


def test_the_rate_is_the_one_whose_worst_task_against_adamw_is_best() -> None:
    adamw = {"text": [0.63, 0.65], "image": [0.30]}
    # 0.02 leads on text but trails AdamW by 10 points on image; 0.1 trails by at most 2 points anywhere
    ivon = {0.02: {"text": [0.64, 0.66], "image": [0.20]}, 0.1: {"text": [0.62, 0.62], "image": [0.31]}}
    assert hf_finetune.choose_rate(ivon, adamw) == 0.1
    ivon[0.02]["image"] = [0.29]
    assert hf_finetune.choose_rate(ivon, adamw) == 0.02
    # validation accuracies only: the test split is no argument of the choice
    assert list(inspect.signature(hf_finetune.choose_rate).parameters) == ["ivon", "adamw"]


def test_the_finetune_presets_rate_is_the_chosen_one() -> None:
    from varsmooth.presets import FINETUNE_PRESET

    chosen = re.search(r"chosen: \*\*([0-9.e-]+)\*\*", block("hf_finetune"))
    if chosen is None:
        pytest.skip("the rate is not chosen yet (no cached rate and reference runs)")
    assert FINETUNE_PRESET["learning_rate"] == float(chosen.group(1))


def test_the_tables_are_the_reports() -> None:
    assert block("hf_finetune") == hf_finetune.report()
    assert block("export_defaults") == export_defaults.report()
