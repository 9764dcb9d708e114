"""What a larger model changes for IVON-LoRA: cost on a GPU, against AdamW-LoRA, through `VariationalTrainer`.

`lora.py` compares accuracy and calibration on the pretrained 2-layer MiniLM (22 M parameters with its embeddings).
Here BERT-base- and BERT-large-sized encoders are built from a config (random weights: no pretrained checkpoint of that
size ships offline, so accuracy means nothing here and is not reported) with LoRA r = 8, α = 16 on query/value, and
trained on random token sequences (batch 32, length 128, bf16 autocast) for a fixed number of optimizer steps with

* ``ivon-lora``: IVON's `lora` preset (one posterior sample per step), and
* ``adamw-lora``: AdamW (fused where the GPU allows it) on the same adapters,

measuring the median seconds per optimizer step after warm-up, the peak GPU memory, and the prediction time of the
BMA over the preset's 10 posterior samples against one prediction at the posterior mean. Both methods run in one
process, interleaved per model, so their ratio is measured under the same conditions.

    VARSMOOTH_BENCH_DEVICE=cuda python benchmarks/lora_scale.py            # writes results/lora_cuda/scale.json + .md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

import common  # noqa: E402  (sets OMP_NUM_THREADS before torch is imported)
from varsmooth import VariationalTrainer, add_lora_adapters  # noqa: E402

SIZES = {"bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "intermediate_size": 3072},
         "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                        "intermediate_size": 4096}}
METHODS = {"ivon-lora": {"method": "ivon", "ivon_preset": "lora"},
           "adamw-lora": {"method": "erm", "optim": "adamw_torch_fused", "learning_rate": 1e-3, "weight_decay": 0.01}}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (synchronised, so GPU work is counted where it happens)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        sync()
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        sync()
        self.times.append(time.perf_counter() - self._t)


def random_tokens(n: int, length: int, vocab: int, seed: int) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (n, length), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def measure(size: str, method: str, steps: int, batch: int, length: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = BertConfig(num_labels=2, vocab_size=30522, **SIZES[size])
    model = add_lora_adapters(BertForSequenceClassification(config), r=8, alpha=16, target_modules=["query", "value"])
    train = random_tokens(steps * batch, length, config.vocab_size, seed=0)
    test = random_tokens(2048, length, config.vocab_size, seed=1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="varsmooth-lora-scale-") as tmp:
        args = common.training_arguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch, per_device_eval_batch_size=256,
            bf16=True, use_cpu=not torch.cuda.is_available(),
            report_to=[], save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
            dataloader_num_workers=2, posterior_temperature=1.0, **METHODS[method])
        timer = StepTimer()
        trainer = VariationalTrainer(model=model, args=args, train_dataset=train, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        peak_train = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        bma_samples = trainer.args.eval_mc_samples if method == "ivon-lora" else 0
        timings = {}
        for label, samples in (("mean", 0), ("bma", bma_samples)):
            if method != "ivon-lora" and samples:
                continue
            trainer.args.eval_mc_samples = samples
            sync()
            t0 = time.perf_counter()
            trainer.predict(test)
            sync()
            timings[label] = time.perf_counter() - t0
    warm = timer.times[max(3, len(timer.times) // 5):]
    return {"size": size, "method": method, "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "s_per_step": statistics.median(warm), "s_per_step_min": min(warm), "s_per_step_max": max(warm),
            "peak_train_gib": peak_train, "predict_s": timings, "bma_samples": bma_samples}


def table(data: dict[str, Any]) -> str:
    """The markdown table of a `scale.json`."""
    rows, sizes = data["rows"], list(dict.fromkeys(r["size"] for r in data["rows"]))
    lines = [f"LoRA r = 8 on query/value, batch {data['batch']} × {data['length']} tokens, bf16 autocast, "
             f"{data['steps']} steps, {data['device']}; median s/step after warm-up [min–max]; prediction of 2,048 "
             "sequences. Written by `benchmarks/lora_scale.py` (random weights from a config: cost only, no accuracy).",
             "",
             "| model | parameters | trainable | method | s/step | IVON / AdamW | peak GiB (train) "
             "| predict: mean / BMA-10 s |",
             "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        by = {r["method"]: r for r in rows if r["size"] == size}
        for method, r in by.items():
            ratio = r["s_per_step"] / by["adamw-lora"]["s_per_step"]
            pred = " / ".join(f"{v:.2f}" for v in r["predict_s"].values())
            lines.append(f"| {size} | {r['parameters'] / 1e6:.0f} M | {r['trainable'] / 1e6:.2f} M | {method} | "
                         f"{r['s_per_step'] * 1e3:.1f} ms "
                         f"[{r['s_per_step_min'] * 1e3:.1f}–{r['s_per_step_max'] * 1e3:.1f}] | "
                         f"{ratio:.2f}× | {r['peak_train_gib']:.2f} | {pred} |")
    return "\n".join([*lines, "", common.stamp_line([data])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--report", action="store_true",
                        help="Only rewrite the table from results/lora_cuda/scale.json.")
    args = parser.parse_args()
    out = common.RESULTS_DIR / "lora_cuda"
    if not args.report:
        if common.bench_device() != "cuda":
            raise SystemExit("lora_scale.py measures GPU cost: run it with VARSMOOTH_BENCH_DEVICE=cuda on a machine "
                             "with a GPU.")
        rows = [measure(size, method, args.steps, args.batch, args.length) for size in args.sizes for method in METHODS]
        common.write_json(out / "scale.json", {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "commit": common.code_commit(),
                                               "steps": args.steps, "batch": args.batch, "length": args.length,
                                               "rows": rows})
    text = table(json.loads((out / "scale.json").read_text()))
    (out / "scale.md").write_text(text + "\n")
    common.write_readme_section("lora_scale", text)
    print(text)


if __name__ == "__main__":
    main()
