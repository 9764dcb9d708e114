"""varsmooth's IVON engine against ivon-opt, the reference: same trajectory on the same noise, checkpoints, DDP."""

import copy
import os
import subprocess
import sys

import ivon
import pytest
import torch
import torch.nn.functional as F

from helpers import WORKERS, SeededIVON, give_indexed_noise, indexed_noise, run_script, skip_without_compiler
from varsmooth.posterior import VariationalIVON, kernels
from varsmooth.posterior.resume import ivon_state_from_posterior

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
            opt.step(closure=lambda: sample(step))  # noqa: B023
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
            torch.testing.assert_close(x, y, atol=tol, rtol=tol,
                                       msg=lambda m: f"step {step}, {name}: {m}")  # noqa: B023


IVON_KW = dict(lr=0.1, ess=200.0, hess_init=0.3, beta1=0.9, beta2=0.99, weight_decay=1e-2)

#: the engine's code paths, all run on the CPU: "compiled" (the default: torch.compile'd kernels, e from torch's CPU
#: generator, kept), "foreach" (compiled=False, the same functions run eagerly), "in_kernel" (what CUDA runs: the
#: compiled kernels draw e themselves with Inductor's Philox and draw it again when the gradient arrives) and
#: "reference" (foreach=False: the for-loop reference, one function per formula, e kept as on the foreach path)
PATHS = ["compiled", "foreach", "in_kernel", "reference"]
EAGER = ("foreach", "reference")


def _on_path(path, monkeypatch):
    """Constructor kwargs (and patches) that put these models on one code path."""
    if path in EAGER:
        return {"compiled": False} if path == "foreach" else {"foreach": False}
    skip_without_compiler()
    if path == "in_kernel":
        monkeypatch.setattr(VariationalIVON, "_keeps_noise", lambda self, t: not self._dispatch.compiles)
    return {"compiled": True}


def _same_noise(path, monkeypatch):
    """SeededIVON kwargs that give it the engine's noise on `path`: on the CPU paths SeededIVON draws as the engine
    does; Inductor's in-kernel draws cannot be replayed, so there both take `indexed_noise` (the kernels then get e
    as an argument instead of drawing it)."""
    if path == "in_kernel":
        give_indexed_noise(monkeypatch)
        return {"noise": indexed_noise}
    return {}


def _engine(seed, path_kw, **fixed):
    """A factory of VariationalIVON(params, **kw) on one path."""
    return lambda params, **kw: VariationalIVON(params, sample_seed=seed, **path_kw, **fixed, **kw)


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
    ref_noise = _same_noise(path, monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    kw = {**IVON_KW, **case}
    run_kw = dict(samples_per_step=kw.pop("samples_per_step", 1), clip_norm=kw.pop("clip_norm", 0.0),
                  closure_mc=kw.pop("closure_mc", 0))
    make = _engine(3, path_kw)
    ours, _, opt = _run(make, model, STEPS, **run_kw, **kw)
    ref, _, _ = _run(lambda g, **k: SeededIVON(g, seed=3, **ref_noise, **k), model, STEPS, **run_kw, **kw)
    _assert_same_trajectory(ours, ref)
    assert opt.current_step == STEPS
    assert opt._dispatch.compiles is (path not in EAGER)  # the comparison ran the compiled kernels, not a fallback
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
def test_in_kernel_path_holds_one_buffer_besides_the_state(samples_per_step, monkeypatch):
    """Where the kernels draw e again instead of keeping it (accelerators), only the mean (while sampling) or
    mean(e⊙g) (until the step) is held: AdamW's two state tensors plus one (several samples per step: plus the
    running ḡ and one more e⊙g). The CPU keeps e beside the mean."""
    path_kw = _on_path("in_kernel", monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(model.parameters(), sample_seed=0, **path_kw, **IVON_KW)
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
        assert max(seen) == 3.0 == seen[-1]  # mean + mean(e⊙g) + ḡ while accumulating, kept for the next step
    monkeypatch.undo()
    for path in ("compiled", "foreach"):
        kept = VariationalIVON(copy.deepcopy(model).parameters(), sample_seed=0, **_on_path(path, monkeypatch),
                               **IVON_KW)
        with kept.sampled_params():
            assert _held_buffers(kept) == 2.0, path


def test_channels_last_weights_get_their_noise_in_logical_order(monkeypatch):
    """A channels-last weight on every path (the CPU keeps a contiguous noise buffer, the in-kernel draw numbers
    elements by logical index): each follows ivon-opt on the same noise, in ivon-opt's flattened, logical order."""
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
        ref_noise = _same_noise(path, monkeypatch)
        ours = trajectory(lambda params: _engine(2, path_kw)(params, **IVON_KW))  # noqa: B023
        ref = trajectory(lambda params: SeededIVON(params, seed=2, **ref_noise, **IVON_KW))  # noqa: B023
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{path}: {m}")  # noqa: B023


def test_kernels_that_do_not_compile_fall_back_to_foreach_or_raise(monkeypatch):
    """Without a C++ compiler torch.compile fails: the default warns once and trains with foreach ops (ivon-opt's
    trajectory all the same), compiled=True refuses with the fix."""
    def broken(fn):
        def compile_fails(*args, **kwargs):
            raise torch._dynamo.exc.BackendCompilerFailed(
                lambda *a: None, RuntimeError("InvalidCxxCompiler: No working C++ compiler found"), None)
        return compile_fails

    monkeypatch.setattr(kernels, "_compiled", broken)
    opt = VariationalIVON(torch.nn.Linear(2, 2).parameters(), lr=0.1, ess=10, compiled=True)
    with pytest.raises(RuntimeError, match="compiled=True, but IVON's kernels do not compile.*compiled=False"):
        with opt.sampled_params():
            pass
    torch.manual_seed(0)
    model = MLP()
    with pytest.warns(RuntimeWarning, match="do not compile.*No working C\\+\\+ compiler") as caught:
        ours, _, opt = _run(lambda g, **k: VariationalIVON(g, sample_seed=3, **k), model, 5, 1, **IVON_KW)
    assert len(caught) == 1 and not opt._dispatch.compiles
    ref, _, _ = _run(lambda g, **k: SeededIVON(g, seed=3, **k), model, 5, 1, **IVON_KW)
    _assert_same_trajectory(ours, ref)


@pytest.mark.parametrize("path", PATHS)
def test_mixed_dtypes_one_step_matches_ivon_opt_formulas(path, monkeypatch):
    """Parameters of three dtypes in one optimizer (ivon-opt refuses), with the engine's own noise: each is updated by
    ivon-opt's formulas on the noise read off the sample (on the in-kernel path this checks that the kernel draws the
    sample's e again for e⊙g)."""
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    # small bfloat16 means: the noise read off the sample, θ - m, is then rounded relative to σ, not to m
    c = torch.nn.Parameter(0.01 * torch.randn(4, dtype=torch.bfloat16))
    kw = dict(lr=0.1, ess=50.0, hess_init=0.4, beta1=0.9, beta2=0.9, weight_decay=1e-2, clip_radius=0.5)
    opt = VariationalIVON([a, b, c], sample_seed=1, **path_kw, **kw)
    means = [p.detach().clone() for p in (a, b, c)]
    with opt.sampled_params(train=True):
        noise = [p.detach() - m for p, m in zip((a, b, c), means)]
        ((a.sum(0) * b.float()).square().sum() + b.pow(3).sum() + (c.float() * a[0]).square().sum()).backward()
        grads = [p.grad.clone() for p in (a, b, c)]
    assert all(torch.equal(p.detach(), m) for p, m in zip((a, b, c), means))
    opt.step()
    for p, m0, n, g in zip((a, b, c), means, noise, grads):
        h0 = torch.full_like(p, 0.4)
        mom = ivon.IVON._new_momentum(g, torch.zeros_like(p), 0.9)
        hess = ivon.IVON._new_hess("price", h0, n * g, None, slice(None), 50.0, 0.9, 1e-2)
        expected = ivon.IVON._new_param_averages(m0, hess, mom, 0.1 * (0.4 + 1e-2), 1e-2, 0.5, 1 - 0.9, 0.4)
        assert opt.state[p]["hess"].dtype == p.dtype and opt.state[p]["momentum"].dtype == p.dtype
        # bfloat16: its sample θ - m is rounded, and ivon-opt rounds each operation, the compiled kernels only results;
        # float64: the compiled kernels contract and reorder operations (h is ~2000× its initial value here)
        tol = {torch.float32: 1e-5, torch.float64: 1e-12 if path in EAGER else 1e-9, torch.bfloat16: 2e-2}[p.dtype]
        torch.testing.assert_close(opt.state[p]["momentum"], mom, atol=tol, rtol=tol)
        torch.testing.assert_close(opt.state[p]["hess"], hess, atol=tol, rtol=tol)
        torch.testing.assert_close(p.detach(), expected, atol=tol, rtol=tol)
    assert opt._dispatch.compiles is (path not in EAGER)


@pytest.mark.parametrize("path", PATHS)
def test_noise_is_seeded_by_counters_and_parameters_are_never_replaced(path, monkeypatch):
    """The same (seed, rank, step, draw) gives the same sample on the same path; another rank or draw another; the
    draws are standard normal; the global RNG is left as it was."""
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    kw = {**IVON_KW, "hess_init": 1.0, "weight_decay": 0.0, "ess": 1.0}  # σ = 1: the sample minus the mean is e
    storage = [p.data_ptr() for p in model.parameters()]

    def draw(rank, m=model, **extra):
        opt = VariationalIVON(m.parameters(), sample_seed=7, rank=rank, **path_kw, **kw, **extra)
        samples = []
        for _ in range(2):
            with opt.sampled_params():
                samples.append(torch.cat([(p - q).detach().flatten() for p, q in zip(m.parameters(), means)]))
        return samples

    means = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    first, second = draw(0)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(first, second)  # the draw counter advances within a step
    assert torch.equal(draw(0, copy.deepcopy(model))[0], first)
    assert (draw(1)[0] - first).abs().min() > 0  # another rank: another sample, element by element
    assert abs(first.mean()) < 0.05 and abs(first.std() - 1.0) < 0.05 and first.abs().max() < 6.0
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1]) < 0.05
    assert [p.data_ptr() for p in model.parameters()] == storage


def test_one_seed_per_bucket_and_draw(monkeypatch):
    """The noise generator is seeded once per (device, dtype) bucket of a param group and draw, not per parameter."""
    import varsmooth.posterior.optimizer as engine

    seeds = []
    monkeypatch.setattr(engine, "derive_seed", lambda *keys: seeds.append(keys) or hash(keys) % (1 << 62))
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    opt = VariationalIVON(_groups(model, 1e-2), sample_seed=0, compiled=False, prefetch=False,
                          **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
    with opt.sampled_params(train=True):
        model(torch.ones(4)).sum().backward()
    opt.step()
    # one base seed for the draw, then one seed per bucket (two param groups), once at the sample (a prefetch would
    # add the next draw's)
    assert len(seeds) == 3


@pytest.mark.parametrize("path", ["compiled", "foreach"])
@pytest.mark.parametrize("samples_per_step", [1, 3])
def test_prefetched_noise_is_the_noise_drawn_in_turn(path, samples_per_step, monkeypatch):
    """With `prefetch`, the next sample's e is drawn on another thread during this sample's backward: the same
    trajectory, bit for bit, as drawing it in turn, also where the prediction misses (an evaluation sample between
    steps, a resume); the draws after the first come from the other thread; no thread outlives a sample."""
    import threading

    import varsmooth.posterior.optimizer as engine

    path_kw = _on_path(path, monkeypatch)
    threads, own_draw = [], engine.draw_noise

    def recording(bucket, draw_seed, into):
        threads.append(threading.current_thread().name)
        return own_draw(bucket, draw_seed, into)

    monkeypatch.setattr(engine, "draw_noise", recording)
    torch.manual_seed(0)
    model = MLP()
    x, y = _data(8 * samples_per_step)

    def trajectory(prefetch, evaluate_at=(), resume_at=None):
        m = copy.deepcopy(model)
        make = lambda: VariationalIVON(_groups(m, 1e-2), sample_seed=4, prefetch=prefetch, **path_kw,  # noqa: E731
                                       **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
        opt, out = make(), []
        for step in range(8):
            if step == resume_at:
                saved, opt = opt.state_dict(), make()
                opt.load_state_dict(saved)
            for k in range(samples_per_step):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    F.cross_entropy(m(x[step * samples_per_step + k]), y[step * samples_per_step + k]).backward()
                assert not any(t.name == "ivon-noise-prefetch" for t in threading.enumerate())
            opt.step()
            if step in evaluate_at:
                with opt.sampled_params():
                    pass
            out.append((_flat(m.parameters()), *_opt_state(opt)))
        return out

    in_turn = trajectory(False)
    assert set(threads) == {threading.current_thread().name}
    threads.clear()
    prefetched = trajectory(True)
    for a, b in zip(in_turn, prefetched):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    buckets = 2  # two param groups on one device and dtype
    # each training sample draws the next one ahead; the first step's draws are drawn in turn (one draw per step is
    # predicted until a step has counted them), every later one was drawn ahead
    assert threads.count("ivon-noise-prefetch") == buckets * 8 * samples_per_step
    assert threads.count(threading.current_thread().name) == buckets * samples_per_step
    missed = dict(evaluate_at=(2, 5), resume_at=4)
    assert all(torch.equal(u, v) for a, b in zip(trajectory(False, **missed), trajectory(True, **missed))
               for u, v in zip(a, b))


@pytest.mark.parametrize("case", [dict(), dict(clip_radius=0.02, weight_decay=0.05)], ids=["base", "clip_decay"])
def test_cpu_paths_draw_the_same_samples(case, monkeypatch):
    """On the CPU the compiled kernels, foreach ops and the for-loop reference take e from the same generator: one
    seed, one trajectory (the reference's to rounding: it computes σ and the Hessian as the paper writes them)."""
    torch.manual_seed(0)
    model = MLP()
    kw = {**IVON_KW, **case}
    compiled, *others = [_run(_engine(6, _on_path(path, monkeypatch)), model, 5, 2, **kw)[0]
                         for path in ("compiled", "foreach", "reference")]
    for other in others:
        _assert_same_trajectory(compiled, other)


@pytest.mark.parametrize("path", PATHS)
def test_crash_inside_sampling_restores_means_and_records_nothing(path, monkeypatch):
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(_groups(model, 1e-2), sample_seed=0, **path_kw, **{k: v for k, v in IVON_KW.items()
                                                                            if k != "weight_decay"})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ZeroDivisionError):
        with opt.sampled_params(train=True):
            F.cross_entropy(model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
            raise ZeroDivisionError
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="without any gradient sample"):
        opt.step()
    # a kernel that fails at the second bucket (the second param group): the first bucket, sampled, is restored,
    # and the kernel's own error is the one raised
    calls = []

    def fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel failed")
        real(*args, **kwargs)

    if path == "reference":  # its sampling is a function of its own, not a kernel run by the dispatch
        real = kernels._single_tensor_sample
        monkeypatch.setattr(kernels, "_single_tensor_sample", fails)
    else:
        real, opt._dispatch = opt._dispatch, fails
        fails.compiles = real.compiles
    with pytest.raises(RuntimeError, match="kernel failed"):
        with opt.sampled_params(train=True):
            pass
    assert len(calls) == 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("samples_per_step", [1, 2])
@pytest.mark.parametrize("path", PATHS)
def test_resume_from_per_parameter_checkpoint_is_exact(path, samples_per_step, monkeypatch):
    path_kw = _on_path(path, monkeypatch)
    torch.manual_seed(0)
    model = MLP()
    make = _engine(5, path_kw)
    full, _, _ = _run(make, model, 12, samples_per_step, **IVON_KW)
    _, half_model, half_opt = _run(make, model, 6, samples_per_step, **IVON_KW)
    sd = half_opt.state_dict()
    assert set(sd["state"][0]) == {"momentum", "hess"} and sd["param_groups"][1]["current_step"] == 6
    resumed_model = copy.deepcopy(half_model)
    resumed = make(_groups(resumed_model, IVON_KW["weight_decay"]),
                   **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
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


def test_state_from_posterior_inverts_the_posterior_std():
    torch.manual_seed(0)
    model = MLP()
    make = lambda g, **k: VariationalIVON(g, sample_seed=5, **k)  # noqa: E731
    _, _, trained = _run(make, model, 6, 2, **IVON_KW)
    fresh_model = copy.deepcopy(model)
    fresh = make(_groups(fresh_model, IVON_KW["weight_decay"]),
                 **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
    stds = trained.posterior_std()
    fresh.load_state_dict(ivon_state_from_posterior(fresh, stds, 6))
    # σ = 1/sqrt(ess (h + δ)) of the restored h is the σ it was restored from, and sampling draws with it
    for restored, std in zip(fresh.posterior_std(), stds):
        torch.testing.assert_close(restored, std, rtol=1e-5, atol=0)
    torch.testing.assert_close(fresh.hessian(), trained.hessian(), rtol=1e-4, atol=1e-7)
    assert fresh.current_step == 6
    assert all(float(fresh.state[p]["momentum"].abs().sum()) == 0 for g in fresh.param_groups for p in g["params"])
    with pytest.raises(ValueError, match="posterior stds"):
        ivon_state_from_posterior(fresh, stds[:-1], 6)


def test_flat_ivon_opt_checkpoint_loads_and_continues_the_trajectory():
    """A checkpoint of ivon-opt's layout (what VariationalIVON wrote before it had its own engine) still loads."""
    torch.manual_seed(0)
    model = MLP()
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    ref, ref_model, ref_opt = _run(lambda g, **k: SeededIVON(g, seed=2, **k), model, 4, 1, **IVON_KW)
    old = ref_opt.state_dict()
    old["state"]["current_step"] = ref_opt.current_step  # the earlier VariationalIVON stored its step there
    ours_model = copy.deepcopy(ref_model)
    ours = VariationalIVON(_groups(ours_model, IVON_KW["weight_decay"]), sample_seed=2, **kw)
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
    assert all(torch.equal(saved["param_groups"][i][k], old["param_groups"][i][k]) for i in (0, 1)
               for k in ("hess", "momentum"))

    other = VariationalIVON(torch.nn.Linear(3, 3).parameters(), **kw)
    with pytest.raises(ValueError, match="param groups"):
        other.load_state_dict(old)
    other = VariationalIVON([{"params": torch.nn.Linear(3, 3).parameters()},
                             {"params": [torch.nn.Parameter(torch.ones(2))]}], **kw)
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
    with pytest.raises(ValueError, match="compiled=True.*foreach=False"):  # as torch.optim's fused and foreach
        VariationalIVON(p, lr=0.1, ess=10, compiled=True, foreach=False)


@pytest.mark.slow
def test_ddp_sync_matches_ivon_opt(tmp_path):
    """2 processes (gloo): the engine's all-reduce of ḡ and the Hessian estimate gives ivon-opt(sync=True)'s run."""
    run_script(WORKERS / "engine_ddp_worker.py", str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for key in ("ours", "ref", "compiled_1", "ref_1"):
        assert all(torch.equal(a, b) for a, b in zip(r0[key][-1], r1[key][-1])), key  # replicas identical
    _assert_same_trajectory(r0["ours"], r0["ref"])
    _assert_same_trajectory(r0["compiled_1"], r0["ref_1"])
    # the sync changes the result: rank 0 alone (its own samples only) would end elsewhere
    assert (r0["alone"][-1][0] - r0["ours"][-1][0]).abs().max() > 1e-3


@pytest.mark.slow
def test_fsdp2_shards_match_one_process_and_resume_from_dcp(tmp_path):
    """FSDP2 (fully_shard, 2 processes, gloo): the engine samples and updates each rank's shard; given noise whose
    shards form the whole draw of one process, the run equals that process on the same global batches; a
    torch.distributed.checkpoint restore continues it exactly. Without given noise, the shards' own draws form one
    sample: all ranks train the same gathered weights."""
    run_script(WORKERS / "engine_fsdp_worker.py", str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(r0["trajectory"][-1], r1["trajectory"][-1]))
    assert all(torch.equal(a, b) for a, b in zip(r0["own_noise"], r1["own_noise"]))
    assert (r0["own_noise"][0] - r0["trajectory"][-1][0]).abs().max() > 1e-3  # other noise: another run
    # ivon-opt in one process, whole global batches of 32, on the noise the shards were given
    torch.manual_seed(0)
    model = MLP()
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    opt = SeededIVON(_groups(model, IVON_KW["weight_decay"]), seed=4, noise=indexed_noise, **kw)
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

    run_script(WORKERS / "posterior_fsdp_worker.py", str(tmp_path))
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


@pytest.mark.slow
def test_fsdp2_trains_hf_vit_and_bert_sharded_beforehand(tmp_path):
    """HF's ViT and BERT (tiny), sharded with `fully_shard` as a user may shard them beforehand (accelerate's
    own FSDP2 preparation shards their embeddings twice), 2 processes over gloo, trained as VariationalTrainer does:
    the same weights and Hessian as one process on the whole batches, the same gathered posterior file, and an exact
    resume from torch.distributed.checkpoint. accelerate's wrap policy, which fails on the sharded classes (renamed by
    `fully_shard`), is turned off for them as VariationalTrainer does."""
    from safetensors.torch import load_file

    run_script(WORKERS / "hf_fsdp_worker.py", str(tmp_path), timeout=600)
    r0, r1 = (torch.load(tmp_path / f"hf_rank{r}.pt", weights_only=True) for r in range(2))
    for kind in ("vit", "bert"):
        sharded, plain, resumed = r0[kind]["sharded"], r0[kind]["plain"], r0[kind]["resumed"]
        assert r0[kind]["wraps_nothing"]
        torch.testing.assert_close(sharded["weights"], plain["weights"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sharded["hessian"], plain["hessian"], atol=1e-5, rtol=1e-5)
        assert (plain["hessian"] - 0.3).abs().max() > 1e-2  # the Hessian moved: its update is compared
        assert torch.equal(r1[kind]["sharded"]["weights"], sharded["weights"])
        assert resumed["step"] == sharded["step"] == 6
        assert (torch.equal(resumed["weights"], sharded["weights"])
                and torch.equal(resumed["hessian"], sharded["hessian"]))
        files = {name: load_file(tmp_path / kind / f"{name}.safetensors") for name in ("sharded", "plain")}
        assert files["sharded"].keys() == files["plain"].keys() and files["plain"]
        for key, std in files["plain"].items():
            torch.testing.assert_close(files["sharded"][key], std, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_forked_children_can_still_train_after_the_kernels_compiled(tmp_path):
    """torch.compile's tracing, before a process's first backward, would leave autograd unusable in forked children
    (kill -9 tests, multiprocessing with fork): in a fresh process, train with the compiled kernels, fork, and train
    in the child."""
    script = tmp_path / "fork_after_compile.py"
    script.write_text(
        "import multiprocessing, torch\n"
        "from varsmooth import VariationalIVON\n"
        "def train():\n"
        "    torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()\n"
        "if __name__ == '__main__':\n"
        "    model = torch.nn.Linear(4, 4)\n"
        "    opt = VariationalIVON(model.parameters(), lr=0.1, ess=10.0, compiled=True)\n"
        "    with opt.sampled_params(train=True):\n"
        "        model(torch.randn(2, 4)).sum().backward()\n"
        "    opt.step()\n"
        "    child = multiprocessing.get_context('fork').Process(target=train)\n"
        "    child.start()\n"
        "    child.join(60)\n"
        "    raise SystemExit(child.exitcode)\n")
    skip_without_compiler()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
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
        "messages = [str(w.message) for w in caught if 'kernels do not compile' in str(w.message)]\n"
        "assert len(messages) == 1 and 'C++ compiler' in messages[0], messages\n"
        "assert not opt._dispatch.compiles and torch.isfinite(model.weight).all()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CXX": str(tmp_path / "no-such-compiler"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
