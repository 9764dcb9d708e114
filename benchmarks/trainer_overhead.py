"""Time per optimizer step: VariationalTrainer+IVON vs transformers.Trainer+AdamW, and vs a hand-written IVON loop.

One process, one model/data (the benchmarks' small CNN on MNIST 28x28, batch 64; random inputs of the same shape when
MNIST is absent, which does not change the timing), configurations *interleaved*: every round trains each
configuration for a block of optimizer steps, in a new random order per round. The per-step time of a block is the
median of the gaps between consecutive step ends (setup and the first `--skip` steps excluded), so it includes data
loading, forward/backward, the optimizer and the scheduler, i.e. what a user waits for. Ratios are computed within a
round (same machine load), and the median (and min-max) over rounds is reported: on a shared machine ratios are the
result, absolute milliseconds are not.

Configurations:
  hand_adamw        hand-written loop, torch.optim.AdamW (PyTorch baseline)
  trainer_adamw     transformers.Trainer, optim adamw_torch (what users run without varsmooth)
  vt_erm_adamw      VariationalTrainer(method="erm"), same AdamW (VariationalTrainer overhead for non-IVON methods)
  hand_ivon         the ivon-opt README loop with ivon.IVON (sampled_params(train=True) -> zero_grad -> backward; step)
  hand_vivon        the same loop with varsmooth.VariationalIVON (seeded noise, safe restore)
  vt_ivon           VariationalTrainer(method="ivon")

    OMP_NUM_THREADS=1 python benchmarks/trainer_overhead.py            # ~3-4 min on one core
    python benchmarks/trainer_overhead.py --rounds 3 --steps 30        # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import logging  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments, get_cosine_schedule_with_warmup  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch)

logging.getLogger("varsmooth").setLevel(logging.ERROR)  # blocks of 50 steps: the Hessian-stuck warning is expected

OUT_DIR = common.RESULTS_DIR / "trainer_overhead"
CONFIGS = ["hand_adamw", "trainer_adamw", "vt_erm_adamw", "hand_ivon", "hand_vivon", "vt_ivon"]
RATIOS = {
    "vt_ivon / hand_ivon (integration overhead, target <= 1.10)": ("vt_ivon", "hand_ivon"),
    "vt_ivon / hand_vivon (Trainer part only)": ("vt_ivon", "hand_vivon"),
    "hand_vivon / hand_ivon (varsmooth's IVON engine vs ivon-opt)": ("hand_vivon", "hand_ivon"),
    "trainer_adamw / hand_adamw (stock Trainer overhead, for reference)": ("trainer_adamw", "hand_adamw"),
    "vt_erm_adamw / trainer_adamw (VariationalTrainer, non-IVON method)": ("vt_erm_adamw", "trainer_adamw"),
    "vt_ivon / trainer_adamw (IVON in varsmooth vs AdamW in the stock Trainer)": ("vt_ivon", "trainer_adamw"),
    "hand_ivon / hand_adamw (IVON vs AdamW, plain PyTorch)": ("hand_ivon", "hand_adamw"),
}
IVON_KW = dict(lr=0.2, ess=9000, hess_init=0.5, beta1=0.9, beta2=0.99999, weight_decay=2e-4)
ADAMW_KW = dict(lr=1e-3, weight_decay=0.0)


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.ends.append(time.perf_counter())


def block_time(ends: list[float], skip: int) -> float:
    gaps = np.diff(np.asarray(ends))[skip:]
    return float(np.median(gaps))


def load_xy() -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        d = common.load_data("mnist")
        return torch.as_tensor(d.x_train), torch.as_tensor(d.y_train), "mnist (9k subset)"
    except common.DataUnavailable as e:
        print(f"{e}\nTiming on random inputs of MNIST's shape instead.")
        g = torch.Generator().manual_seed(0)
        return torch.randn(9000, 1, 28, 28, generator=g), torch.randint(0, 10, (9000,), generator=g), "random 28x28"


def trainer_block(kind: str, model, x, y, steps: int, tmp: str, seed: int) -> list[float]:
    from varsmooth import VariationalTrainer, VariationalTrainingArguments
    from varsmooth.methods import IVONConfig

    common_kw = dict(output_dir=tmp, max_steps=steps, per_device_train_batch_size=64, use_cpu=True, report_to=[],
                     save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0, seed=seed, lr_scheduler_type="cosine", warmup_steps=0)
    clock = StepClock()
    ds = common.ArrayDataset(x.numpy(), y.numpy())
    if kind == "trainer_adamw":
        args = TrainingArguments(optim="adamw_torch", learning_rate=ADAMW_KW["lr"], weight_decay=0.0, **common_kw)
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[clock])
    elif kind == "vt_erm_adamw":
        args = VariationalTrainingArguments(method="erm", optim="adamw_torch", learning_rate=ADAMW_KW["lr"],
                                            weight_decay=0.0, **common_kw)
        trainer = VariationalTrainer(model=model, args=args, train_dataset=ds, callbacks=[clock])
    elif kind == "vt_ivon":
        ivon = IVONConfig(ess=IVON_KW["ess"], hess_init=IVON_KW["hess_init"], beta2=IVON_KW["beta2"],
                          prior_precision=IVON_KW["weight_decay"])
        args = VariationalTrainingArguments(method="ivon", learning_rate=IVON_KW["lr"], method_config=ivon, **common_kw)
        trainer = VariationalTrainer(model=model, args=args, train_dataset=ds, callbacks=[clock])
    else:
        raise ValueError(kind)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return clock.ends


def hand_block(kind: str, model, x, y, steps: int, seed: int) -> list[float]:
    import ivon

    from varsmooth import VariationalIVON

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed), drop_last=False)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "hand_adamw":
        opt = torch.optim.AdamW(params, **ADAMW_KW)
    elif kind == "hand_ivon":
        opt = ivon.IVON(params, **IVON_KW)
    elif kind == "hand_vivon":
        opt = VariationalIVON(params, sample_seed=seed, **IVON_KW)
    else:
        raise ValueError(kind)
    sched = get_cosine_schedule_with_warmup(opt, 0, steps)
    model.train()
    ends: list[float] = []
    it = iter(loader)
    for _ in range(steps):
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            xb, yb = next(it)
        if kind == "hand_adamw":
            opt.zero_grad()
            F.cross_entropy(model(pixel_values=xb).logits, yb).backward()
        else:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(pixel_values=xb).logits, yb).backward()
        opt.step()
        sched.step()
        ends.append(time.perf_counter())
    return ends


def report(out: Path = OUT_DIR) -> dict:
    """trainer_overhead.md and the `trainer_overhead` section of benchmarks/README.md from the saved JSON."""
    result = json.loads((out / "trainer_overhead.json").read_text())
    summary, ratios = result["per_config"], result["ratios"]
    table = ["| configuration | ms / step, median over rounds [min–max] |", "|---|---|"]
    table += [f"| {k} | {s['median_ms']:.2f} [{s['min_ms']:.2f}–{s['max_ms']:.2f}] |" for k, s in summary.items()]
    table += ["", "| ratio | median [min–max] |", "|---|---|"]
    table += [f"| {name} | **{s['median']:.3f}** [{s['min']:.3f}–{s['max']:.3f}] |" for name, s in ratios.items()]
    setup = (f"{result['data']}, {result['model']}, batch {result['batch_size']}, CPU, {result['threads']} thread; "
             f"{result['rounds']} interleaved rounds × {result['steps_per_block']} steps per configuration (first "
             f"{result['skip']} gaps dropped). Ratios are per round; median [min–max] over rounds.")
    lines = ["# Trainer integration overhead (time per optimizer step)", "", setup, "", *table, "", result["note"], "",
             "Rerun: `OMP_NUM_THREADS=1 python benchmarks/trainer_overhead.py`", ""]
    (out / "trainer_overhead.md").write_text("\n".join(lines))
    common.write_readme_section("trainer_overhead", "\n".join([setup, "", *table, "", common.stamp_line([result])]))
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per block")
    p.add_argument("--skip", type=int, default=5, help="step gaps dropped at the start of each block (warm-up)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--report", action="store_true", help="only rewrite the tables from the saved JSON (no timing)")
    a = p.parse_args(argv)
    if a.report:
        return report(Path(a.out))
    torch.set_num_threads(1)
    x, y, data_name = load_xy()
    configs = a.configs.split(",")
    models = {}
    for k in configs:
        torch.manual_seed(0)
        models[k] = common.SmallCNN((1, 28, 28), 10)
    n_params = sum(p.numel() for p in next(iter(models.values())).parameters())
    per_round: list[dict[str, float]] = []
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = configs[:]
            rng.shuffle(order)
            times = {}
            for k in order:
                if k.startswith("hand_"):
                    ends = hand_block(k, models[k], x, y, a.steps, seed=r)
                else:
                    ends = trainer_block(k, models[k], x, y, a.steps, tmp, seed=r)
                times[k] = block_time(ends, a.skip)
            per_round.append(times)
            print(f"round {r}: " + "  ".join(f"{k} {1e3 * times[k]:.2f}ms" for k in configs), flush=True)
    summary = {}
    for k in configs:
        v = [t[k] for t in per_round]
        summary[k] = {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "max_ms": 1e3 * max(v)}
    ratios = {}
    for name, (num, den) in RATIOS.items():
        if num in configs and den in configs:
            v = [t[num] / t[den] for t in per_round]
            ratios[name] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    import platform

    result = {
        "what": "time per optimizer step (median of step-end gaps per block; blocks interleaved, random order per "
                "round)",
        "data": data_name, "model": f"SmallCNN, {n_params} parameters", "batch_size": 64, "rounds": a.rounds,
        "steps_per_block": a.steps, "skip": a.skip, "threads": torch.get_num_threads(), "device": "cpu",
        "cpu": platform.processor() or platform.machine(), "ivon_settings": IVON_KW, "adamw_settings": ADAMW_KW,
        "per_config": summary, "ratios": ratios, "per_round_s": per_round, "versions": common._versions(),
        "commit": common.code_commit(),
        "note": "Logging off in all configurations (with logging on, VariationalTrainer adds one Hessian/σ median per "
                "logging step). The machine is shared by other processes: trust ratios within a round, not "
                "absolute ms.",
    }
    common.write_json(Path(a.out) / "trainer_overhead.json", result)
    report(Path(a.out))
    return result


if __name__ == "__main__":
    main()
