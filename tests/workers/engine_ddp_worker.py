"""Run by tests/test_engine.py under `torchrun --nproc_per_node 2`: VariationalIVON and ivon-opt, both with
sync=True."""

import os
import sys

import torch
import torch.distributed as dist

from helpers import SeededIVON
from test_engine import IVON_KW, MLP, STEPS, _run
from varsmooth.posterior import VariationalIVON


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()  # same initial weights on both ranks; the data below differ per rank through the shifted batches
    kw = dict(IVON_KW)
    runs = {}
    for name, make in (("ours", lambda g, **k: VariationalIVON(g, sample_seed=4, rank=rank, sync=True, **k)),
                       ("ref", lambda g, **k: SeededIVON(g, seed=4, rank=rank, sync=True, **k)),
                       ("alone", lambda g, **k: VariationalIVON(g, sample_seed=4, rank=rank, **k))):
        torch.manual_seed(rank)  # rank-specific data order: each rank sees other batches
        runs[name] = _run(make, model, STEPS, 2, data_seed=rank, **kw)[0]
    # one sample per step through the compiled kernels, whose e⊙g is the gradient sample's buffer until the sync
    for name, make in (("compiled_1", lambda g, **k: VariationalIVON(g, sample_seed=4, rank=rank, sync=True,
                                                                     compiled=True, **k)),
                       ("ref_1", lambda g, **k: SeededIVON(g, seed=4, rank=rank, sync=True, **k))):
        runs[name] = _run(make, model, STEPS, 1, data_seed=rank, **kw)[0]
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # gloo's worker threads can abort the interpreter's teardown after the results are on disk
