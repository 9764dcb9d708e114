"""Run by tests/test_ddp.py under `torchrun --nproc_per_node 2`: a stateful baseline under DDP.

Dumps each rank's weights and the method's state, so the test can check that replicas and the all-reduced
state (OLS soft labels and counts, ALASCA's EMA table) are identical across ranks.
"""

import os
import sys

import torch

from test_methods import image_data, tiny_resnet
from varsmooth import VariationalTrainer, VariationalTrainingArguments


def main(out: str, method: str) -> None:
    torch.manual_seed(0)
    model = tiny_resnet(2)
    args = VariationalTrainingArguments(
        output_dir=out, method=method, max_steps=6, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, optim="sgd", learning_rate=0.1, seed=0,
        method_config={"alasca_warmup_epochs": 1} if method == "alasca" else None,
        ddp_backend="gloo")
    data = [{**row, "labels": i % 2} for i, row in enumerate(image_data(12))]  # 3 steps per epoch on 2 ranks
    trainer = VariationalTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    # this rank's own statistics, before state_dict() reduces them over the ranks
    local = {k: getattr(trainer.method, k).clone() for k in ("accumulator", "counts") if hasattr(trainer.method, k)}
    state = {k: v for k, v in trainer.method.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "state": state, "local": local},
               os.path.join(out, f"rank{trainer.args.process_index}.pt"))
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # destroys the process group; without it gloo can abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # gloo's worker threads can abort the interpreter's teardown (SIGABRT) after all work is done and the results
    # are on disk: leave without it
    os._exit(0)
