"""Run by tests/test_lora.py under `torchrun --nproc_per_node 2`: train LoRA adapters, dump each rank's weights."""

import os
import sys

import torch

from test_lora import _args, _train_rows, lora_bert, token_dataset
from varsmooth import VariationalTrainer


def main(out: str) -> None:
    model = lora_bert()
    args = _args(out, max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=2, ddp_backend="gloo",
                 ddp_find_unused_parameters=False)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=_train_rows(token_dataset(96)))
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    torch.save({"params": {n: p.detach().clone() for n, p in unwrapped.named_parameters() if p.requires_grad},
                "frozen": {n: p.detach().clone() for n, p in unwrapped.named_parameters() if not p.requires_grad},
                "hess": trainer.ivon.hessian().clone(), "world_size": trainer.args.world_size,
                "sync": trainer.ivon.sync},
               os.path.join(out, f"rank{trainer.args.process_index}.pt"))
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # destroys the process group; without it gloo can abort at exit


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # gloo's threads can abort the interpreter's teardown after the results are on disk
