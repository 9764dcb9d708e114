"""DDP on CPU (gloo, 2 processes): replicas stay identical and the posterior is IVON's unbiased estimate.

The data-parallel scheme of Shen et al. 2024 (Variational Learning is Effective for Large Deep Networks): each rank
draws its own weight sample, computes its local gradient (no DDP all-reduce), and IVON averages g and ε⊙g over ranks.
The reference is a single-process loop that takes the two ranks' samples in turn and lets IVON's Welford mean average
them.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import WORKERS, SeededIVON, TinyClassifier, digits_dataset, run_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_ddp_replicas_identical_and_posterior_correct(tmp_path, grad_accum):
    steps, world, batch = 3, 2, 16
    run_script(WORKERS / "ddp_worker.py", str(tmp_path), str(steps), str(grad_accum), nproc=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    assert ranks[0]["world_size"] == world and ranks[0]["sync"]
    for p0, p1 in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p0, p1)
    assert torch.equal(ranks[0]["hess"], ranks[1]["hess"])

    ds = digits_dataset(256)
    x, y = ds[:]["pixel_values"], ds[:]["label"]

    def rank_batches(step):  # accelerate shards a sequential loader batch by batch: rank r gets every world-th batch
        out = []
        for k in range(grad_accum):
            for r in range(world):
                b = (step * grad_accum + k) * world + r
                out.append((r, x[b * batch:(b + 1) * batch], y[b * batch:(b + 1) * batch]))
        return out

    torch.manual_seed(0)
    init = TinyClassifier()
    ref, ref_opt = _reference_ddp(init, rank_batches, steps, grad_accum)
    for p_ref, p_ddp in zip(ref.parameters(), ranks[0]["params"]):
        torch.testing.assert_close(p_ddp, p_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ranks[0]["hess"], ref_opt.param_groups[0]["hess"], atol=1e-5, rtol=1e-5)
    assert (ranks[0]["hess"] - 0.5).abs().max() > 1e-3


def _reference_ddp(init, rank_batches, steps, grad_accum):
    """One process, one IVON: every (rank, micro-batch) is one MC sample with that rank's seeded noise."""
    model = copy.deepcopy(init)
    opt = SeededIVON(model.parameters(), seed=0, lr=0.2, ess=256, hess_init=0.5, beta1=0.9, beta2=0.999,
                     weight_decay=2e-4)
    for step in range(steps):
        draws = {}
        for r, xb, yb in rank_batches(step):
            opt.rank, opt.draws = r, draws.get(r, 0)  # that rank's noise: its own counter of draws
            draws[r] = opt.draws + 1
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(xb).logits, yb).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("method", ["ols", "alasca"])
def test_ddp_method_state_is_shared(tmp_path, method):
    """OLS all-reduces its soft-label statistics, ALASCA gathers its EMA: every rank holds the same state."""
    run_script(WORKERS / "ddp_methods_worker.py", str(tmp_path), method)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert r0["state"] and r0["state"].keys() == r1["state"].keys()
    for key in r0["state"]:
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    if method == "ols":  # the checkpointed statistics are the sums of both ranks' own, and each rank counted some
        for key in ("accumulator", "counts"):
            torch.testing.assert_close(r0["state"][key], r0["local"][key] + r1["local"][key])
        assert r0["local"]["counts"].sum() > 0 and r1["local"]["counts"].sum() > 0
    else:  # ALASCA: each rank's examples went through its own EMA rows, and the gathered table holds all 12
        assert (r0["state"]["ema"].abs().sum(-1) > 0).all()
