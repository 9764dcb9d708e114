"""What the label-noise export costs, against its floor of (S + 1) evaluation passes.

`compute_label_noise` runs S + 1 forward passes per batch (one at the posterior mean, S at posterior samples) plus
the weight draws and the per-example arithmetic. This script times, in one run and on the same data and model,

* the export: `compute_label_noise(model, posterior, dataset, num_samples=S)`, end to end (dataloader, draws,
  forward passes, building the result `Dataset`);
* one evaluation pass at the posterior mean over the same dataloader (batches loaded and the model run once),
* one forward pass over the same batches already in memory (the compute floor without data loading),

and reports export / ((S + 1) × evaluation pass), the target being ≤ 1.15, and export / ((S + 1) × forward pass):
with a small model the evaluation pass is mostly data loading, which the export does once, not S + 1 times, so
the second ratio is the one that shows the overhead of the weight draws and the bookkeeping. Each timing is the
median of `--repeats` runs after a warm-up, alternating the two. Results go to
`benchmarks/results/label_noise_cost.json` and the `label_noise_cost` section of benchmarks/README.md.

    OMP_NUM_THREADS=1 python benchmarks/label_noise_cost.py
    python benchmarks/label_noise_cost.py --report       # the table from the saved JSON only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader
from transformers import default_data_collator
from transformers.utils import ModelOutput

from varsmooth.label_noise import compute_label_noise
from varsmooth.outputs import model_logits
from varsmooth.posterior import DiagonalGaussianPosterior

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "label_noise_cost.json")


class MLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, num_classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, num_classes),
        )

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        return ModelOutput(logits=self.net(pixel_values))


def report(path: str = RESULTS) -> str:
    """The `label_noise_cost` section of benchmarks/README.md from the saved JSON."""
    with open(path) as f:
        r = json.load(f)
    s1 = r["num_samples"] + 1
    text = "\n".join([
        f"Digits repeated to {r['num_examples']:,} examples, an MLP of {r['num_parameters']:,} weights, S = "
        f"{r['num_samples']} posterior samples, batch {r['batch_size']}, {r['device']} ({r['torch_threads']} thread), "
        f"median of {len(r['export_s_all'])} timings each.", "",
        "| | seconds | export / ((S + 1) × this) |", "|---|---|---|",
        f"| label-noise export (`compute_label_noise`) | {r['export_s']:.3f} | – |",
        f"| one evaluation pass at the mean (data loading + forward) | {r['eval_pass_s']:.4f} | "
        f"**{r['ratio_export_over_S_plus_1_eval_passes']:.2f}** (target ≤ {r['target']}) |",
        f"| one forward pass over batches in memory | {r['forward_pass_s']:.4f} | "
        f"{r['ratio_export_over_S_plus_1_forward_passes']:.2f} |", "",
        f"(S + 1) evaluation passes would take {s1 * r['eval_pass_s']:.2f} s: the export loads each batch once, not "
        f"S + 1 times; against in-memory forward passes it pays for the weight draws and the per-example arithmetic.",
        "", common.stamp_line([r]),
    ])
    common.write_readme_section("label_noise_cost", text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--copies", type=int, default=2, help="the digits repeated this many times (1797 each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--report", action="store_true", help="only rewrite the table from the saved JSON (no timing)")
    cli = parser.parse_args()
    if cli.report:
        print(report(cli.output))
        return

    x, y = load_digits(return_X_y=True)
    x = np.tile((x / 16.0).astype(np.float32), (cli.copies, 1))
    data = datasets.Dataset.from_dict({"pixel_values": x, "label": np.tile(y, cli.copies)})
    torch.manual_seed(0)
    device = torch.device(cli.device)
    model = MLP(x.shape[1], cli.hidden, 10).to(device).eval()
    # a posterior of the size IVON learns for such a network: σ = 1/sqrt(ess·(h + δ)), ess = N, h ≈ 0.5
    std = 1.0 / np.sqrt(len(data) * 0.5)
    posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, std) for n, p in model.named_parameters()})
    # the batches the export builds for itself
    loader = DataLoader(data.with_format("torch"), batch_size=cli.batch_size, collate_fn=default_data_collator)

    def evaluation_pass() -> None:
        with torch.no_grad():
            for batch in loader:
                model_logits(model, {k: v.to(device) for k, v in batch.items()})
        if device.type == "cuda":
            torch.cuda.synchronize()

    batches = [{k: v.to(device) for k, v in batch.items()} for batch in loader]

    def forward_pass() -> None:
        with torch.no_grad():
            for batch in batches:
                model_logits(model, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def export() -> None:
        compute_label_noise(model, posterior, data, num_samples=cli.num_samples, batch_size=cli.batch_size,
                            device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    evaluation_pass(), forward_pass(), export()  # warm-up
    eval_times, forward_times, export_times = [], [], []
    for _ in range(cli.repeats):
        eval_times.append(timed(evaluation_pass))
        forward_times.append(timed(forward_pass))
        export_times.append(timed(export))
    eval_s, forward_s, export_s = (statistics.median(t) for t in (eval_times, forward_times, export_times))
    ratio = export_s / ((cli.num_samples + 1) * eval_s)
    ratio_forward = export_s / ((cli.num_samples + 1) * forward_s)
    result = {
        "ratio_export_over_S_plus_1_eval_passes": ratio,
        "ratio_export_over_S_plus_1_forward_passes": ratio_forward,
        "target": 1.15,
        "export_s": export_s,
        "eval_pass_s": eval_s,
        "forward_pass_s": forward_s,
        "export_s_all": export_times,
        "eval_pass_s_all": eval_times,
        "forward_pass_s_all": forward_times,
        "num_samples": cli.num_samples,
        "num_examples": len(data),
        "batch_size": cli.batch_size,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "commit": common.code_commit(),
    }
    os.makedirs(os.path.dirname(cli.output), exist_ok=True)
    with open(cli.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"export {export_s:.3f}s vs (S+1) x eval pass {(cli.num_samples + 1) * eval_s:.3f}s "
          f"(eval pass {eval_s * 1e3:.1f} ms, S = {cli.num_samples}): ratio {ratio:.3f} (target <= 1.15)")
    print(f"export vs (S+1) x forward pass over in-memory batches ({forward_s * 1e3:.1f} ms): "
          f"ratio {ratio_forward:.3f}")
    print(f"wrote {cli.output}")
    print(report(cli.output))


if __name__ == "__main__":
    main()
