"""The engine's foreach and compiled paths against `_single_tensor_ivon`, its formula-by-formula reference: each step
of a run is replayed by the reference on the run's own inputs (the gradients and noise of its samples), so the paths
are compared one step at a time, without differences carried through the samples of later steps. With foreach=False
the engine runs the reference itself: the replay is then the same step, bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F

from test_engine import IVON_KW, MLP, _data, _groups, _on_path
from varsmooth.posterior import VariationalIVON, optimizer as engine
from varsmooth.posterior.kernels import _single_tensor_ivon

STEPS = 8


def _replayed_run(path, monkeypatch, samples_per_step=1, dtype=torch.float32, **settings):
    """Per step: the engine's (params, momentum, hess) and the reference's, each step of the reference starting from
    the engine's state before it, with the ḡ and mean(e⊙g) of the engine's samples."""
    path_kw = _on_path(path, monkeypatch)
    drawn = []

    def recording(bucket, draw_seed, into):
        noise = engine_draw(bucket, draw_seed, into)
        drawn.extend(zip(bucket.params, [e.clone() for e in noise]))
        return noise

    engine_draw = engine.draw_noise
    monkeypatch.setattr(engine, "draw_noise", recording)
    torch.manual_seed(0)
    model = MLP().to(dtype)
    kw = {**IVON_KW, **settings}
    # drawn in turn: the recording reads each sample's e as the last one drawn
    opt = VariationalIVON(_groups(model, kw.pop("weight_decay")), sample_seed=3, prefetch=False, **path_kw, **kw)
    x, y = _data(STEPS * samples_per_step)
    steps = []
    for step in range(STEPS):
        before = {p: (p.detach().clone(), opt.state[p]["momentum"].clone(), opt.state[p]["hess"].clone())
                  for p in model.parameters()}
        grads, products = {p: [] for p in before}, {p: [] for p in before}
        drawn.clear()
        for k in range(samples_per_step):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                b = step * samples_per_step + k
                F.cross_entropy(model(x[b].to(dtype)), y[b]).backward()
                for p, e in drawn[-len(before):]:
                    grads[p].append(p.grad.clone())
                    products[p].append(e * p.grad)
        opt.step()
        ours, ref = [], []
        for group in opt.param_groups:
            wd, b1 = group["weight_decay"], group["beta1"]
            lr = group["lr"] * (group["hess_init"] + wd) if opt.rescale_lr else group["lr"]
            weights, momentum, hess = ([before[p][i].clone() for p in group["params"]] for i in range(3))
            _single_tensor_ivon(weights, [_mean(grads[p]) for p in group["params"]], momentum, hess,
                                [_mean(products[p]) for p in group["params"]], lr=lr, beta1=b1, beta2=group["beta2"],
                                weight_decay=wd, ess=group["ess"], clip_radius=group["clip_radius"],
                                debias=1.0 - b1 ** opt.current_step if opt.debias else 1.0)
            ours += [(p.detach(), opt.state[p]["momentum"], opt.state[p]["hess"]) for p in group["params"]]
            ref += list(zip(weights, momentum, hess))
        steps.append((copy.deepcopy(ours), ref))
    return steps


def _mean(samples):
    """The engine's running mean of a step's samples (a + (x - a)/count)."""
    mean = samples[0].clone()
    for count, sample in enumerate(samples[1:], start=2):
        mean.lerp_(sample, 1.0 / count)
    return mean


def _compare(steps, exact=(), tol=1e-6):
    """`exact` names the quantities (params, momentum, hess) that must match bit for bit, the others within `tol`."""
    for step, (ours, ref) in enumerate(steps):
        for index, (a, b) in enumerate(zip(ours, ref)):
            for name, x, y in zip(("params", "momentum", "hess"), a, b):
                msg = lambda m: f"step {step}, parameter {index}, {name}: {m}"  # noqa: B023, E731
                if name in exact:
                    torch.testing.assert_close(x, y, atol=0, rtol=0, msg=msg)
                else:
                    torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=msg)


@pytest.mark.parametrize("path", ["foreach", "compiled", "reference"])
@pytest.mark.parametrize("case", [
    dict(),
    dict(samples_per_step=3),
    dict(clip_radius=0.02),
    dict(rescale_lr=False, debias=False, lr=0.02),
    dict(weight_decay=0.0),
    dict(dtype=torch.float64),
], ids=["base", "accumulate3", "clip", "no_rescale_no_debias", "no_decay", "float64"])
def test_each_step_is_the_reference_step(path, case, monkeypatch):
    """The momentum is the reference's arithmetic, bit for bit; the Hessian, rewritten to fewer operations, and the
    mean, which reads it, agree to rounding. foreach=False runs the reference: all three bit for bit."""
    steps = _replayed_run(path, monkeypatch, **case)
    # float64: the compiled kernels contract and reorder operations
    tol = {torch.float32: 1e-6, torch.float64: 1e-12 if path == "foreach" else 1e-9}[case.get("dtype", torch.float32)]
    _compare(steps, exact=("params", "momentum", "hess") if path == "reference" else ("momentum",), tol=tol)
    assert (steps[-1][0][0][2] - IVON_KW["hess_init"]).abs().max() > 1e-2  # the Hessian moved: its update is compared
    if "clip_radius" in case:  # the clip was active: without it the weights end elsewhere
        monkeypatch.undo()
        unclipped = _replayed_run(path, monkeypatch, **{**case, "clip_radius": float("inf")})
        assert (unclipped[-1][0][0][0] - steps[-1][0][0][0]).abs().max() > 1e-4


@pytest.mark.parametrize("path", ["foreach", "compiled"])
def test_with_a_fixed_hessian_each_step_is_the_reference_step_bit_for_bit(path, monkeypatch):
    """β2 = 1 leaves the Hessian where the rewrite would round: the kernels then make the reference's operations in
    its order (compiled by Inductor's C++ on the CPU: fused into one loop, each result rounded as eagerly)."""
    steps = _replayed_run(path, monkeypatch, beta2=1.0)
    _compare(steps, exact=("params", "momentum", "hess"))
    assert all(torch.equal(h, torch.full_like(h, IVON_KW["hess_init"])) for _, _, h in steps[-1][0])
