"""What IVON costs inside the Trainer (issue 7.3), in one run; ratios are the result, not absolute times.

1. Time per optimizer step, configurations interleaved (random order per round, median step gap per block):
   ERM with AdamW, IVON with 1 and 2 MC samples, SAM (ρ 0.05) around the same AdamW — all VariationalTrainer.
2. Evaluation: `trainer.evaluate()` with S posterior samples (BMA) against S × one evaluation at the posterior mean.
3. Label-noise export (`varsmooth.label_noise.compute_label_noise`, S draws) against (S + 1) forward sweeps.
4. Memory: optimizer state (exact tensor bytes) and the peak growth of a fresh process's resident memory (RSS)
   while it trains, sampled every 0.5 ms from /proc/self/statm (process level: includes the allocator's caching and
   the Trainer's own buffers; on CUDA `torch.cuda.max_memory_allocated` would be the right measure — no GPU here).

Data: MNIST 9k subset, small CNN, batch 64 (random inputs of the same shape if MNIST is absent).

    OMP_NUM_THREADS=1 python benchmarks/cost.py                 # ~6-8 min on one core
    OMP_NUM_THREADS=1 python benchmarks/cost.py --rounds 2 --steps 20 --eval-size 1000   # smoke
    python benchmarks/cost.py --report                          # rewrite the .md files, the `cost` table of
                                                                # benchmarks/studies/cost.md and cost.png
                                                                # from the committed .json
    OMP_NUM_THREADS=1 python benchmarks/cost.py --engine      # IVON engine vs AdamW (engine.md), ~17 min
    python benchmarks/cost.py --gpu --rounds 3 --steps 20 --skip 5     # on a GPU: bf16 ViT-small and ViT-base,
                                                                       # vs AdamW(fused)

Every ratio is shown as its median over rounds with the min-max over rounds beside it; a ratio whose spread
(max - min) / median exceeds `UNSTABLE_SPREAD` is marked "not stable": other jobs on the machine moved it more than
the difference it measures, so it should not be read (rerun on a quiet machine).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import logging  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import common  # noqa: E402

logging.getLogger("varsmooth").setLevel(logging.ERROR)  # blocks of 50 steps: the Hessian-stuck warning is expected

from trainer_overhead import StepClock, block_time, load_xy  # noqa: E402

OUT_DIR = common.RESULTS_DIR / "cost"
#: (max - min) / median over rounds above which a ratio is reported as not stable enough to read
UNSTABLE_SPREAD = 0.5
STEP_CONFIGS = {
    "erm_adamw": dict(method="erm", optim="adamw_torch", learning_rate=1e-3, weight_decay=0.0),
    "ivon_mc1": dict(method="ivon", mc_samples=1),
    "ivon_mc2": dict(method="ivon", mc_samples=2),
    "sam_adamw": dict(method="sam", sam_rho=0.05, optim="adamw_torch", learning_rate=1e-3, weight_decay=0.0),
}


def make_trainer(cfg: dict, model, ds, steps: int, tmp: str, seed: int = 0, callbacks=None):
    from varsmooth import VariationalTrainer

    args = common.training_arguments(
        output_dir=tmp, max_steps=steps, per_device_train_batch_size=64, per_device_eval_batch_size=1000,
        use_cpu=True, report_to=[], save_strategy="no", eval_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=seed, lr_scheduler_type="cosine", max_grad_norm=0.0,
        **cfg)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=ds, callbacks=callbacks or [])
    trainer.remove_callback(PrinterCallback)
    return trainer


def state_bytes(opt) -> int:
    seen, total = set(), 0

    def visit(o):
        nonlocal total
        if torch.is_tensor(o):
            if o.data_ptr() not in seen:
                seen.add(o.data_ptr())
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)

    inner = getattr(opt, "optimizer", opt)
    visit(inner.state)
    visit(getattr(inner, "_buffers", {}))  # VariationalIVON's reused scratch: mean, noise, averages, sqrt(h + δ)
    for g in inner.param_groups:  # ivon-opt keeps hess/momentum/param averages in the param groups
        visit({k: v for k, v in g.items() if k != "params"})
    return total


def step_timing(x, y, rounds: int, steps: int, skip: int) -> tuple[dict, dict, list]:
    ds = common.ArrayDataset(x.numpy(), y.numpy())
    models = {}
    for k in STEP_CONFIGS:
        torch.manual_seed(0)
        models[k] = common.SmallCNN((1, 28, 28), 10)
    per_round = []
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = list(STEP_CONFIGS)
            rng.shuffle(order)
            times = {}
            for k in order:
                clock = StepClock()
                make_trainer(STEP_CONFIGS[k], models[k], ds, steps, tmp, seed=r, callbacks=[clock]).train()
                times[k] = block_time(clock.ends, skip)
            per_round.append(times)
            print(f"round {r}: " + "  ".join(f"{k} {1e3 * v:.1f}ms" for k, v in times.items()), flush=True)
    summary = {k: 1e3 * statistics.median([t[k] for t in per_round]) for k in STEP_CONFIGS}
    ratios = {f"{k} / erm_adamw": spread([t[k] / t["erm_adamw"] for t in per_round]) for k in STEP_CONFIGS}
    return summary, ratios, per_round


def spread(values: list[float]) -> dict[str, float]:
    """Median and min-max of per-round ratios."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_ratio(r: dict[str, float], digits: int = 2) -> str:
    """`median [min–max]`, flagged when the spread over rounds is too wide to read the median."""
    text = f"{r['median']:.{digits}f} [{r['min']:.{digits}f}–{r['max']:.{digits}f}]"
    return text + " (not stable)" if unstable(r) else text


def unstable(r: dict[str, float]) -> bool:
    return (r["max"] - r["min"]) / r["median"] > UNSTABLE_SPREAD


def eval_timing(x_test, y_test, rounds: int, samples: list[int], eval_size: int) -> dict:
    """trainer.evaluate() on `eval_size` test images with S samples vs at the mean (S = 0)."""
    ds_train = common.ArrayDataset(x_test[:640].numpy(), y_test[:640].numpy())
    ds_eval = common.ArrayDataset(x_test[:eval_size].numpy(), y_test[:eval_size].numpy())
    torch.manual_seed(0)
    model = common.SmallCNN((1, 28, 28), 10)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(STEP_CONFIGS["ivon_mc1"], model, ds_train, 10, tmp)
        trainer.train()
        times: dict[int, list[float]] = {s: [] for s in [0, *samples]}
        for r in range(rounds):
            order = list(times)
            random.Random(r).shuffle(order)
            for s in order:
                trainer.args.eval_mc_samples = s
                t0 = time.perf_counter()
                trainer.evaluate(ds_eval)
                times[s].append(time.perf_counter() - t0)
        # label-noise export vs (S + 1) forward sweeps
        export = label_noise_timing(trainer, x_test[:eval_size], y_test[:eval_size], rounds, samples)
    t0 = statistics.median(times[0])
    out = {"eval_size": eval_size, "mean_eval_s": t0, "per_round_mean_eval_s": times[0], "per_S": {}}
    for s in samples:
        ts = statistics.median(times[s])
        # per round: the S-sample evaluation against that round's evaluation at the mean
        out["per_S"][s] = {"bma_eval_s": ts, "per_round_s": times[s], "ratio_vs_S_mean_evals": ts / (s * t0),
                           "ratio_vs_S_plus_1_mean_evals": ts / ((s + 1) * t0),
                           "ratio_vs_S_plus_1_per_round": spread([a / ((s + 1) * b)
                                                                  for a, b in zip(times[s], times[0])])}
    out["label_noise_export"] = export
    return out


def label_noise_timing(trainer, x, y, rounds: int, samples: list[int]) -> dict:
    import datasets

    from varsmooth.label_noise.compute import compute_label_noise

    feats = datasets.Features({"pixel_values": datasets.Array3D(tuple(x.shape[1:]), "float32"),
                               "label": datasets.ClassLabel(num_classes=10)})
    ds = datasets.Dataset.from_dict({"pixel_values": x.numpy(), "label": y.numpy()},
                                    features=feats).with_format("torch")
    model = trainer.model
    posterior = trainer.posterior()

    @torch.no_grad()
    def sweep():
        model.eval()
        for i in range(0, len(x), 256):
            model(pixel_values=x[i:i + 256])

    out = {}
    for s in samples:
        t_export, t_sweep = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            compute_label_noise(model, posterior, ds, num_samples=s, batch_size=256)
            t_export.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sweep()
            t_sweep.append(time.perf_counter() - t0)
        te, tw = statistics.median(t_export), statistics.median(t_sweep)
        out[s] = {"export_s": te, "one_sweep_s": tw, "ratio_vs_S_plus_1_sweeps": te / ((s + 1) * tw),
                  "per_round_export_s": t_export, "per_round_sweep_s": t_sweep,
                  "ratio_vs_S_plus_1_per_round": spread([a / ((s + 1) * b) for a, b in zip(t_export, t_sweep)])}
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _compile_rss_bytes(model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor]) -> int:
    """Compiles IVON's kernels (`varsmooth.posterior.kernels`, once per process and bucket layout) on a copy of
    `model`, one group, and returns the resident memory that stays, so that a measurement after it leaves that
    one-time cost out."""
    from varsmooth import VariationalIVON

    before = _rss_bytes()
    model = copy.deepcopy(model)
    opt = VariationalIVON(list(model.parameters()), sample_seed=0, compiled=True, **ENGINE_IVON_KW)
    with opt.sampled_params(train=True):
        loss(model).backward()
    opt.step()
    del model, opt
    gc.collect()
    return _rss_bytes() - before


def _return_freed_pages() -> None:
    """glibc's `malloc_trim(0)`: freed heap pages back to the system, so that a warm-up's (a compile's, a first
    backward's) do not count as resident memory the measured body can reuse for free. Nothing elsewhere."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Sample this process's resident memory every 0.5 ms while the body runs; yields a one-element list that holds
    the peak growth in bytes over the resident memory at entry once the body has finished."""
    gc.collect()
    _return_freed_pages()
    before = _rss_bytes()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0005)

    growth = [0]
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield growth
    finally:
        done.set()
        thread.join()
        growth[0] = peak[0] - before


def memory_child(cfg_name: str, steps: int) -> None:
    """Runs in a fresh process: peak growth of the resident memory while training `steps` steps (sampled every
    0.5 ms by a thread, so transient peaks inside a step are seen), and the optimizer state bytes."""
    x, y, _ = load_xy()
    torch.manual_seed(0)
    model = common.SmallCNN((1, 28, 28), 10)
    ds = common.ArrayDataset(x.numpy(), y.numpy())
    # torch.compile's footprint (once per process) kept apart from the measured window
    xb, yb = x[:64], y[:64]
    compile_kib = (_compile_rss_bytes(model, lambda m: torch.nn.functional.cross_entropy(m(xb).logits, yb)) / 1024
                   if STEP_CONFIGS[cfg_name]["method"] == "ivon" else None)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(STEP_CONFIGS[cfg_name], model, ds, steps, tmp)
        before = _rss_bytes()
        with peak_rss_growth() as growth:
            trainer.train()
        opt = trainer.optimizer
        n_params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"config": cfg_name, "peak_rss_growth_kib": growth[0] / 1024,
                          "rss_before_kib": before / 1024, "optimizer_state_bytes": state_bytes(opt),
                          "param_bytes": 4 * n_params, "compile_rss_kib": compile_kib}))


def memory(steps: int) -> dict:
    out = {}
    for name in STEP_CONFIGS:
        proc = subprocess.run([sys.executable, __file__, "--_memory-child", name, "--steps", str(steps)],
                              capture_output=True, text=True, check=True)
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# -- the IVON engine against AdamW on larger models (`--engine`, issue 20) ------------------------------------------
ENGINE_MODELS = ("mlp_8.4M", "vit_small")
ENGINE_BATCH = {"mlp_8.4M": 128, "vit_small": 32}
ENGINE_IVON_KW = dict(lr=0.1, ess=1e4, hess_init=0.5, beta1=0.9, beta2=0.99999, weight_decay=1e-4)
#: IVON's memory rows: the CPU default (e kept, the next one drawn ahead where a core is spare), e drawn in turn, the
#: accelerators' path (e drawn in the kernels, again for e⊙g)
ENGINE_MEMORY_KINDS = ("ivon_engine", "ivon_engine_in_turn", "ivon_engine_redraw")


class _MLP(torch.nn.Module):
    """8 × Linear(1024, 1024) with ReLUs: 8.4 M parameters, 1024 classes."""

    def __init__(self) -> None:
        super().__init__()
        layers = [m for _ in range(7) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 1024))

    def forward(self, pixel_values, labels=None):  # noqa: ANN001
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.net(pixel_values))


def engine_model(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A model and one fixed batch: the 8.4 M MLP, or ViT-small's shape (hidden 384, 12 layers, 6 heads, MLP 1536)
    on 32×32 images in 8×8 patches (16 tokens, so that a step fits a shared core; the optimizer cost is that of
    ViT-small's 21 M weights regardless of the image size)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = ENGINE_BATCH[name]
    if name == "mlp_8.4M":
        return _MLP(), torch.randn(batch, 1024, generator=g), torch.randint(0, 1024, (batch,), generator=g)
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                       image_size=32, patch_size=8, num_labels=10)
    return (ViTForImageClassification(config), torch.randn(batch, 3, 32, 32, generator=g),
            torch.randint(0, 10, (batch,), generator=g))


def _engine_optimizer(kind: str, params: list) -> torch.optim.Optimizer:
    import ivon

    from varsmooth import VariationalIVON

    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind.startswith("ivon_engine"):  # the compiled kernels (e drawn ahead or in turn), or the foreach fallback
        return VariationalIVON(params, sample_seed=0, compiled=kind != "ivon_engine_foreach",
                               prefetch=False if kind == "ivon_engine_in_turn" else None, **ENGINE_IVON_KW)
    return ivon.IVON(params, **ENGINE_IVON_KW)  # ivon-opt 0.1.3, the engine's predecessor and reference


def _optimizer_step_s(kind: str, opt, reps: int) -> float:
    """Median time of one optimizer step (IVON: one sample with its restore, and the step) on fixed gradients."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if kind != "adamw_foreach":
            with opt.sampled_params(train=True):
                pass
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_timing(rounds: int, steps: int, skip: int, reps: int) -> dict:
    """Per model, interleaved rounds (random order per round) of (1) the optimizer alone and (2) whole training steps
    in VariationalTrainer: IVON (the engine) vs AdamW(foreach=True) given to the same trainer."""
    from varsmooth import VariationalTrainer, VariationalTrainingArguments

    rng = random.Random(0)
    out = {}
    for name in ENGINE_MODELS:
        model, x, y = engine_model(name)
        ds = common.ArrayDataset(x.repeat(4, *[1] * (x.dim() - 1)).numpy(), y.repeat(4).numpy())
        opt_models = {k: copy.deepcopy(model)
                      for k in ("adamw_foreach", "ivon_engine", "ivon_engine_foreach", "ivon_opt")}
        opts = {}
        for k, m in opt_models.items():
            for p in m.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            opts[k] = _engine_optimizer(k, list(m.parameters()))
            _optimizer_step_s(k, opts[k], 1)  # warm-up: state and buffers allocated
        per_round = []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                jobs = ["opt:adamw_foreach", "opt:ivon_engine", "opt:ivon_engine_foreach", "opt:ivon_opt", "train:ivon",
                        "train:ivon_in_turn", "train:ivon_foreach", "train:adamw_foreach"]
                rng.shuffle(jobs)
                times = {}
                for job in jobs:
                    what, kind = job.split(":")
                    if what == "opt":
                        times[job] = _optimizer_step_s(kind, opts[kind], reps if kind != "ivon_opt" else 2)
                        continue
                    m = copy.deepcopy(model)
                    cfg = (dict(method="ivon", method_config={"ess": 1e4, "ivon_compiled": kind != "ivon_foreach"})
                           if kind.startswith("ivon") else dict(method="erm"))
                    args = VariationalTrainingArguments(
                        output_dir=tmp, max_steps=steps, per_device_train_batch_size=ENGINE_BATCH[name], use_cpu=True,
                        report_to=[], save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
                        dataloader_num_workers=0, seed=r, max_grad_norm=0.0, **cfg)
                    optimizers = ((None, None) if kind.startswith("ivon")
                                  else (torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True), None))
                    clock = StepClock()
                    trainer = VariationalTrainer(model=m, args=args, train_dataset=ds, callbacks=[clock],
                                                 optimizers=optimizers)
                    trainer.remove_callback(PrinterCallback)
                    # e drawn in turn: as where no core is spare (the trainer builds its IVON at its default)
                    with (mock.patch("varsmooth.posterior.optimizer._spare_core", return_value=False)
                          if kind == "ivon_in_turn" else contextlib.nullcontext()):
                        trainer.train()
                    times[job] = block_time(clock.ends, skip)
                per_round.append(times)
                print(f"{name} round {r}: " + "  ".join(f"{k} {1e3 * v:.0f}ms" for k, v in sorted(times.items())),
                      flush=True)
        ratios = {}
        for num, den in (("opt:ivon_engine", "opt:adamw_foreach"), ("opt:ivon_engine_foreach", "opt:adamw_foreach"),
                         ("opt:ivon_opt", "opt:adamw_foreach"), ("train:ivon", "train:adamw_foreach"),
                         ("train:ivon_in_turn", "train:adamw_foreach"), ("train:ivon_foreach", "train:adamw_foreach")):
            v = [t[num] / t[den] for t in per_round]
            ratios[f"{num} / {den}"] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        out[name] = {"parameters": sum(p.numel() for p in model.parameters()), "batch_size": ENGINE_BATCH[name],
                     "ms_median": {k: 1e3 * statistics.median([t[k] for t in per_round]) for k in per_round[0]},
                     "ratios": ratios, "per_round_s": per_round}
    return out


def engine_memory_child(name: str, kind: str, steps: int) -> None:
    """Fresh process: peak resident-memory growth of `steps` hand-written training steps (sampled every 0.5 ms),
    from the model and its batch alone, so it holds gradients, activations, optimizer state and its temporaries. Every
    kind runs one forward and backward on a copy first (IVON's: the compile of its kernels, whose footprint, once per
    process, is reported on its own), whose freed pages are returned before measuring."""
    if kind == "ivon_engine_redraw":  # the accelerators' path (e drawn in the kernels, again for e⊙g), on the CPU
        from varsmooth import VariationalIVON

        VariationalIVON._keeps_noise = lambda self, t: not self._dispatch.compiles
        kind = "ivon_engine"
    model, x, y = engine_model(name)
    params = list(model.parameters())
    loss_fn = torch.nn.functional.cross_entropy
    loss = lambda m: loss_fn(m(pixel_values=x).logits, y)  # noqa: E731
    compile_rss = _compile_rss_bytes(model, loss) if kind.startswith("ivon_engine") else None
    if compile_rss is None:
        warm = copy.deepcopy(model)
        loss(warm).backward()
        del warm
    with peak_rss_growth() as growth:
        opt = _engine_optimizer(kind, params)
        for _ in range(steps):
            if kind == "adamw_foreach":
                opt.zero_grad(set_to_none=True)
                loss(model).backward()
            else:
                with opt.sampled_params(train=True):
                    opt.zero_grad(set_to_none=True)
                    loss(model).backward()
            opt.step()
    print(json.dumps({"peak_rss_growth_bytes": growth[0], "compile_rss_bytes": compile_rss,
                      "param_bytes": sum(p.numel() * p.element_size() for p in params)}))


def engine_memory(steps: int, repeats: int = 3) -> dict:
    """Each configuration in `repeats` fresh processes, interleaved; the median growth (RSS sampling is noisy)."""
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for name in ENGINE_MODELS:
            for kind in ("adamw_foreach",) + ENGINE_MEMORY_KINDS:
                proc = subprocess.run([sys.executable, __file__, "--_engine-memory-child", f"{name}:{kind}", "--steps",
                                       str(steps)], capture_output=True, text=True, check=True)
                runs.setdefault(f"{name}:{kind}", []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = {}
    for key, rs in runs.items():
        compiled = [r["compile_rss_bytes"] for r in rs if r["compile_rss_bytes"] is not None]
        out[key] = {"peak_rss_growth_bytes": statistics.median(r["peak_rss_growth_bytes"] for r in rs),
                    "runs_bytes": [r["peak_rss_growth_bytes"] for r in rs], "param_bytes": rs[0]["param_bytes"],
                    "compile_rss_bytes": statistics.median(compiled) if compiled else None}
    return out


def engine_report(rounds: int, steps: int, skip: int) -> dict:
    """`--engine`: benchmarks/results/cost/engine.{json,md}."""
    import platform

    load = os.getloadavg()[0]
    timing = engine_timing(rounds, steps, skip, reps=5)
    mem = engine_memory(3)
    result = {"device": "cpu", "threads": 1, "cpu": platform.processor() or platform.machine(), "rounds": rounds,
              "trainer_steps_per_block": steps, "models": timing, "memory": mem, "ivon_settings": ENGINE_IVON_KW,
              "versions": common._versions(), "commit": common.code_commit(),
              "note": f"{os.cpu_count()}-core machine, load average {load:.1f} at the start: rounds interleaved in "
                      "random order; ratios within a round are the result."}
    common.write_json(OUT_DIR / "engine.json", result)
    L = ["# IVON engine vs AdamW (CPU, torch on one thread)", "",
         f"{rounds} interleaved rounds; ratios median [min–max] over rounds. Optimizer alone: 5 steps per round on "
         "fixed gradients (IVON: one sample with its restore, then the step; ivon-opt: 2 steps). Whole step: "
         f"VariationalTrainer, median step time of {steps} steps after {skip}, IVON vs AdamW(foreach=True) passed to "
         "the same trainer. IVON engine: the default, torch.compile'd kernels per (device, dtype) bucket with e from "
         "torch's CPU generator, the next sample's e drawn on a spare core during this sample's forward and backward "
         "(`prefetch`, on where torch's threads leave a core idle, as here); in turn: `prefetch=False`, e drawn at "
         "the sample, as where no core is spare; foreach: `compiled=False` (`--ivon_compiled false`), the same "
         "functions run eagerly, what runs without a C++ compiler.", "",
         "| model | parameters | batch | IVON engine ÷ AdamW, optimizer | foreach ÷ AdamW, optimizer | "
         "ivon-opt ÷ AdamW, optimizer | IVON ÷ AdamW, whole training step | e in turn ÷ AdamW, whole training step | "
         "foreach ÷ AdamW, whole training step | AdamW step ms | AdamW training step ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in timing.items():
        r = v["ratios"]
        cell = lambda k: f"**{r[k]['median']:.2f}** [{r[k]['min']:.2f}–{r[k]['max']:.2f}]"  # noqa: B023, E731
        L.append(f"| {name} | {v['parameters'] / 1e6:.1f} M | {v['batch_size']} | "
                 f"{cell('opt:ivon_engine / opt:adamw_foreach')} | "
                 f"{cell('opt:ivon_engine_foreach / opt:adamw_foreach')} | "
                 f"{cell('opt:ivon_opt / opt:adamw_foreach')} | "
                 f"{cell('train:ivon / train:adamw_foreach')} | {cell('train:ivon_in_turn / train:adamw_foreach')} | "
                 f"{cell('train:ivon_foreach / train:adamw_foreach')} | "
                 f"{v['ms_median']['opt:adamw_foreach']:.0f} | {v['ms_median']['train:adamw_foreach']:.0f} |")
    L += ["", "Peak memory growth over 3 hand-written steps (process RSS, median of 3 processes), after one forward "
          "and backward on a copy of the model (IVON's: the compile of its kernels) whose freed pages are returned "
          "(`malloc_trim`); IVON − AdamW in parameter sizes.", "",
          "| model | AdamW | IVON engine (CPU default: e kept, the next drawn ahead) | IVON − AdamW | e kept, drawn in "
          "turn | IVON − AdamW | accelerators' path (e drawn in the kernels, again for e⊙g) | IVON − AdamW | "
          "torch.compile of the kernels, once per process (not in the growth) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for name in ENGINE_MODELS:
        a = mem[f"{name}:adamw_foreach"]
        cells = []
        for kind in ENGINE_MEMORY_KINDS:
            i = mem[f"{name}:{kind}"]
            cells += [f"{i['peak_rss_growth_bytes'] / 2**20:.0f} MiB",
                      f"{(i['peak_rss_growth_bytes'] - a['peak_rss_growth_bytes']) / a['param_bytes']:+.1f}"]
        cells.append(f"{mem[f'{name}:ivon_engine']['compile_rss_bytes'] / 2**20:.0f} MiB")
        L.append(f"| {name} | {a['peak_rss_growth_bytes'] / 2**20:.0f} MiB | " + " | ".join(cells) + " |")
    L += ["", result["note"], "", "Rerun: `OMP_NUM_THREADS=1 python benchmarks/cost.py --engine`", ""]
    (OUT_DIR / "engine.md").write_text("\n".join(L))
    print("\n".join(L))
    return result


# -- the same on a GPU (`--gpu`, issue 20): bf16 autocast, IVON vs AdamW(fused) in the same trainer ------------------
class _DeviceStepClock(StepClock):
    """Step ends once the device has finished the step's kernels (the host runs ahead of a GPU otherwise)."""

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        super().on_step_end(args, state, control, **kwargs)


GPU_MODELS = {"vit_small": (384, 6, 1536), "vit_base": (768, 12, 3072)}  # hidden size, heads, MLP size; 12 layers


def gpu_vit(name: str, image_size: int) -> torch.nn.Module:
    """ViT-small (21.7 M weights at 224², 16×16 patches) or ViT-base (85.8 M) from a config."""
    from transformers import ViTConfig, ViTForImageClassification

    hidden, heads, mlp = GPU_MODELS[name]
    config = ViTConfig(hidden_size=hidden, num_hidden_layers=12, num_attention_heads=heads, intermediate_size=mlp,
                       image_size=image_size, patch_size=16, num_labels=100)
    torch.manual_seed(0)
    return ViTForImageClassification(config)


def engine_gpu_report(rounds: int, steps: int, skip: int, batch: int, image_size: int, out_dir: Path,
                      models: list[str]) -> dict:
    """`--gpu`: whole VariationalTrainer steps with bf16 autocast, IVON vs AdamW(fused=True) given to the same trainer,
    in interleaved rounds, for ViT-small and ViT-base; peak device memory of each (torch.cuda.max_memory_allocated).
    Without CUDA it runs the same code on the CPU (for checking the script with tiny sizes; CPU numbers are not the
    result)."""
    import platform

    cuda = torch.cuda.is_available()
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (script check, not a result)",
              "image_size": image_size, "batch_size": batch, "bf16": True, "rounds": rounds, "steps_per_block": steps,
              "skip": skip, "models": {name: _gpu_model_timing(name, rounds, steps, skip, batch, image_size, cuda)
                                       for name in models},
              "versions": common._versions(), "cpu": platform.processor() or platform.machine(),
              "commit": common.code_commit()}
    out_dir.mkdir(parents=True, exist_ok=True)
    common.write_json(out_dir / "engine_gpu.json", result)
    L = [f"# IVON engine vs AdamW(fused) on {result['device']}", "",
         f"{image_size}² images, batch {batch}, bf16 autocast; {rounds} interleaved rounds, median step time of "
         f"{steps} VariationalTrainer steps after {skip}; the engine at commit {result['commit']}.", "",
         "| model | IVON ÷ AdamW(fused), whole training step | IVON step ms | AdamW step ms "
         "| peak memory IVON − AdamW |",
         "|---|---|---|---|---|"]
    for name, v in result["models"].items():
        L.append(f"| {name} ({v['parameters'] / 1e6:.1f} M) | **{fmt_ratio(v['ratio_ivon_over_adamw_fused'])}** | "
                 f"{v['ms_median']['ivon']:.1f} | {v['ms_median']['adamw_fused']:.1f} | "
                 f"{v['peak_memory_ivon_minus_adamw_in_parameter_sizes']:+.2f} parameter sizes |")
    L += ["", "Rerun: `python benchmarks/cost.py --gpu`", ""]
    (out_dir / "engine_gpu.md").write_text("\n".join(L))
    print("\n".join(L))
    return result


def _gpu_model_timing(name: str, rounds: int, steps: int, skip: int, batch: int, image_size: int, cuda: bool) -> dict:
    from varsmooth import VariationalTrainer, VariationalTrainingArguments

    model = gpu_vit(name, image_size)
    g = torch.Generator().manual_seed(0)
    n = batch * 4
    # the images live on the device and the collator hands out whole batches of them: the step is the model and the
    # optimizer alone (from host memory, loading 77 MB of float images per batch took longer than a ViT-small step)
    images = torch.randn(n, 3, image_size, image_size, generator=g).to("cuda" if cuda else "cpu")
    labels = torch.randint(0, 100, (n,), generator=g).to(images.device)
    ds = common.ArrayDataset(torch.arange(n), torch.zeros(n, dtype=torch.long))  # rows are row numbers

    def device_batches(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        index = torch.stack([row["pixel_values"] for row in rows]).to(images.device)
        return {"pixel_values": images[index], "labels": labels[index]}
    rng = random.Random(0)
    per_round, peaks = [], {"ivon": [], "adamw_fused": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = list(peaks)
            rng.shuffle(order)
            times = {}
            for kind in order:
                m = copy.deepcopy(model).to("cuda" if cuda else "cpu")
                cfg = dict(method="ivon", method_config={"ess": 1e4}) if kind == "ivon" else dict(method="erm")
                args = VariationalTrainingArguments(
                    output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch, use_cpu=not cuda, bf16=True,
                    report_to=[], save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
                    dataloader_num_workers=0, dataloader_pin_memory=False, seed=r, max_grad_norm=0.0, **cfg)
                optimizers = ((torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True), None) if kind != "ivon"
                              else (None, None))
                clock = _DeviceStepClock()
                trainer = VariationalTrainer(model=m, args=args, train_dataset=ds, callbacks=[clock],
                                             optimizers=optimizers, data_collator=device_batches)
                trainer.remove_callback(PrinterCallback)
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                trainer.train()
                times[kind] = block_time(clock.ends, skip)
                peaks[kind].append(torch.cuda.max_memory_allocated() if cuda else 0)
                del trainer, m
                gc.collect()
            per_round.append(times)
            print(f"{name} gpu round {r}: " + "  ".join(f"{k} {1e3 * v:.1f}ms" for k, v in sorted(times.items())),
                  flush=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "ms_median": {k: 1e3 * statistics.median([t[k] for t in per_round]) for k in per_round[0]},
            "ratio_ivon_over_adamw_fused": spread([t["ivon"] / t["adamw_fused"] for t in per_round]),
            "per_round_s": per_round, "peak_memory_bytes": {k: max(v) for k, v in peaks.items()},
            "peak_memory_ivon_minus_adamw_in_parameter_sizes":
                (max(peaks["ivon"]) - max(peaks["adamw_fused"])) / param_bytes}


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=2000)
    p.add_argument("--samples", default="8,32")
    p.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", action="store_true",
                   help="IVON engine vs AdamW on an 8.4 M MLP and ViT-small (engine.md)")
    p.add_argument("--_engine-memory-child", dest="engine_memory_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", action="store_true", help="Only rewrite every cost*.md from its cost*.json.")
    p.add_argument("--gpu", action="store_true",
                   help="IVON vs AdamW(fused), bf16, ViT-small and ViT-base on a GPU (engine_gpu.md)")
    p.add_argument("--batch", type=int, default=128, help="--gpu: batch size")
    p.add_argument("--image-size", type=int, default=224, help="--gpu: image size (a multiple of the 16-pixel patch)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="--gpu: folder of engine_gpu.{json,md}")
    p.add_argument("--models", default=",".join(GPU_MODELS), help="--gpu: comma-separated, of " + ", ".join(GPU_MODELS))
    a = p.parse_args(argv)
    if a.gpu:
        return engine_gpu_report(a.rounds, a.steps, a.skip, a.batch, a.image_size, a.out, a.models.split(","))
    if a.report:
        for path in sorted(OUT_DIR.glob("cost*.json")):
            path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
            print(path.with_suffix(".md").read_text())
        common.write_readme_section("cost", summary_table())
        cost_figure(OUT_DIR / "cost.png")
        return None
    torch.set_num_threads(1)
    if a.engine_memory_child:
        engine_memory_child(*a.engine_memory_child.split(":"), a.steps)
        return None
    if a.engine:
        return engine_report(a.rounds, a.steps, a.skip)
    if a.memory_child:
        memory_child(a.memory_child, a.steps)
        return None
    x, y, data_name = load_xy()
    samples = [int(s) for s in a.samples.split(",")]
    step_ms, step_ratios, per_round = step_timing(x, y, a.rounds, a.steps, a.skip)
    try:
        d = common.load_data("mnist")
        x_te, y_te = torch.as_tensor(d.x_test), torch.as_tensor(d.y_test)
    except common.DataUnavailable:
        x_te, y_te = x, y
    ev = eval_timing(x_te, y_te, max(3, a.rounds // 2), samples, a.eval_size)
    mem = memory(a.steps)
    import platform

    result = {"data": data_name, "model": "SmallCNN (~207k parameters)", "batch_size": 64, "device": "cpu",
              "threads": 1, "cpu": platform.processor() or platform.machine(), "rounds": a.rounds,
              "steps_per_block": a.steps, "step_ms_median": step_ms, "step_ratios": step_ratios,
              "per_round_s": per_round, "evaluation": ev, "memory": mem, "versions": common._versions(),
              "commit": common.code_commit(),
              "note": "Shared 2-core machine: ratios within a round are the result; absolute times are not."}
    common.write_json(OUT_DIR / "cost.json", result)
    text = render(result)
    (OUT_DIR / "cost.md").write_text(text)
    print(text)
    return result


def render(result: dict) -> str:
    """cost.md from a cost.json; runs written before the per-round evaluation times were kept show no spread there."""
    step_ms, ev, mem = result["step_ms_median"], result["evaluation"], result["memory"]
    # recomputed from the per-round times, so that old and new results read the same way
    step_ratios = {k: spread([t[k] / t["erm_adamw"] for t in result["per_round_s"]]) for k in step_ms}
    L = ["# What IVON costs (CPU, one thread)", "",
         f"{result['data']}, small CNN, batch 64; {result['rounds']} interleaved rounds × "
         f"{result['steps_per_block']} steps per configuration. Ratios: median over rounds [min–max over rounds]; "
         "\"(not stable)\": (max − min) / median > "
         f"{UNSTABLE_SPREAD}, the load of other jobs moved the ratio more than it can be read to.", "",
         "| per optimizer step | ms (median) | ratio to ERM/AdamW, median [min–max] |", "|---|---|---|"]
    for k in step_ms:
        L.append(f"| {k} | {step_ms[k]:.1f} | {fmt_ratio(step_ratios[k])} |")
    L += ["", f"Evaluation of {ev['eval_size']} images: at the posterior mean {ev['mean_eval_s']:.2f} s.", "",
          "| S posterior samples | BMA evaluate() s | ÷ (S × mean eval) "
          "| ÷ ((S+1) × mean eval), median [min–max] |",
          "|---|---|---|---|"]
    for s, v in ev["per_S"].items():
        per_round = v.get("ratio_vs_S_plus_1_per_round")
        cell = (fmt_ratio(per_round) if per_round
                else f"{v['ratio_vs_S_plus_1_mean_evals']:.2f} (ratio of medians; rounds not recorded)")
        L.append(f"| {s} | {v['bma_eval_s']:.2f} | {v['ratio_vs_S_mean_evals']:.2f} | {cell} |")
    L += ["", "| label-noise export, S draws | export s | one forward sweep s "
              "| ÷ ((S+1) sweeps), median [min–max] |",
          "|---|---|---|---|"]
    for s, v in ev["label_noise_export"].items():
        per_round = v.get("ratio_vs_S_plus_1_per_round")
        cell = (fmt_ratio(per_round) if per_round
                else f"{v['ratio_vs_S_plus_1_sweeps']:.2f} (ratio of medians; rounds not recorded)")
        L.append(f"| {s} | {v['export_s']:.2f} | {v['one_sweep_s']:.3f} | {cell} |")
    # results of an earlier version of this script (they hold `peak_rss_kib`, not `rss_before_kib`) measured the
    # peak without the sampling thread: they keep the header they were written with
    sampled = all("rss_before_kib" in v for v in mem.values())
    rss = ("peak RSS growth while training (process level, sampled)" if sampled
           else "peak-RSS growth over training (process level)")
    # since the compiled engine, IVON's runs compile its kernels before the measured window and report that apart
    compiled = any("compile_rss_kib" in v for v in mem.values())
    extra = " torch.compile of IVON's kernels, once per process (not in the growth) |" if compiled else ""
    L += ["", f"| memory | optimizer state (with IVON's scratch buffers) | ÷ parameter bytes | {rss} |{extra}",
          "|---|---|---|---|" + ("---|" if compiled else "")]
    for k, v in mem.items():
        cell = ""
        if compiled:
            cell = f" {v['compile_rss_kib'] / 1024:.0f} MiB |" if v.get("compile_rss_kib") is not None else " – |"
        L.append(f"| {k} | {v['optimizer_state_bytes'] / 2**20:.2f} MiB | "
                 f"{v['optimizer_state_bytes'] / v['param_bytes']:.1f}× | "
                 f"{v['peak_rss_growth_kib'] / 1024:.1f} MiB |{cell}")
    L += ["", result["note"], "", "Rerun: `OMP_NUM_THREADS=1 python benchmarks/cost.py`", ""]
    return "\n".join(L)


#: the committed runs of the summary: (label, file under OUT_DIR)
SUMMARY_RUNS = (("run 0", "cost.json"), ("run 1", "cost_run1.json"))
#: the whole-step models of `--engine` in the summary: key of engine.json -> label
ENGINE_MODELS = {"mlp_8.4M": "8.4 M MLP", "vit_small": "ViT-small (21.4 M)"}


def _summary_ratios(out_dir: Path) -> tuple[list[tuple[str, list[str | None], list[dict | None]]], list[str]]:
    """The ratios of the summary, by row: (label, a cell per run or None, the ratio per run or None), and the runs."""
    runs = [(label, json.loads((out_dir / name).read_text())) for label, name in SUMMARY_RUNS
            if (out_dir / name).exists()]
    rows: list[tuple[str, list[str | None], list[dict | None]]] = []

    def per_round(result: dict, key: str) -> dict:
        return spread([t[key] / t["erm_adamw"] for t in result["per_round_s"]])

    for key, label in (("ivon_mc1", "IVON (1 MC sample) ÷ ERM with AdamW, per optimizer step"),
                       ("ivon_mc2", "IVON with 2 MC samples ÷ ERM"), ("sam_adamw", "SAM (ρ 0.05, AdamW base) ÷ ERM")):
        ratios = [per_round(r, key) for _, r in runs]
        rows.append((label, [fmt_ratio(x) for x in ratios], ratios))
    for section, label, field in (("per_S", "BMA evaluation with S = {s} draws ÷ (S + 1) evaluations at the mean",
                                   "ratio_vs_S_plus_1_per_round"),
                                  ("label_noise_export", "label-noise export with S = {s} draws ÷ (S + 1) forward "
                                   "sweeps", "ratio_vs_S_plus_1_per_round")):
        s = max(runs[0][1]["evaluation"][section], key=int)
        ratios = [(r["evaluation"][section].get(s) or {}).get(field) for _, r in runs]
        rows.append((label.format(s=s), [fmt_ratio(x) if x else None for x in ratios], ratios))
    for key, label in (("ivon_mc1", "IVON"), ("ivon_mc2", "IVON, 2 MC samples"), ("erm_adamw", "ERM with AdamW")):
        cells = [f"{r['memory'][key]['optimizer_state_bytes'] / r['memory'][key]['param_bytes']:.1f}×"
                 for _, r in runs]
        rows.append((f"optimizer state ÷ parameter bytes, {label}", cells, [None] * len(runs)))
    return rows, [label for label, _ in runs]


def summary_table(out_dir: Path = OUT_DIR) -> str:
    """The `cost` block of the results pages: the committed runs of this script side by side (step time, evaluation,
    export and optimizer-state ratios) and `--engine`'s whole-step ratios, from their JSON only."""
    rows, runs = _summary_ratios(out_dir)
    first = json.loads((out_dir / SUMMARY_RUNS[0][1]).read_text())
    lines = [f"{first['data']}, {first['model']}, batch {first['batch_size']}, {first['device']}, "
             f"{first['threads']} thread; ratio: median over interleaved rounds [min–max over rounds] (a spread "
             f"(max − min) / median above {UNSTABLE_SPREAD} is marked not stable). Written by `benchmarks/cost.py "
             "--report` from results/cost/*.json.", "",
             "| | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(c or "–" for c in cells) + " |" for label, cells, _ in rows]
    engine_path = out_dir / "engine.json"
    if engine_path.exists():
        engine = json.loads(engine_path.read_text())
        lines += ["", f"`cost.py --engine` ({engine['device']}, {engine['threads']} thread, {engine['rounds']} "
                  "rounds): a whole VariationalTrainer step, IVON ÷ AdamW(foreach):", "",
                  "| model | batch | IVON ÷ AdamW, whole training step | AdamW training step ms |", "|---|---|---|---|"]
        for key, label in ENGINE_MODELS.items():
            m = engine["models"][key]
            ratio = m["ratios"]["train:ivon / train:adamw_foreach"]
            lines.append(f"| {label} | {m['batch_size']} | {fmt_ratio(ratio)} | "
                         f"{m['ms_median']['train:adamw_foreach']:.0f} |")
    shown = [json.loads((out_dir / name).read_text()) for _, name in SUMMARY_RUNS if (out_dir / name).exists()]
    shown += [engine] if engine_path.exists() else []
    return "\n".join([*lines, "", common.stamp_line(shown)])


def cost_figure(path: Path, out_dir: Path = OUT_DIR) -> Path:
    """The summary's cost figure, from the committed JSON only: time per training step against ERM/AdamW (each run of
    this script, and `--engine`'s whole step on two larger models) with the rounds' min–max, and optimizer state
    against the parameters' bytes. Matplotlib's Agg backend, 100 dpi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, runs = _summary_ratios(out_dir)
    bars: list[tuple[str, dict]] = []
    for (_, _, ratios), short in zip(rows[:3], ("IVON, 1 MC sample", "IVON, 2 MC samples", "SAM")):
        bars += [(f"{short}, small CNN ({run})", r) for run, r in zip(runs, ratios) if r]
    engine_path = out_dir / "engine.json"
    if engine_path.exists():
        engine = json.loads(engine_path.read_text())
        bars += [(f"IVON, {label} (--engine)", engine["models"][key]["ratios"]["train:ivon / train:adamw_foreach"])
                 for key, label in ENGINE_MODELS.items()]
    first = json.loads((out_dir / SUMMARY_RUNS[0][1]).read_text())
    memory = {"ERM (AdamW)": "erm_adamw", "SAM (AdamW)": "sam_adamw", "IVON": "ivon_mc1", "IVON, 2 MC": "ivon_mc2"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.4), gridspec_kw={"width_ratios": [1.7, 1]})
    y = np.arange(len(bars))[::-1]
    med = [b["median"] for _, b in bars]
    err = [[b["median"] - b["min"] for _, b in bars], [b["max"] - b["median"] for _, b in bars]]
    colors = ["tab:red" if name.startswith("IVON") else "tab:green" for name, _ in bars]
    ax.barh(y, med, xerr=err, color=colors, alpha=0.8, capsize=2)
    ax.axvline(1.0, color="k", linewidth=1)
    ax.set_yticks(y, [name for name, _ in bars], fontsize=8)
    ax.set_xlabel("time per training step ÷ AdamW's (1 CPU thread)")
    for yy, m, (_, b) in zip(y, med, bars):
        ax.text(b["max"] + 0.04, yy, f"{m:.2f}×", va="center", fontsize=8)
    ax.set_xlim(0, max(b["max"] for _, b in bars) * 1.2)
    ax.grid(axis="x", alpha=0.3)
    ratios = [first["memory"][k]["optimizer_state_bytes"] / first["memory"][k]["param_bytes"] for k in memory.values()]
    yb = np.arange(len(memory))[::-1]
    bx.barh(yb, ratios, color=["tab:gray", "tab:green", "tab:red", "tab:red"], alpha=0.8)
    bx.set_yticks(yb, list(memory), fontsize=8)
    for yy, r in zip(yb, ratios):
        bx.text(r + 0.1, yy, f"{r:.1f}×", va="center", fontsize=8)
    bx.set_xlabel("optimizer state ÷ parameter bytes", fontsize=9)
    bx.set_xlim(0, max(ratios) * 1.3)
    bx.grid(axis="x", alpha=0.3)
    fig.suptitle("What IVON costs against AdamW (cost.py, CPU)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, pil_kwargs={"optimize": True})
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
