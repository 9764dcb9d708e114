"""Sharing on the Hub, tested against a local stand-in of its HTTP API (the real huggingface_hub code runs)."""

import json

import numpy as np
import pytest
import yaml

from hub_stand_in import run_hub_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    out = tmp_path_factory.mktemp("hub")
    return run_hub_worker("hub_worker.py", out)


def test_push_uploads_only_the_shareable_files(pushed):
    hub, _ = pushed
    files = set(hub.repos["offline-user/digits-ivon"])
    assert {"model.safetensors", "config.json", "posterior.safetensors", "preprocessor_config.json", "README.md",
            "noise_report.json", "label_noise.parquet", "label_noise_summary.json"} <= files
    assert any(f.endswith(".png") for f in files)  # the label-noise pictures
    assert not files & {"training_args.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"}
    assert not any(f.startswith(("checkpoint-", "runs/")) for f in files)
    # exactly what this training wrote: not files of the same names or patterns that it did not write
    assert not files & {"model-private.safetensors", "holiday.png", "drafts/sketch.png", "varsmooth_manifest.json"}


def test_own_model_card_is_kept_unless_replacing_is_asked_for(pushed):
    _, results = pushed
    assert "replace_model_card=True" in results["own_card_refusal"]
    assert results["own_card_after_refusal"] == "# My own card\n"
    assert ("README.md" not in results["own_card_repo_after_refusal"]
            and "model.safetensors" not in results["own_card_repo_after_refusal"])
    assert "varsmooth" in results["own_card_replaced"] and "My own card" not in results["own_card_replaced"]


def test_a_reused_repo_keeps_no_stale_posterior(pushed):
    _, results = pushed
    assert "posterior.safetensors" in results["reused_after_ivon"]
    assert ("posterior.safetensors" not in results["reused_after_erm"]
            and "model.safetensors" in results["reused_after_erm"])


def test_peft_push_uploads_the_adapter(pushed):
    _, results = pushed
    assert {"adapter_model.safetensors", "adapter_config.json", "posterior.safetensors",
            "README.md"} <= set(results["peft_files"])


def test_intermediate_pushes_carry_the_posterior(pushed):
    hub, _ = pushed
    intermediate = [c for c in hub.commits if c["repo"] == "offline-user/digits-ivon" and "progress" in c["summary"]]
    assert intermediate, hub.commits
    assert all("posterior.safetensors" in c["files"] and "model.safetensors" in c["files"] for c in intermediate)


def test_model_card_replaces_the_trainers(pushed):
    hub, _ = pushed
    card = hub.repos["offline-user/digits-ivon"]["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert "ivon" in meta["tags"] and meta["library_name"] == "transformers"
    results = {m["type"] for r in meta["model-index"][0]["results"] for m in r["metrics"]}
    assert {"accuracy", "nll", "ece", "brier"} <= results
    assert "ADAMW" not in card and "adamw" not in card.lower()  # the stock card's wrong optimizer line
    assert "realized rate" in card and "symmetric" in card
    assert "posterior-averaged" in card and "VariationalModel.from_pretrained(\"offline-user/digits-ivon\")" in card


def test_reloaded_model_and_pipeline_predict_like_the_trainer(pushed):
    _, results = pushed
    assert results["max_abs_diff_model"] < 1e-5
    assert results["max_abs_diff_pipeline"] < 1e-5
    assert results["uncertain"]["entropy"] == pytest.approx(results["entropy_expected"], rel=1e-4)
    # BALD's mutual information H[mean_s p_s] − mean_s H[p_s] over the pipeline's draws, recomputed here; the
    # draws average to the trainer's prediction, and they disagree (a posterior, not a point mass)
    draws = np.asarray(results["draws"])
    assert len(draws) == 4  # eval_mc_samples of the run
    entropy = lambda p: -(p * np.log(p)).sum(-1)  # noqa: E731
    np.testing.assert_allclose(draws.mean(0), results["probs_expected"], atol=1e-5)
    mutual_information = entropy(draws.mean(0)) - entropy(draws).mean()
    assert mutual_information > 1e-4
    assert results["uncertain"]["mutual_information"] == pytest.approx(mutual_information, rel=1e-3)
    assert len(results["uncertain"]["predictions"]) == 5  # the pipeline's default top_k


def test_repo_without_posterior_warns_and_predicts_at_mean(pushed):
    _, results = pushed
    assert any("Predicting at the posterior mean" in w for w in results["no_posterior_warnings"])


@pytest.fixture(scope="module")
def pushed_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("hub_checkpoints")
    return run_hub_worker("hub_checkpoint_worker.py", out)


CHECKPOINT_SHARED = {"model.safetensors", "config.json", "posterior.safetensors", "optimizer.pt", "scheduler.pt",
                     "rng_state.pth", "trainer_state.json", "varsmooth_manifest.json"}


def test_hub_strategy_checkpoint_pushes_the_last_checkpoint_whole(pushed_checkpoints):
    hub, results = pushed_checkpoints
    files = set(results["last_files"])
    assert {f"last-checkpoint/{name}" for name in CHECKPOINT_SHARED} <= files
    assert "last-checkpoint/training_args.bin" not in files  # the pickled arguments may hold paths and tokens
    assert results["last_checkpoint_step"] == 4  # replaced by the step-4 checkpoint, nothing of step 2 left over
    manifest = json.loads(hub.repos["offline-user/ckpt-last"]["last-checkpoint/varsmooth_manifest.json"])
    assert set(manifest["files"]) == CHECKPOINT_SHARED - {"varsmooth_manifest.json"}
    assert any("checkpoint" in c["summary"] for c in hub.commits if c["repo"] == "offline-user/ckpt-last")


def test_a_run_resumed_from_the_pushed_checkpoint_ends_as_the_uninterrupted_one(pushed_checkpoints):
    _, results = pushed_checkpoints
    assert results["resumed_step"] == 6
    assert results["max_abs_diff_resumed"] == 0.0
    assert "optimizer.pt has 100 bytes" in results["truncated_refusal"]


def test_hub_strategy_all_checkpoints_pushes_each_checkpoint(pushed_checkpoints):
    _, results = pushed_checkpoints
    files = set(results["all_files"])
    for step in (2, 4):
        assert {f"checkpoint-{step}/{name}" for name in CHECKPOINT_SHARED} <= files
        assert f"checkpoint-{step}/training_args.bin" not in files
