"""Run by tests/test_cuda.py under `torchrun --nproc_per_node 1`: VariationalTrainer with FSDP2 on one GPU.

Trains the model of `fsdp_setup()` (the test builds the same one without FSDP), evaluates by BMA and saves model and
posterior with `save_model`; writes the weights, the Hessian and the metrics for the test to compare. `vit` (a tiny
HF ViT) is sharded first by hand, the path of a user who shards the model beforehand.
"""

import os
import sys

import numpy as np
import torch

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import VariationalTrainer

FSDP_STEPS = 8


def fsdp_setup(out: str, kind: str = "mlp", **kw):
    """(model, dataset, args) of the FSDP comparison: a small MLP (or a tiny HF ViT) on the digits, fp32, no TF32."""

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    ds = digits_dataset(256).map(lambda b: {"pixel_values": np.asarray(b["pixel_values"])[:, None]}, batched=True)
    torch.manual_seed(0)
    args = make_args(out, use_cpu=False, max_steps=FSDP_STEPS, per_device_train_batch_size=16, mc_samples=2,
                     eval_mc_samples=4, lr_scheduler_type="constant", train_sampling_strategy="sequential", beta2=0.99,
                     posterior_temperature=1.0, **kw)
    if kind == "mlp":
        return TinyClassifier(hidden=32), ds.with_format("torch"), args
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), \
        ds.with_format("torch"), args


def main(out: str, kind: str) -> None:
    # the string form of `fsdp` works in every transformers 5.x (`fsdp=True` only in later ones)
    model, ds, args = fsdp_setup(os.path.join(out, "run"), kind, fsdp="full_shard", fsdp_config={"version": 2})
    if kind == "vit":  # sharded by hand: accelerate keeps a model that is already an FSDPModule as it is
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__ in model._no_split_modules:
                fully_shard(module)
        fully_shard(model)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ds)
    trainer.train()
    assert trainer.is_fsdp_enabled and type(next(trainer.model.parameters())).__name__ == "DTensor"
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "model"))
    weights = {n: p.full_tensor().cpu() for n, p in trainer.model.named_parameters()}
    torch.save({"weights": weights, "hessian": trainer.ivon.hessian().cpu(), "metrics": metrics,
                "step": trainer.ivon.current_step}, os.path.join(out, "fsdp.pt"))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "mlp")
