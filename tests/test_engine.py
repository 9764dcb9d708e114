"""varsmooth's IVON engine against ivon-opt, the reference: same trajectory on the same noise, checkpoints, DDP."""

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ivon
from helpers import SeededIVON
from varsmooth.posterior import VariationalIVON

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


@pytest.mark.parametrize("case", [
    dict(),
    dict(samples_per_step=3),  # gradient accumulation / MC samples averaged before the step
    dict(clip_radius=0.02, clip_norm=1.0),
    dict(rescale_lr=False, lr=0.02),
    dict(weight_decay=0.0, samples_per_step=2),
    dict(closure_mc=1, mc_samples=2),  # step(closure) runs the closure mc_samples times
    dict(debias=False),
], ids=["base", "accumulate3", "clip", "no_rescale", "no_decay", "closure_mc2", "no_debias"])
def test_same_trajectory_as_ivon_opt(case):
    torch.manual_seed(0)
    model = MLP()
    kw = {**IVON_KW, **case}
    run_kw = dict(samples_per_step=kw.pop("samples_per_step", 1), clip_norm=kw.pop("clip_norm", 0.0),
                  closure_mc=kw.pop("closure_mc", 0))
    ours, _, opt = _run(lambda g, **k: VariationalIVON(g, noise_seed=3, **k), model, STEPS, **run_kw, **kw)
    ref, _, _ = _run(lambda g, **k: SeededIVON(g, seed=3, **k), model, STEPS, **run_kw, **kw)
    _assert_same_trajectory(ours, ref)
    assert opt.current_step == STEPS
    assert (ours[-1][1] - 0.3).abs().max() > 1e-2  # the Hessian moved: the comparison covers its update
    if "clip_radius" in case:  # clipping was active: without it the weights end elsewhere
        unclipped, _, _ = _run(lambda g, **k: VariationalIVON(g, noise_seed=3, **k), model, STEPS, **run_kw,
                               **{**kw, "clip_radius": float("inf")})
        assert (unclipped[-1][0] - ours[-1][0]).abs().max() > 1e-3


@pytest.mark.parametrize("case", [dict(), dict(samples_per_step=3), dict(clip_radius=0.02, clip_norm=1.0)],
                         ids=["base", "accumulate3", "clip"])
def test_accelerator_code_path_same_trajectory_as_ivon_opt(case, monkeypatch):
    """The foreach formulation used on GPUs (no `out=` ops, 1/sqrt(h + δ) while sampling), run on the CPU."""
    import varsmooth.posterior.optimizer as engine

    monkeypatch.setattr(engine, "_per_tensor", lambda t: False)
    torch.manual_seed(0)
    model = MLP()
    kw = {**IVON_KW, **case}
    run_kw = dict(samples_per_step=kw.pop("samples_per_step", 1), clip_norm=kw.pop("clip_norm", 0.0))
    ours, _, _ = _run(lambda g, **k: VariationalIVON(g, noise_seed=3, **k), model, STEPS, **run_kw, **kw)
    ref, _, _ = _run(lambda g, **k: SeededIVON(g, seed=3, **k), model, STEPS, **run_kw, **kw)
    _assert_same_trajectory(ours, ref)


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

    monkeypatch.setattr(engine, "_per_tensor", lambda t: False)
    monkeypatch.setattr(engine, "CHUNK_NUMEL", 40)  # several chunks even for this small model
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(model.parameters(), noise_seed=0, **IVON_KW)
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
    kept = VariationalIVON(copy.deepcopy(model).parameters(), noise_seed=0, **IVON_KW)
    monkeypatch.setattr(engine, "_per_tensor", lambda t: True)
    with kept.sampled_params():
        assert _held_buffers(kept) == 2.0  # the CPU keeps e beside the mean


def test_noise_drawn_again_equals_the_kept_noise_for_channels_last_weights(monkeypatch):
    """The accelerator path draws e twice (into the parameter, then into a buffer laid out like it): a channels-last
    weight gets the same noise in its logical order as the CPU path's contiguous noise buffer."""
    import varsmooth.posterior.optimizer as engine

    def trajectory(per_tensor):
        monkeypatch.setattr(engine, "_per_tensor", lambda t: per_tensor)
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        assert not conv.weight.is_contiguous()
        opt = VariationalIVON(conv.parameters(), noise_seed=2, **IVON_KW)
        x = torch.randn(6, 2, 3, 5, 5, generator=torch.Generator().manual_seed(1))
        for batch in x:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                conv(batch).square().mean().backward()
            opt.step()
        return [conv.weight.detach().clone(), opt.state[conv.weight]["hess"].clone()]

    for a, b in zip(trajectory(True), trajectory(False)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_mixed_dtypes_one_step_matches_ivon_opt_formulas():
    """Parameters of two dtypes in one optimizer (ivon-opt refuses): each is updated by ivon-opt's own formulas."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    kw = dict(lr=0.1, ess=50.0, hess_init=0.4, beta1=0.9, beta2=0.9, weight_decay=1e-2, clip_radius=0.5)
    opt = VariationalIVON([a, b], noise_seed=1, **kw)
    means = [a.detach().clone(), b.detach().clone()]
    with opt.sampled_params(train=True):
        noise = [a.detach() - means[0], b.detach() - means[1]]
        ((a.sum(0) * b.float()).square().sum() + b.pow(3).sum()).backward()
        grads = [a.grad.clone(), b.grad.clone()]
    assert torch.equal(a.detach(), means[0]) and torch.equal(b.detach(), means[1])
    opt.step()
    for p, m0, n, g in zip((a, b), means, noise, grads):
        h0 = torch.full_like(p, 0.4)
        mom = ivon.IVON._new_momentum(g, torch.zeros_like(p), 0.9)
        hess = ivon.IVON._new_hess("price", h0, n * g, None, slice(None), 50.0, 0.9, 1e-2)
        expected = ivon.IVON._new_param_averages(m0, hess, mom, 0.1 * (0.4 + 1e-2), 1e-2, 0.5, 1 - 0.9, 0.4)
        assert opt.state[p]["hess"].dtype == p.dtype and opt.state[p]["momentum"].dtype == p.dtype
        tol = 1e-5 if p.dtype == torch.float32 else 1e-12
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


def test_crash_inside_sampling_restores_means_and_records_nothing():
    torch.manual_seed(0)
    model = MLP()
    opt = VariationalIVON(model.parameters(), noise_seed=0, **IVON_KW)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ZeroDivisionError):
        with opt.sampled_params(train=True):
            F.cross_entropy(model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
            1 / 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="without any gradient sample"):
        opt.step()


def test_resume_from_per_parameter_checkpoint_is_exact():
    torch.manual_seed(0)
    model = MLP()
    make = lambda g, **k: VariationalIVON(g, noise_seed=5, **k)  # noqa: E731
    full, _, _ = _run(make, model, 12, 2, **IVON_KW)
    _, half_model, half_opt = _run(make, model, 6, 2, **IVON_KW)
    sd = half_opt.state_dict()
    assert set(sd["state"][0]) == {"momentum", "hess"} and sd["param_groups"][1]["current_step"] == 6
    resumed_model = copy.deepcopy(half_model)
    resumed = make(_groups(resumed_model, IVON_KW["weight_decay"]), **{k: v for k, v in IVON_KW.items() if k != "weight_decay"})
    resumed.load_state_dict(copy.deepcopy(sd))
    x, y = _data(24)
    for step in range(6, 12):
        for k in range(2):
            with resumed.sampled_params(train=True):
                resumed.zero_grad()
                F.cross_entropy(resumed_model(x[2 * step + k]), y[2 * step + k]).backward()
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
    for key in ("ours", "ref"):
        assert all(torch.equal(a, b) for a, b in zip(r0[key][-1], r1[key][-1])), key  # replicas identical
    _assert_same_trajectory(r0["ours"], r0["ref"])
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
    # one process, whole global batches of 32, rank 0's noise
    torch.manual_seed(0)
    model = MLP()
    kw = {k: v for k, v in IVON_KW.items() if k != "weight_decay"}
    opt = VariationalIVON(_groups(model, IVON_KW["weight_decay"]), noise_seed=4, **kw)
    x, y = _data(2 * FSDP_STEPS, batch=32)
    for step in range(FSDP_STEPS):
        for k in range(2):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(x[2 * step + k]), y[2 * step + k]).backward()
        opt.step()
        params, hess = r0["trajectory"][step]
        torch.testing.assert_close(params, _flat(model.parameters()), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hess, opt.hessian(), atol=1e-5, rtol=1e-5)
    assert (opt.hessian() - IVON_KW["hess_init"]).abs().max() > 1e-2
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
