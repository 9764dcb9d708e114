"""Run by tests/test_examples.py under a 2-process launch: an example script's `main()`, unchanged, with each rank's
final weights, Hessian and metrics dumped beside the output folder when the script calls `trainer.end()`.

    example_ddp_worker.py <example name> <dump folder> <example flags...>
"""

import os
import sys

import torch

from helpers import load_example
from varsmooth import VariationalTrainer


def main(name: str, dump: str, flags: list[str]) -> None:
    example = load_example(name)
    end = VariationalTrainer.end

    def dump_then_end(trainer: VariationalTrainer) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "hess": trainer.ivon.hessian().clone(), "world_size": trainer.args.world_size},
                   os.path.join(dump, f"rank{trainer.args.process_index}.pt"))
        end(trainer)

    VariationalTrainer.end = dump_then_end
    sys.argv = [name, *flags]
    example.main()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
