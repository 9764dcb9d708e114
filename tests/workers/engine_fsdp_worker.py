"""Run by tests/test_engine.py under `torchrun --nproc_per_node 2`: VariationalIVON on FSDP2-sharded parameters.

Each rank trains on its half of every global batch; FSDP2 averages the gradients, the engine samples and updates the
local shards (compiled kernels), on given noise whose shards form the whole draw of one process. Halfway, the model
and optimizer are saved with torch.distributed.checkpoint; a fresh sharded model restored from it finishes the run
again. A last run draws its own noise on each shard.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import draw_indexed_noise
from test_engine import FSDP_STEPS, IVON_KW, MLP, _data, _groups
from varsmooth.posterior import VariationalIVON, optimizer as engine

OWN_NOISE = engine.draw_noise


def build(mesh, given_noise=True):
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    opt = VariationalIVON(_groups(model, IVON_KW["weight_decay"]), sample_seed=4, rank=dist.get_rank(), compiled=True,
                          **kw)
    engine.draw_noise = draw_indexed_noise if given_noise else OWN_NOISE
    return model, opt


def train(model, opt, steps, rank, world):
    x, y = _data(2 * FSDP_STEPS, batch=32)
    half = 32 // world
    trajectory = []
    for step in steps:
        for k in range(2):
            b = 2 * step + k
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(x[b, rank * half:(rank + 1) * half]),
                                y[b, rank * half:(rank + 1) * half]).backward()
        opt.step()
        trajectory.append((torch.cat([p.full_tensor().flatten() for p in model.parameters()]), opt.hessian()))
    return trajectory


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    assert type(next(model.parameters())).__name__ == "DTensor"
    first = train(model, opt, range(FSDP_STEPS // 2), rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
    second = train(model, opt, range(FSDP_STEPS // 2, FSDP_STEPS), rank, world)

    fresh, fresh_opt = build(mesh)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(out, "ckpt"))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train(fresh, fresh_opt, range(FSDP_STEPS // 2, FSDP_STEPS), rank, world)
    own_noise = train(*build(mesh, given_noise=False), range(FSDP_STEPS), rank, world)[-1]
    torch.save({"trajectory": first + second, "resumed": resumed, "resumed_step": fresh_opt.current_step,
                "own_noise": own_noise},
               os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # gloo's worker threads can abort the interpreter's teardown after the results are on disk
