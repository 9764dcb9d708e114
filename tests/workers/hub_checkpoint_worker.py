"""Run by tests/test_hub.py in a subprocess whose HF_ENDPOINT points at the local Hub stand-in: `hub_strategy=
"checkpoint"` and `"all_checkpoints"` push the checkpoints, and a run resumed from the downloaded `last-checkpoint/`
ends where the uninterrupted run ends."""

import json
import os
import sys

import torch
from huggingface_hub import HfApi, hf_hub_download
from transformers import ResNetConfig, ResNetForImageClassification

from helpers import digits_dataset
from varsmooth import VariationalTrainer, VariationalTrainingArguments


def model() -> ResNetForImageClassification:
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16],
                                                     depths=[1, 1], layer_type="basic", num_labels=10,
                                                     downsample_in_first_stage=False))


def data():
    ds = digits_dataset(64).with_format(None)
    return ds.map(lambda b: {"pixel_values": [[p] for p in b["pixel_values"]]}, batched=True).with_format("torch")


def trainer(out: str, steps: int, **kw) -> VariationalTrainer:
    args = VariationalTrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_steps=steps, disable_tqdm=True,
                                        per_device_train_batch_size=16, learning_rate=0.2,
                                        method_config={"beta2": 0.99}, seed=0,
                                        lr_scheduler_type="constant", eval_mc_samples=2, **kw)
    return VariationalTrainer(model=model(), args=args, train_dataset=data())


def pushed_run(out: str, repo: str, strategy: str) -> list[str]:
    run = trainer(out, 4, save_strategy="steps", save_steps=2, push_to_hub=True, hub_model_id=repo,
                  hub_strategy=strategy, hub_always_push=True)
    run.train()
    run.push_in_progress.wait_until_done()
    return sorted(HfApi().list_repo_files(repo))


def main(out: str) -> None:
    results = {"last_files": pushed_run(os.path.join(out, "last"), "offline-user/ckpt-last", "checkpoint"),
               "all_files": pushed_run(os.path.join(out, "all"), "offline-user/ckpt-all", "all_checkpoints")}
    downloaded = os.path.join(out, "downloaded")
    for name in results["last_files"]:
        if name.startswith("last-checkpoint/"):
            hf_hub_download("offline-user/ckpt-last", name, local_dir=downloaded)
    checkpoint = os.path.join(downloaded, "last-checkpoint")
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        results["last_checkpoint_step"] = json.load(f)["global_step"]
    resumed = trainer(os.path.join(out, "resumed"), 6)
    resumed.train(resume_from_checkpoint=checkpoint)
    straight = trainer(os.path.join(out, "straight"), 6)
    straight.train()
    results["resumed_step"] = resumed.ivon.current_step
    results["max_abs_diff_resumed"] = max((p - q).abs().max().item() for p, q in
                                          zip(resumed.model.parameters(), straight.model.parameters()))
    with open(os.path.join(checkpoint, "optimizer.pt"), "r+b") as f:  # truncated in transit: named before loading
        f.truncate(100)
    try:
        trainer(os.path.join(out, "broken"), 6).train(resume_from_checkpoint=checkpoint)
        results["truncated_refusal"] = None
    except ValueError as error:
        results["truncated_refusal"] = str(error)
    json.dump(results, open(os.path.join(out, "results.json"), "w"))


if __name__ == "__main__":
    main(sys.argv[1])
