"""varsmooth's IVON engine against ivon-opt, the reference: same trajectory on the same noise, checkpoints, DDP."""

import copy
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import ivon
from helpers import SeededIVON, skip_without_fused_kernels
from varsmooth.posterior import VariationalIVON
from varsmooth.posterior.fused import cpu_kernels

STEPS = 50
FSDP_STEPS = 12


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.fc2 = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _data(n_batches, batch=16, seed=0):
    """The first n_batches of a fixed sequence of batches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, batch, 6, generator=g)
    return x[:n_batches], torch.randint(0, 3, (200, batch), generator=g)[:n_batches]


def _groups(model, wd):
    """Weights with decay wd; biases and norms without decay and at half the lr (per-group settings)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0, "lr": 0.05}]


def _run(opt_cls, model, steps, samples_per_step, clip_norm=0.0, closure_mc=0, data_seed=0, **kw):
    """The ivon-opt README loop; returns per step (params, hess, momentum), each flat in param order."""
    model = copy.deepcopy(model)
    opt = opt_cls(_groups(model, kw.pop("weight_decay")), **kw)
    x, y = _data(steps * samples_per_step, seed=data_seed)
    trajectory = []
    for step in range(steps):
        def sample(b):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss = F.cross_entropy(model(x[b]), y[b])
                loss.backward()
                if clip_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            return loss

        if closure_mc:
            opt.step(closure=lambda: sample(step))
        else:
            for k in range(samples_per_step):
                sample(step * samples_per_step + k)
            opt.step()
        trajectory.append((_flat(model.parameters()), *_opt_state(opt)))
    return trajectory, model, opt


def _flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def _opt_state(opt):
    if isinstance(opt, VariationalIVON):
        params = [p for g in opt.param_groups for p in g["params"]]
        return opt.hessian(), _flat(opt.state[p]["momentum"] for p in params)
    return torch.cat([g["hess"] for g in opt.param_groups]), torch.cat([g["momentum"] for g in opt.param_groups])


def _assert_same_trajectory(ours, ref, tol=1e-6):
    for step, (a, b) in enumerate(zip(ours, ref)):
        for name, x, y in zip(("params", "hess", "momentum"), a, b):
            torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=lambda m: f"step {step}, {name}: {m}")


IVON_KW = dict(lr=0.1, ess=200.0, hess_init=0.3, beta1=0.9, beta2=0.99, weight_decay=1e-2)

#: the engine's code paths, all run on the CPU: "fused" (the CPU's compiled loops), "foreach" (the CPU without a
#: C++ compiler) and "redraw" (the accelerators' foreach path: the noise is drawn again for the step, not kept)
PATHS = ["fused", "foreach", "redraw"]


def _on_path(path, monkeypatch):
    """Constructor kwargs (and patches) that put every parameter of these small models on one code path."""
    import varsmooth.posterior.optimizer as engine

    if path == "fused":
        skip_without_fused_kernels()
        monkeypatch.setattr(engine, "FUSED_MIN_NUMEL", 0)  # the models here are far smaller than the threshold
        return {"fused": True}
    if path == "redraw":
        monkeypatch.setattr(VariationalIVON, "_keeps_noise", lambda self, t: self.noise_seed is None)
    return {"fused": False}


def _reference_noise(path):
    """SeededIVON's kwargs for the noise of `path`: the fused loops compute `counter_normal`, foreach ops draw from a
    generator."""
    return {"counter_min_numel": 0} if path == "fused" else {}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [
    dict(),
    dict(samples_per_step=3),  # gradient accumulation / MC samples averaged before the step
    dict(clip_radius=0.02, clip_norm=1.0),
    dict(rescale_lr=False, lr=0.02),
    dict(weight_decay=0.0, samples_per_step=2),
    dict(closure_mc=1, mc_samples=2),  # step(closure) runs the closure mc_samples times
    dict(debias=False),
    dict(beta2=1.0),  # a fixed Hessian
], ids=["base", "accumulate3", "clip", "no_rescale", "no_decay", "closure_mc2", "no_debias", "fixed_hessian"])
def test_same_trajectory_as_ivon_opt(case, path, monkeypatch):
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    kw = {**IVON_KW, **case}
    run_kw = dict(samples_per_step=kw.pop("samples_per_step", 1), clip_norm=kw.pop("clip_norm", 0.0),
                  closure_mc=kw.pop("closure_mc", 0))
    make = lambda g, **k: VariationalIVON(g, noise_seed=3, **path_kw, **k)  # noqa: E731
    ours, _, opt = _run(make, model, STEPS, **run_kw, **kw)
    ref, _, _ = _run(lambda g, **k: SeededIVON(g, seed=3, **_reference_noise(path), **k), model, STEPS, **run_kw, **kw)
    _assert_same_trajectory(ours, ref)
    assert opt.current_step == STEPS
    if path == "fused":  # the comparison ran the compiled loops, not a fallback
        assert opt._kernels is not None and opt._kernels.error is None
    if case.get("beta2") == 1.0:
        assert torch.equal(ours[-1][1], torch.full_like(ours[-1][1], 0.3))
    else:
        assert (ours[-1][1] - 0.3).abs().max() > 1e-2  # the Hessian moved: the comparison covers its update
    if "clip_radius" in case:  # clipping was active: without it the weights end elsewhere
        unclipped, _, _ = _run(make, model, STEPS, **run_kw, **{**kw, "clip_radius": float("inf")})
        assert (unclipped[-1][0] - ours[-1][0]).abs().max() > 1e-3


def _held_buffers(opt):
    """Parameter-sized buffers IVON holds besides its state, in parameter sizes (1.0 = one copy of the model)."""
    total = sum(p.numel() for g in opt.param_groups for p in g["params"])
    held = sum(t.numel() for slots in opt._buffers.values() for t in slots.values() if t is not None)
    return held / total


@pytest.mark.parametrize("samples_per_step", [1, 3])
def test_accelerator_path_holds_one_buffer_besides_the_state(samples_per_step, monkeypatch):
    """Where the noise is drawn again instead of kept, only the mean (while sampling) or mean(e⊙g) (until the step)
    is held: AdamW's two state tensors plus one (several samples per step: plus the running ḡ and one more e⊙g)."""
    import varsmooth.posterior.optimizer as engine

    redraw_kw = _on_path("redraw", monkeypatch)
    monkeypatch.setattr(engine, "CHUNK_NUMEL", 40)  # several chunks even for this small model
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(model.parameters(), noise_seed=0, **redraw_kw, **IVON_KW)
    x, y = _data(3 * samples_per_step)
    seen = []
    for step in range(3):
        for k in range(samples_per_step):
            with opt.sampled_params(train=True):
                seen.append(_held_buffers(opt))
                opt.zero_grad()
                F.cross_entropy(model(x[step * samples_per_step + k]), y[step * samples_per_step + k]).backward()
        seen.append(_held_buffers(opt))
        opt.step()
        seen.append(_held_buffers(opt))
    if samples_per_step == 1:
        assert seen == [1.0] * len(seen)
    else:
        # mean + mean(e⊙g) + ḡ while accumulating (the CPU path: + e); the mean and ḡ's buffer between steps
        assert max(seen) == 3.0 and seen[-1] == 2.0
    monkeypatch.undo()
    for path in ("fused", "foreach"):
        kept = VariationalIVON(copy.deepcopy(model).parameters(), noise_seed=0, **_on_path(path, monkeypatch),
                               **IVON_KW)
        with kept.sampled_params():
            assert _held_buffers(kept) == 2.0, path  # the CPU keeps e beside the mean


def test_channels_last_weights_get_their_noise_in_logical_order(monkeypatch):
    """A channels-last weight on every path: the accelerator path draws e twice (into the parameter, then into a
    buffer laid out like it), the CPU paths keep a contiguous noise buffer, which the fused loop fills and pairs with
    the weight's elements by logical index. Each follows ivon-opt on the same noise (in ivon-opt's flattened,
    logical order)."""
    x = torch.randn(6, 2, 3, 5, 5, generator=torch.Generator().manual_seed(1))

    def trajectory(make):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        assert not conv.weight.is_contiguous()
        opt = make(list(conv.parameters()))
        for batch in x:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                conv(batch).square().mean().backward()
            opt.step()
        return [conv.weight.detach().clone(), _opt_state(opt)[0]]

    for path in PATHS:
        monkeypatch.undo()
        path_kw = _on_path(path, monkeypatch)
        ours = trajectory(lambda params: VariationalIVON(params, noise_seed=2, **path_kw, **IVON_KW))
        ref = trajectory(lambda params: SeededIVON(params, seed=2, **_reference_noise(path), **IVON_KW))
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{path}: {m}")


def test_fused_kernels_that_do_not_compile_fall_back_to_foreach_or_raise(monkeypatch):
    """Without a C++ compiler torch.compile fails: the default warns once and trains with foreach ops (ivon-opt's
    trajectory all the same), fused=True refuses with the fix, and small tensors never compile."""
    import varsmooth.posterior.optimizer as engine
    from varsmooth.posterior.fused import CpuKernels

    broken = CpuKernels(None, None, "InvalidCxxCompiler: No working C++ compiler found")
    monkeypatch.setattr(engine, "cpu_kernels", lambda: broken)
    with pytest.raises(RuntimeError, match="install a C\\+\\+ compiler.*fused=False"):
        VariationalIVON(torch.nn.Linear(2, 2).parameters(), lr=0.1, ess=10, fused=True)
    small = VariationalIVON(torch.nn.Linear(2, 2).parameters(), lr=0.1, ess=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # below FUSED_MIN_NUMEL nothing compiles, so nothing warns
        with small.sampled_params():
            pass
    monkeypatch.setattr(engine, "FUSED_MIN_NUMEL", 0)
    torch.manual_seed(0)
    model = MLP()
    with pytest.warns(RuntimeWarning, match="do not compile.*No working C\\+\\+ compiler") as caught:
        ours, _, _ = _run(lambda g, **k: VariationalIVON(g, noise_seed=3, **k), model, 5, 1, **IVON_KW)
    assert len(caught) == 1
    ref, _, _ = _run(lambda g, **k: SeededIVON(g, seed=3, **k), model, 5, 1, **IVON_KW)
    _assert_same_trajectory(ours, ref)


def test_miscompiled_loops_are_caught_before_they_train(monkeypatch):
    """`cpu_kernels` runs the compiled loops against their eager formulas: a compiler that gets them wrong (here: one
    whose sample stores θ into the mean as well, as torch 2.14's Inductor did for one formulation) makes them
    unavailable, and the optimizer falls back to foreach ops with the usual warning."""
    import varsmooth.posterior.fused as fused

    def miscompile(fn, **kw):
        def wrong(*args):
            fn(*args)
            if fn is fused._sample:
                args[1].copy_(args[0])
        return wrong

    monkeypatch.setattr(fused.torch, "compile", miscompile)
    kernels = fused.cpu_kernels.__wrapped__()
    assert kernels.sample is None and "compiled _sample loop disagrees with its eager formula" in kernels.error
    monkeypatch.setattr(fused.torch, "compile", lambda fn, **kw: lambda *args: fn(*args))  # correct "loops" pass
    assert fused.cpu_kernels.__wrapped__().error is None
    # TORCHDYNAMO_DISABLE=1 makes torch.compile return the function itself: eager, the loops would be slower than
    # the foreach formulation (counter_normal in separate operations), so they count as unavailable
    monkeypatch.setattr(fused.torch, "compile", lambda fn, **kw: fn)
    assert "torch.compile is switched off" in fused.cpu_kernels.__wrapped__().error


def test_a_dtype_whose_loops_fail_their_check_runs_on_foreach_ops(monkeypatch):
    """Each dtype's loops are checked when first used: a bfloat16 weight whose compiled sample is wrong takes foreach
    ops with one warning (fused=True refuses), while the float32 weight beside it keeps the fused loops."""
    import varsmooth.posterior.fused as fused
    import varsmooth.posterior.optimizer as engine

    _on_path("fused", monkeypatch)

    def wrong_in_bfloat16(*args):
        fused._sample(*args)
        if args[0].dtype == torch.bfloat16:
            args[1].copy_(args[0])

    kernels = fused.CpuKernels(wrong_in_bfloat16, cpu_kernels().update, None)
    monkeypatch.setattr(engine, "cpu_kernels", lambda: kernels)
    assert kernels.error_for(torch.float64) is None
    assert "compiled _sample loop disagrees with its eager formula for torch.bfloat16" in kernels.error_for(torch.bfloat16)
    weights = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))]
    opt = VariationalIVON(weights, lr=0.1, ess=10.0)
    with pytest.warns(RuntimeWarning, match="fail for torch.bfloat16") as caught:
        assert [opt._fuses(p) for p in weights] == [True, False]
        assert opt._fuses(weights[1]) is False
    assert len(caught) == 1
    with pytest.raises(RuntimeError, match="fused=True.*fail for torch.bfloat16"):
        VariationalIVON(weights, lr=0.1, ess=10.0, fused=True)._fuses(weights[1])


@pytest.mark.parametrize("path", ["fused", "foreach"])
def test_mixed_dtypes_one_step_matches_ivon_opt_formulas(path, monkeypatch):
    """Parameters of two dtypes in one optimizer (ivon-opt refuses): each is updated by ivon-opt's own formulas."""
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    c = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    kw = dict(lr=0.1, ess=50.0, hess_init=0.4, beta1=0.9, beta2=0.9, weight_decay=1e-2, clip_radius=0.5)
    opt = VariationalIVON([a, b, c], noise_seed=1, **path_kw, **kw)
    means = [p.detach().clone() for p in (a, b, c)]
    with opt.sampled_params(train=True):
        noise = [p.detach() - m for p, m in zip((a, b, c), means)]
        ((a.sum(0) * b.float()).square().sum() + b.pow(3).sum() + (c.float() * a[0]).square().sum()).backward()
        grads = [p.grad.clone() for p in (a, b, c)]
    assert all(torch.equal(p.detach(), m) for p, m in zip((a, b, c), means))
    opt.step()
    assert [opt._fuses(p) for p in (a, b, c)] == [path == "fused"] * 3
    for p, m0, n, g in zip((a, b, c), means, noise, grads):
        h0 = torch.full_like(p, 0.4)
        mom = ivon.IVON._new_momentum(g, torch.zeros_like(p), 0.9)
        hess = ivon.IVON._new_hess("price", h0, n * g, None, slice(None), 50.0, 0.9, 1e-2)
        expected = ivon.IVON._new_param_averages(m0, hess, mom, 0.1 * (0.4 + 1e-2), 1e-2, 0.5, 1 - 0.9, 0.4)
        assert opt.state[p]["hess"].dtype == p.dtype and opt.state[p]["momentum"].dtype == p.dtype
        # bfloat16: ivon-opt rounds each operation, the fused loop its results only
        tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[p.dtype]
        torch.testing.assert_close(opt.state[p]["momentum"], mom, atol=tol, rtol=tol)
        torch.testing.assert_close(opt.state[p]["hess"], hess, atol=tol, rtol=tol)
        torch.testing.assert_close(p.detach(), expected, atol=tol, rtol=tol)


def test_noise_is_counter_based_and_parameters_are_never_replaced():
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(model.parameters(), noise_seed=7, rank=0, **{**IVON_KW, "weight_decay": 1e-2})
    storage = [p.data_ptr() for p in model.parameters()]

    def draw(o, m):
        with o.sampled_params():
            return [p.detach().clone() for p in m.parameters()]

    first, second = draw(opt, model), draw(opt, model)
    assert not torch.equal(first[0], second[0])  # draw counter advances within a step
    twin_model, other_model = copy.deepcopy(model), copy.deepcopy(model)
    twin = VariationalIVON(twin_model.parameters(), noise_seed=7, rank=0, **IVON_KW)
    assert all(torch.equal(u, v) for u, v in zip(first, draw(twin, twin_model)))  # same (seed, rank, step, draw)
    other_rank = VariationalIVON(other_model.parameters(), noise_seed=7, rank=1, **IVON_KW)
    assert not torch.equal(first[0], draw(other_rank, other_model)[0])
    assert [p.data_ptr() for p in model.parameters()] == storage


@pytest.mark.parametrize("path", PATHS)
def test_crash_inside_sampling_restores_means_and_records_nothing(path, monkeypatch):
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(model.parameters(), noise_seed=0, **path_kw, **IVON_KW)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ZeroDivisionError):
        with opt.sampled_params(train=True):
            F.cross_entropy(model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
            1 / 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="without any gradient sample"):
        opt.step()
    if path != "fused":
        return
    # a fused loop that fails part-way through the weights, or at the first (e.g. a dtype it cannot compile): those
    # sampled are restored, the rest were never touched, and the loop's own error is the one raised
    compiled = opt._kernels.sample
    for failing_call in (3, 1):
        calls = []

        def fails(*args):
            calls.append(1)
            if len(calls) == failing_call:
                raise RuntimeError("compile failed")
            compiled(*args)

        monkeypatch.setattr(opt._kernels, "sample", fails)
        with pytest.raises(RuntimeError, match="compile failed"):
            with opt.sampled_params(train=True):
                pass
        assert len(calls) == failing_call
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_default_cpu_run_mixes_fused_and_foreach_tensors():
    """With the default threshold the large weights run the fused loop and the small tensors foreach ops, in one
    param group: together they follow ivon-opt."""
    skip_without_fused_kernels()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 160), torch.nn.Tanh(), torch.nn.Linear(160, 128),
                                torch.nn.Tanh(), torch.nn.Linear(128, 3))
    x, y = torch.randn(8, 16, 6), torch.randint(0, 3, (8, 16))
    runs = []
    import varsmooth.posterior.optimizer as engine

    for make in (lambda g, **k: VariationalIVON(g, noise_seed=1, **k),
                 lambda g, **k: SeededIVON(g, seed=1, counter_min_numel=engine.FUSED_MIN_NUMEL, **k)):
        m = copy.deepcopy(model)
        opt = make(m.parameters(), **IVON_KW)
        for xb, yb in zip(x, y):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(m(xb), yb).backward()
            opt.step()
        runs.append((opt, m, _flat(m.parameters()), _opt_state(opt)[0]))
    (ours, ours_model, *ours_state), (_, _, *ref_state) = runs
    fused = [ours._fuses(p) for p in ours_model.parameters()]
    assert fused == [False, False, True, False, False, False]  # only the 160×128 weight is large enough
    for a, b in zip(ours_state, ref_state):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("samples_per_step", [1, 2])
@pytest.mark.parametrize("path", PATHS)
def test_resume_from_per_parameter_checkpoint_is_exact(path, samples_per_step, monkeypatch):
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    make = lambda g, **k: VariationalIVON(g, noise_seed=5, **path_kw, **k)  # noqa: E731
    full, _, _ = _run(make, model, 12, samples_per_step, **IVON_KW)
    _, half_model, half_opt = _run(make, model, 6, samples_per_step, **IVON_KW)
    sd = half_opt.state_dict()
    assert set(sd["state"][0]) == {"momentum", "hess"} and sd["param_groups"][1]["current_step"] == 6
    resumed_model = copy.deepcopy(half_model)
    resumed = make(_groups(resumed_model, IVON_KW["weight_decay"]), **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
    resumed.load_state_dict(copy.deepcopy(sd))
    x, y = _data(12 * samples_per_step)
    for step in range(6, 12):
        for k in range(samples_per_step):
            with resumed.sampled_params(train=True):
                resumed.zero_grad()
                b = samples_per_step * step + k
                F.cross_entropy(resumed_model(x[b]), y[b]).backward()
        resumed.step()
    assert torch.equal(_flat(resumed_model.parameters()), full[-1][0])
    assert torch.equal(resumed.hessian(), full[-1][1])


def test_restore_from_posterior_inverts_the_posterior_std():
    torch.manual_seed(0)
    model = MLP()
    make = lambda g, **k: VariationalIVON(g, noise_seed=5, **k)  # noqa: E731
    _, _, trained = _run(make, model, 6, 2, **IVON_KW)
    fresh_model = copy.deepcopy(model)
    fresh = make(_groups(fresh_model, IVON_KW["weight_decay"]), **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
    stds = trained.posterior_std()
    fresh.restore_from_posterior(stds, step=6)
    # σ = 1/sqrt(ess (h + δ)) of the restored h is the σ it was restored from, and sampling draws with it
    for restored, std in zip(fresh.posterior_std(), stds):
        torch.testing.assert_close(restored, std, rtol=1e-5, atol=0)
    torch.testing.assert_close(fresh.hessian(), trained.hessian(), rtol=1e-4, atol=1e-7)
    assert fresh.current_step == 6
    assert all(float(fresh.state[p]["momentum"].abs().sum()) == 0 for g in fresh.param_groups for p in g["params"])
    with pytest.raises(ValueError, match="posterior stds"):
        fresh.restore_from_posterior(stds[:-1], step=6)


def test_flat_ivon_opt_checkpoint_loads_and_continues_the_trajectory():
    """A checkpoint of ivon-opt's layout (what VariationalIVON wrote before it had its own engine) still loads."""
    torch.manual_seed(0)
    model = MLP()
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    ref, ref_model, ref_opt = _run(lambda g, **k: SeededIVON(g, seed=2, **k), model, 4, 1, **IVON_KW)
    old = ref_opt.state_dict()
    old["state"]["current_step"] = ref_opt.current_step  # the earlier VariationalIVON stored its step there
    ours_model = copy.deepcopy(ref_model)
    ours = VariationalIVON(_groups(ours_model, IVON_KW["weight_decay"]), noise_seed=2, **kw)
    saved = copy.deepcopy(old)
    ours.load_state_dict(old)
    assert ours.current_step == 4
    torch.testing.assert_close(ours.hessian(), ref[-1][1], atol=0, rtol=0)
    x, y = _data(8, seed=1)
    for opt, m in ((ours, ours_model), (ref_opt, ref_model)):
        for step in range(4):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(m(x[step]), y[step]).backward()
            opt.step()
    torch.testing.assert_close(_flat(ours_model.parameters()), _flat(ref_model.parameters()), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.hessian(), _opt_state(ref_opt)[0], atol=1e-6, rtol=1e-6)
    assert all(torch.equal(saved["param_groups"][i][k], old["param_groups"][i][k]) for i in (0, 1) for k in ("hess", "momentum"))

    other = VariationalIVON(torch.nn.Linear(3, 3).parameters(), **kw)
    with pytest.raises(ValueError, match="param groups"):
        other.load_state_dict(old)
    other = VariationalIVON([{"params": torch.nn.Linear(3, 3).parameters()}, {"params": [torch.nn.Parameter(torch.ones(2))]}], **kw)
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict(old)


def test_bad_settings_are_refused():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="hess_approx"):
        VariationalIVON(p, lr=0.1, ess=10, hess_approx="gradsq")
    with pytest.raises(ValueError, match="ess"):
        VariationalIVON(p, lr=0.1, ess=0)
    with pytest.raises(ValueError, match="beta2"):
        VariationalIVON([{"params": p, "beta2": 1.5}], lr=0.1, ess=10)
    with pytest.raises(ValueError, match="floating-point"):
        VariationalIVON([torch.ones(2, dtype=torch.long)], lr=0.1, ess=10)


@pytest.mark.slow
def test_ddp_sync_matches_ivon_opt(tmp_path):
    """2 processes (gloo): the engine's all-reduce of ḡ and the Hessian estimate gives ivon-opt(sync=True)'s run."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(29700 + os.getpid() % 1000),
           os.path.join(os.path.dirname(__file__), "engine_ddp_worker.py"), str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for key in ("ours", "ref", "fused_1", "ref_1"):
        assert all(torch.equal(a, b) for a, b in zip(r0[key][-1], r1[key][-1])), key  # replicas identical
    _assert_same_trajectory(r0["ours"], r0["ref"])
    _assert_same_trajectory(r0["fused_1"], r0["ref_1"])
    # the sync changes the result: rank 0 alone (its own samples only) would end elsewhere
    assert (r0["alone"][-1][0] - r0["ours"][-1][0]).abs().max() > 1e-3


@pytest.mark.slow
def test_fsdp2_shards_match_one_process_and_resume_from_dcp(tmp_path):
    """FSDP2 (fully_shard, 2 processes, gloo): the engine samples and updates each rank's shard, the shards' noise is
    one draw, so the run equals one process on the same global batches; a torch.distributed.checkpoint restore
    continues it exactly."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(29800 + os.getpid() % 1000),
           os.path.join(os.path.dirname(__file__), "engine_fsdp_worker.py"), str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(r0["trajectory"][-1], r1["trajectory"][-1]))
    # ivon-opt in one process, whole global batches of 32, rank 0's noise as the fused loops compute it
    torch.manual_seed(0)
    model = MLP()
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    opt = SeededIVON(_groups(model, IVON_KW["weight_decay"]), seed=4, counter_min_numel=0, **kw)
    x, y = _data(2 * FSDP_STEPS, batch=32)
    for step in range(FSDP_STEPS):
        for k in range(2):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(x[2 * step + k]), y[2 * step + k]).backward()
        opt.step()
        params, hess = r0["trajectory"][step]
        torch.testing.assert_close(params, _flat(model.parameters()), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hess, _opt_state(opt)[0], atol=1e-5, rtol=1e-5)
    assert (_opt_state(opt)[0] - IVON_KW["hess_init"]).abs().max() > 1e-2
    assert r0["resumed_step"] == FSDP_STEPS
    for (p, h), (q, g) in zip(r0["resumed"], r0["trajectory"][FSDP_STEPS // 2:]):
        assert torch.equal(p, q) and torch.equal(h, g)



@pytest.mark.slow
def test_fsdp2_params_swapped_in_after_construction_train_predict_and_save(tmp_path):
    """The Trainer's FSDP2 path without a GPU: IVON is handed the sharded parameters after construction (accelerate's
    `prepare`), trains them like an unsharded run on the whole batches, and the posterior of the sharded model
    predicts by BMA as the unsharded one (the samples reach FSDP2's gathered weights) and saves the same file."""
    from safetensors import safe_open

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(29900 + os.getpid() % 1000),
           os.path.join(os.path.dirname(__file__), "posterior_fsdp_worker.py"), str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"posterior_rank{r}.pt", weights_only=True) for r in range(2))
    sharded, plain = r0["sharded"], r0["plain"]
    torch.testing.assert_close(sharded["weights"], plain["weights"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sharded["hessian"], plain["hessian"], atol=1e-5, rtol=1e-5)
    assert (plain["hessian"] - IVON_KW["hess_init"]).abs().max() > 1e-2
    for key in ("probs", "mean_probs"):
        torch.testing.assert_close(sharded[key], plain[key], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r1["sharded"][key], plain[key], atol=1e-5, rtol=1e-5)
    assert (plain["probs"] - plain["mean_probs"]).abs().max() > 1e-3  # the samples moved the prediction
    assert sharded["restored"] and plain["restored"]
    files = {}
    for kind in ("sharded", "plain"):
        with safe_open(tmp_path / kind / "posterior.safetensors", framework="pt") as f:
            files[kind] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata()["varsmooth"])
    assert files["sharded"][0].keys() == files["plain"][0].keys()
    for k, v in files["plain"][0].items():
        torch.testing.assert_close(files["sharded"][0][k], v, atol=1e-6, rtol=1e-5)


def test_forked_children_can_still_train_after_the_fused_kernels_compiled(tmp_path):
    """torch.compile's tracing, before a process's first backward, would leave autograd unusable in forked children
    (kill -9 tests, multiprocessing with fork): in a fresh process, compile, train, fork, and train in the child."""
    script = tmp_path / "fork_after_compile.py"
    script.write_text(
        "import multiprocessing, torch\n"
        "from varsmooth.posterior.fused import cpu_kernels\n"
        "def train():\n"
        "    torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()\n"
        "if __name__ == '__main__':\n"
        "    assert cpu_kernels().error is None, cpu_kernels().error\n"
        "    train()\n"
        "    child = multiprocessing.get_context('fork').Process(target=train)\n"
        "    child.start()\n"
        "    child.join(60)\n"
        "    raise SystemExit(child.exitcode)\n")
    skip_without_fused_kernels()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def test_without_a_cpp_compiler_a_real_run_warns_and_trains_with_foreach_ops(tmp_path):
    """The machine of a user without a C++ compiler, in a fresh process with an empty Inductor cache: torch.compile's
    own failure is caught, named in one warning, and training goes on with foreach ops."""
    script = tmp_path / "no_compiler.py"
    script.write_text(
        "import warnings, torch\n"
        "from varsmooth import VariationalIVON\n"
        "model = torch.nn.Linear(256, 256)\n"
        "opt = VariationalIVON(model.parameters(), lr=0.1, ess=100.0)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(2):\n"
        "        with opt.sampled_params(train=True):\n"
        "            model(torch.randn(4, 256)).sum().backward()\n"
        "        opt.step()\n"
        "messages = [str(w.message) for w in caught if 'fused CPU kernels' in str(w.message)]\n"
        "assert len(messages) == 1 and 'C++ compiler' in messages[0], messages\n"
        "assert not opt._fuses(model.weight) and torch.isfinite(model.weight).all()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CXX": str(tmp_path / "no-such-compiler"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
