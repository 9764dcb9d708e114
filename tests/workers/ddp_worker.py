"""Run by tests/test_ddp.py under `torchrun --nproc_per_node 2`: train, then dump each rank's weights and Hessian."""

import os
import sys

import torch

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import VariationalTrainer


def main(out: str, steps: int, grad_accum: int) -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    args = make_args(out, max_steps=steps, per_device_train_batch_size=16, gradient_accumulation_steps=grad_accum,
                     learning_rate=0.2, beta2=0.999, lr_scheduler_type="constant", max_grad_norm=0.0,
                     train_sampling_strategy="sequential", ddp_backend="gloo", ddp_find_unused_parameters=False)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=digits_dataset(256))
    trainer.train()
    rank = trainer.args.process_index
    torch.save({"params": [p.detach().clone() for p in trainer.model.parameters()],
                "hess": trainer.ivon.hessian().clone(), "world_size": trainer.args.world_size,
                "sync": trainer.ivon.sync}, os.path.join(out, f"rank{rank}.pt"))
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # destroys the process group; without it gloo can abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    # gloo's worker threads can abort the interpreter's teardown (SIGABRT) after all work is done and the results
    # are on disk: leave without it
    os._exit(0)
