"""Run by tests/test_hub.py in a subprocess whose HF_ENDPOINT points at the local Hub stand-in.

Trains a tiny model with intermediate pushes, pushes at the end, reloads from the stand-in, predicts with
`VariationalModel` and the pipeline, and writes what it saw to results.json for the test to check.
"""

import json
import os
import sys
import warnings

import numpy as np
import torch
from transformers import ResNetConfig, ResNetForImageClassification, ViTImageProcessor

from example_utils.data import load_digits_dataset
from varsmooth import LabelNoiseCallback, VariationalModel, VariationalTrainer, VariationalTrainingArguments, pipeline
from varsmooth.corruption import corrupt_labels
from varsmooth.posterior import derive_seed


def main(out: str) -> None:
    data = load_digits_dataset()
    train = data["train"].select(range(256))
    train, report = corrupt_labels(train, "symmetric", 0.2, seed=0, return_report=True)
    test = data["test"].select(range(40))
    processor = ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False)

    def transform(batch):
        return {"pixel_values": processor(batch["image"], return_tensors="pt")["pixel_values"],
                "labels": torch.as_tensor(batch["label"])}

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                          downsample_in_first_stage=False, num_labels=10,
                          id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)})
    args = VariationalTrainingArguments(
        output_dir=os.path.join(out, "run"), report_to=[], use_cpu=True, max_steps=20, per_device_train_batch_size=32,
        eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=10, push_to_hub=True,
        hub_model_id="offline-user/digits-ivon", hub_strategy="every_save", remove_unused_columns=False,
        eval_mc_samples=4, eval_seed=7, method_config={"beta2": 0.999}, disable_tqdm=True,
        posterior_temperature=1.0,  # the learned posterior: the pipeline's draws must disagree (mutual information > 0)
    )
    trainer = VariationalTrainer(model=ResNetForImageClassification(config), args=args,
                                 train_dataset=train.with_transform(transform),
                                 eval_dataset=test.with_transform(transform),
                                 processing_class=processor, noise_report=report,
                                 callbacks=[LabelNoiseCallback(num_samples=2, plots=True)])
    trainer.train()
    trainer.evaluate()
    # files this training did not write must not go up, whatever their names
    os.makedirs(os.path.join(out, "run", "drafts"), exist_ok=True)
    for stray in ("model-private.safetensors", "drafts/sketch.png", "holiday.png"):
        with open(os.path.join(out, "run", stray), "wb") as f:
            f.write(b"not for upload")
    trainer.push_to_hub(dataset="sklearn-digits")
    expected = np.exp(trainer.predict(test.with_transform(transform)).predictions)

    images = test[:]["image"]
    loaded = VariationalModel.from_pretrained("offline-user/digits-ivon")
    with torch.no_grad():
        got = loaded(pixel_values=processor(images, return_tensors="pt")["pixel_values"])
    classify = pipeline("image-classification", model="offline-user/digits-ivon")
    piped = classify(images[:5], top_k=10)
    piped_probs = [[next(r["score"] for r in res if r["label"] == str(k)) for k in range(10)] for res in piped]
    uncertain = classify(images[0], return_uncertainty=True)
    # the pipeline's posterior draws one by one (antithetic pairs: draws 2k and 2k+1 are m ± σ⊙e, e from the seed
    # derive_seed(seed, k)), each with the BatchNorm statistics of its own that came from the Hub with the posterior,
    # for the test to recompute the entropy and the mutual information by hand
    with torch.no_grad():
        first = processor(images[:1], return_tensors="pt")["pixel_values"]
        buffers = dict(loaded.model.named_buffers())
        mean_statistics = {name: value.clone() for name, value in buffers.items()}
        draws = []
        for s in range(loaded.num_samples):
            with loaded.posterior.sampled(derive_seed(loaded.seed, s // 2), mirrored=s % 2 == 1):
                for name, value in loaded.posterior_predictor.draw_buffers[s].items():
                    buffers[name].copy_(value)
                draws.append(loaded.model(pixel_values=first).logits.softmax(-1)[0].tolist())
        for name, value in mean_statistics.items():
            buffers[name].copy_(value)

    plain = ResNetForImageClassification(config)
    plain.push_to_hub("offline-user/plain-model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        VariationalModel.from_pretrained("offline-user/plain-model")
    extra = share_edge_cases(out, train.with_transform(transform), config)
    json.dump({
        "max_abs_diff_model": float(np.abs(got.probs.numpy() - expected).max()),
        "max_abs_diff_pipeline": float(np.abs(np.array(piped_probs) - expected[:5]).max()),
        "entropy_expected": float(-(expected[0] * np.log(expected[0])).sum()),
        "uncertain": uncertain,
        "draws": draws,
        "probs_expected": expected[0].tolist(),
        "no_posterior_warnings": [str(w.message) for w in caught],
        **extra,
    }, open(os.path.join(out, "results.json"), "w"))


def tiny_trainer(output_dir: str, hub_model_id: str, train, config, method: str = "ivon") -> VariationalTrainer:
    args = VariationalTrainingArguments(output_dir=output_dir, report_to=[], use_cpu=True, max_steps=2, method=method,
                                        per_device_train_batch_size=32, remove_unused_columns=False, disable_tqdm=True,
                                        hub_model_id=hub_model_id, eval_mc_samples=2,
                                        # ERM has no beta2
                                        **({"method_config": {"beta2": 0.999}} if method == "ivon" else {}))
    trainer = VariationalTrainer(model=ResNetForImageClassification(config), args=args, train_dataset=train)
    trainer.train()
    return trainer


def share_edge_cases(out: str, train, config) -> dict:
    """The user's own card, a repo reused by a run without posterior, and a PEFT model."""
    import peft
    from huggingface_hub import HfApi

    results = {}
    own = os.path.join(out, "own_card")
    os.makedirs(own)
    with open(os.path.join(own, "README.md"), "w") as f:
        f.write("# My own card\n")
    trainer = tiny_trainer(own, "offline-user/own-card", train, config)
    try:
        trainer.push_to_hub()
        results["own_card_refusal"] = None
    except FileExistsError as error:
        results["own_card_refusal"] = str(error)
    results["own_card_after_refusal"] = open(os.path.join(own, "README.md")).read()
    results["own_card_repo_after_refusal"] = sorted(HfApi().list_repo_files("offline-user/own-card")) if \
        HfApi().repo_exists("offline-user/own-card") else []
    trainer.push_to_hub(replace_model_card=True)
    results["own_card_replaced"] = open(os.path.join(own, "README.md")).read()

    reused = os.path.join(out, "reused")
    tiny_trainer(reused, "offline-user/reused", train, config).push_to_hub()
    results["reused_after_ivon"] = sorted(HfApi().list_repo_files("offline-user/reused"))
    tiny_trainer(reused, "offline-user/reused", train, config, method="erm").push_to_hub()
    results["reused_after_erm"] = sorted(HfApi().list_repo_files("offline-user/reused"))

    lora = peft.get_peft_model(ResNetForImageClassification(config), peft.LoraConfig(
        r=2, target_modules=["convolution"], modules_to_save=["classifier.1"]))
    args = VariationalTrainingArguments(output_dir=os.path.join(out, "peft"), report_to=[], use_cpu=True, max_steps=2,
                                        per_device_train_batch_size=32, remove_unused_columns=False, disable_tqdm=True,
                                        hub_model_id="offline-user/peft-ivon", eval_mc_samples=2,
                                        method_config={"beta2": 0.999})
    peft_trainer = VariationalTrainer(model=lora, args=args, train_dataset=train)
    peft_trainer.train()
    peft_trainer.push_to_hub()
    results["peft_files"] = sorted(HfApi().list_repo_files("offline-user/peft-ivon"))
    return results


if __name__ == "__main__":
    main(sys.argv[1])
