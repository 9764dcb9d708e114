"""Run by tests/test_engine.py under `torchrun --nproc_per_node 2`: what the Trainer does with FSDP2 parameters.

As accelerate's FSDP2 `prepare` does, IVON is built over the plain parameters and then handed the sharded (DTensor)
ones; it trains on each rank's half of the global batches. The posterior of the sharded model then predicts by BMA
and is gathered and saved; rank 0 repeats everything on an unsharded copy with the whole batches, for comparison.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import give_indexed_noise
from test_engine import FSDP_STEPS, IVON_KW, MLP, _data
from varsmooth.posterior import DiagonalGaussianPosterior, VariationalIVON
from varsmooth.prediction.bma import predictive_distribution


class Classifier(torch.nn.Module):  # predictive_distribution reads logits from a model called with keywords
    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x):
        return (self.net(x),)


def train(model, opt, rank, parts):
    x, y = _data(FSDP_STEPS, batch=32)
    size = 32 // parts
    for step in range(FSDP_STEPS):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            F.cross_entropy(model(x[step, rank * size:(rank + 1) * size])[0],
                            y[step, rank * size:(rank + 1) * size]).backward()
        opt.step()


def run(sharded, rank, world, out):
    torch.manual_seed(0)
    model = Classifier()
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    opt = VariationalIVON(model.parameters(), sample_seed=4, weight_decay=IVON_KW["weight_decay"], **kw)
    give_indexed_noise()  # the shards' parts of the unsharded run's draws
    if sharded:
        fully_shard(model.net.fc1, mesh=init_device_mesh("cpu", (world,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        new = dict(model.named_parameters())
        opt.param_groups[0]["params"] = [new[name] for name, _ in Classifier().named_parameters()]
    train(model, opt, rank if sharded else 0, world if sharded else 1)
    names = [name for name, _ in model.named_parameters()]
    posterior = DiagonalGaussianPosterior.from_ivon(model, opt, names, {"step": opt.current_step})
    x = _data(1, batch=8, seed=1)[0][0]
    model.eval()
    mean_before = [p.full_tensor() if sharded else p.detach().clone() for p in model.parameters()]
    bma = predictive_distribution(model, posterior, {"x": x}, num_samples=3, seed=5)
    mean_after = [p.full_tensor() if sharded else p.detach().clone() for p in model.parameters()]
    gathered = posterior.gathered()  # a collective under FSDP: every rank
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        gathered.save(out)
    return {"probs": bma.probs, "mean_probs": bma.mean_probs, "restored": all(torch.equal(a, b) for a, b in
                                                                             zip(mean_before, mean_after)),
            "weights": torch.cat([b.flatten() for b in mean_after]), "hessian": opt.hessian()}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"sharded": run(True, rank, world, os.path.join(out, "sharded"))}
    if rank == 0:
        result["plain"] = run(False, 0, world, os.path.join(out, "plain"))
    torch.save(result, os.path.join(out, f"posterior_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # gloo's worker threads can abort the interpreter's teardown after the results are on disk
