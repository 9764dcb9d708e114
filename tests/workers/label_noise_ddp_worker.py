"""Run by tests/test_label_noise.py under `torchrun --nproc_per_node 2`: the label-noise export of a 2-process run, and
rank 0's single-process `compute_label_noise` on the same posterior to compare it with."""

import os
import sys

import torch

from test_label_noise import TinyClassifier, make_data
from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.label_noise import LabelNoiseCallback, compute_label_noise


def main(out: str) -> None:
    data = make_data(n=23)  # 23 rows in batches of 4 over 2 processes: the last step is padded with repeated rows
    args = VariationalTrainingArguments(
        output_dir=out, num_train_epochs=1, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=0.05, method_config={"beta2": 0.99}, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0, use_cpu=True)
    torch.manual_seed(0)
    trainer = VariationalTrainer(TinyClassifier(), args, train_dataset=data,
                                 callbacks=[LabelNoiseCallback(num_samples=4)])
    trainer.train()
    assert trainer.args.world_size == 2, trainer.args.world_size
    if trainer.args.process_index == 0:
        model = trainer.accelerator.unwrap_model(trainer.model)
        single = compute_label_noise(model, trainer.posterior(), data, num_samples=4, seed=args.eval_seed)
        single.to_parquet(os.path.join(out, "single_process.parquet"))
    trainer.accelerator.wait_for_everyone()
    trainer.end()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # gloo's threads can abort the interpreter's teardown after the results are on disk
