"""benchmarks/hf_finetune.py, long_finetune.py and export_defaults.py: rates and α are chosen on the noisy validation
split alone, and the committed tables are what the reports compute from the committed runs (no training here)."""

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
import long_finetune  # noqa: E402
from test_benchmarks import block  # noqa: E402

pytestmark = pytest.mark.slow  # the benchmarks' checks are the slow tier's (the README's test command skips them)


def test_a_setting_is_the_candidate_whose_worst_task_against_adamw_is_best() -> None:
    adamw = {"text": [0.63, 0.65], "image": [0.30]}
    # 0.02 leads on text but trails AdamW by 10 points on image; 0.1 trails by at most 2 points anywhere
    ivon = {0.02: {"text": [0.64, 0.66], "image": [0.20]}, 0.1: {"text": [0.62, 0.62], "image": [0.31]}}
    assert hf_finetune.choose_candidate(ivon, adamw) == 0.1
    ivon[0.02]["image"] = [0.29]
    assert hf_finetune.choose_candidate(ivon, adamw) == 0.02
    # validation accuracies only: the test split is no argument of the choice
    assert list(inspect.signature(hf_finetune.choose_candidate).parameters) == ["ivon", "adamw"]


def test_the_finetune_presets_rate_is_the_chosen_one() -> None:
    from varsmooth.presets import FINETUNE_PRESET

    chosen = re.search(r"learning rate, chosen .*; chosen: \*\*([0-9.e-]+)\*\*", block("hf_finetune"))
    assert chosen is not None, "no rate chosen: the committed rate and reference runs are missing"
    assert FINETUNE_PRESET["learning_rate"] == float(chosen.group(1))


def test_the_finetune_presets_window_is_the_chosen_one() -> None:
    """The β2 the preset gives a run of the benchmark's length (`default_beta2`) is the candidate validation chose."""
    from varsmooth.presets import DEFAULT_HESSIAN_WINDOW, FINETUNE_PRESET, default_beta2

    chosen = re.search(r"Hessian window, chosen .*; chosen: \*\*(.+?)\*\*", block("hf_finetune"))
    assert chosen is not None, "no window chosen: the committed window and reference runs are missing"
    assert default_beta2(FINETUNE_PRESET["long_run_beta2"], hf_finetune.STEPS, DEFAULT_HESSIAN_WINDOW) == \
        hf_finetune.WINDOW_CANDIDATES[chosen.group(1)]


def test_the_finetune_presets_ess_is_the_chosen_one() -> None:
    from varsmooth.presets import FINETUNE_PRESET

    chosen = re.search(r"effective sample size, chosen .*; chosen: \*\*(.+?)\*\*", block("hf_finetune"))
    assert chosen is not None, "no ess chosen: the committed ess and reference runs are missing"
    assert FINETUNE_PRESET["ess"] == hf_finetune.ESS_CANDIDATES[chosen.group(1)]


def test_the_finetune_presets_update_is_the_chosen_one() -> None:
    """The preset's clipped sign step (clip_radius, rate) won against IVON's own preconditioned step at rates of
    AdamW's scale, on the noisy validation splits."""
    from varsmooth.presets import FINETUNE_PRESET

    chosen = re.search(r"update, chosen .*; chosen: \*\*(.+?)\*\*", block("hf_finetune"))
    assert chosen is not None, "no update chosen: the committed step and reference runs are missing"
    assert hf_finetune.STEP_CANDIDATES[chosen.group(1)] == (FINETUNE_PRESET["clip_radius"],
                                                           FINETUNE_PRESET["learning_rate"])


def test_the_finetune_presets_new_weight_multiplier_is_the_chosen_one() -> None:
    """The rate multiplier of the weights from_pretrained newly initialised (the new head), chosen on three seeds' noisy
    validation splits at the preset's rate, window, ess and update."""
    from varsmooth.presets import FINETUNE_PRESET

    chosen = re.search(r"multiplier of the new weights \(the head\), chosen .*seeds \[0, 1, 2\]\); "
                       r"chosen: \*\*(.+?)\*\*", block("hf_finetune"))
    assert chosen is not None, "no multiplier chosen: the committed new_weights and reference runs are missing"
    assert FINETUNE_PRESET["new_weight_lr_scale"] == hf_finetune.NEW_WEIGHT_SCALES[chosen.group(1)]


def test_a_freshly_built_image_checkpoint_leaves_the_seeded_head_as_a_cached_one(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The image task's new head comes from the seed alone: building the checkpoint folder (the first run on a fresh
    clone) draws no numbers from the global RNG the head is then drawn from."""
    import torch

    monkeypatch.setattr(hf_finetune.common, "RESULTS_DIR", tmp_path)
    heads = []
    for _ in ("built now", "cached"):
        torch.manual_seed(0)
        model = hf_finetune.image_model()
        heads.append(torch.cat([p.detach().flatten() for n, p in model.named_parameters() if "classifier" in n]))
    assert heads[0].numel() == 10 * 1281  # the new CIFAR-10 head (and its bias)
    assert torch.equal(heads[0], heads[1])


def test_the_tables_are_the_reports() -> None:
    assert block("hf_finetune") == hf_finetune.report()
    assert block("export_defaults") == export_defaults.report()


def test_ls_alpha_is_chosen_on_noisy_validation_accuracy(monkeypatch: pytest.MonkeyPatch) -> None:
    # test accuracy would choose 0.5, validation chooses 0.3; before every candidate ran, nothing is chosen
    scores = {0.1: (0.60, 0.80), 0.3: (0.64, 0.79), 0.5: (0.62, 0.90)}
    runs = {a: {"eval_accuracy": v, "test_accuracy": t} for a, (v, t) in scores.items()}
    monkeypatch.setattr(long_finetune, "_cached", lambda task, method, hp, seed: runs.get(hp["smoothing"]))
    assert long_finetune.chosen_alpha("trec-sym30") == 0.3
    del runs[0.5]
    assert long_finetune.chosen_alpha("trec-sym30") is None


def test_wrong_labels_fitted_is_the_share_predicted_as_labelled() -> None:
    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.modeling_outputs import SequenceClassifierOutput

    class Constant(torch.nn.Module):  # predicts class 1 for every input
        def forward(self, x: torch.Tensor) -> SequenceClassifierOutput:
            return SequenceClassifierOutput(logits=torch.tensor([0.0, 1.0, 0.0]).expand(len(x), 3))

    rows = [{"x": torch.zeros(2), "labels": y} for y in (1, 0, 1, 2, 1)]
    callback = long_finetune.WrongLabelsFitted(rows, collator=None, batch_size=2)
    state = TrainerState()
    state.epoch = 3.0
    model = Constant().train()
    callback.on_epoch_end(TrainingArguments("unused", use_cpu=True, report_to=[]), state, TrainerControl(),
                          model=model)
    assert callback.history == [(3.0, 3 / 5)]
    assert model.training  # left as training had it


def test_the_long_finetune_table_is_the_report() -> None:
    assert block("long_finetune") == long_finetune.report()


def test_the_nll_gap_runs_differ_in_the_posteriors_noise_alone() -> None:
    """`--plan nll_gap` isolates the posterior's noise: its runs take the finetune preset's step with the Hessian held
    at h0 (β2 1, where ivon-opt's update leaves h as it is; tests/test_engine.py holds the engine to ivon-opt there)
    and differ from each other in ess alone, whose σ = 1/sqrt(ess·h0) is what the table's labels say."""
    from varsmooth.presets import FINETUNE_PRESET

    runs = hf_finetune.jobs("nll_gap", [0])
    assert [r["hyperparams"]["beta2"] for r in runs] == [1.0, 1.0]
    without_ess = [{k: v for k, v in r["hyperparams"].items() if k != "ess"} for r in runs]
    assert without_ess[0] == without_ess[1] == {"ivon_preset": "finetune", "beta2": 1.0, "new_weight_lr_scale": 1.0,
                                                "learning_rate": FINETUNE_PRESET["learning_rate"]}
    for label, ess in hf_finetune.NLL_GAP_ESS.items():
        sigma = (ess * FINETUNE_PRESET["hess_init"]) ** -0.5
        assert f"σ {sigma:.0e}".replace("e-0", "e-") in label
