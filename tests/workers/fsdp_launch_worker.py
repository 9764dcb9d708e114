"""Run by tests/test_fsdp_launch.py under `torchrun --nproc_per_node 2`, with the environment `accelerate launch
--use_fsdp --fsdp_version 2` sets: VariationalTrainer trains HF's ViT, BERT and ResNet (tiny configs) as they are,
with accelerate's own FSDP2 preparation, which fails on all three without the trainer's help.

accelerate keeps its FSDP plugin on CPU processes only through `fsdp_on_cpu` (it drops it there otherwise). The
model named by the second argument trains a few steps, exports its label noise and is saved with `save_model`; rank 0
writes the initial weights, the gathered trained ones (`full_tensor`), the Hessian and the loss for the test to compare
with the files.
"""

import os
import sys

import fsdp_on_cpu  # noqa: F401 - keeps accelerate's FSDP plugin on CPU processes
import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset

from helpers import digits_images, make_args, tiny_digits_resnet
from varsmooth import LabelNoiseCallback, VariationalTrainer

STEPS = 4


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=10)), digits_images(128)


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    ids = np.random.default_rng(0).integers(1, 50, (128, 8))
    data = Dataset.from_dict({"input_ids": ids, "label": (ids[:, 0] % 3).tolist()}).with_format("torch")
    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=3,
        max_position_embeddings=16)), data


MODELS = {"vit": vit, "bert": bert, "resnet": lambda: (tiny_digits_resnet(), digits_images(128))}


def main(out: str, kind: str) -> None:
    model, data = MODELS[kind]()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    # BERT's word embeddings in the posterior with their mean frozen: a second param group, sharded like the first
    frozen = {"frozen_mean_modules": ["word_embeddings"]} if kind == "bert" else {}
    args = make_args(os.path.join(out, kind), max_steps=STEPS, lr_scheduler_type="constant", posterior_temperature=1.0,
                     eval_mc_samples=2, **frozen)
    # the label-noise export at the end of training gathers σ and the draws' predictions on every process
    trainer = VariationalTrainer(model=model, args=args, train_dataset=data,
                                 callbacks=[LabelNoiseCallback(num_samples=2)])
    loss = trainer.train().training_loss
    assert trainer.is_fsdp_enabled and type(next(trainer.model.parameters())).__name__ == "DTensor", kind
    trained = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}  # a collective: every rank
    hessian = trainer.ivon.hessian()  # gathered: every rank
    trainer.save_model(os.path.join(out, kind, "model"))
    if dist.get_rank() == 0:
        torch.save({"initial": initial, "trained": trained, "hessian": hessian, "loss": loss,
                    "hess_init": trainer.ivon.param_groups[0]["hess_init"], "step": trainer.ivon.current_step},
                   os.path.join(out, kind, "result.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)  # gloo's worker threads can abort the interpreter's teardown after the results are on disk
