"""How many posterior samples S should IVON predict with? Accuracy, NLL, ECE, AURC and the time of one prediction
of the test set against S = 1, 2, 4, …, 64 (`varsmooth.evaluation.posterior_samples_curve`), for one trained IVON model
per dataset with 40 % symmetric label noise:

* ``digits``: scikit-learn's 8×8 digits, the CNN of common.py, 30 epochs, the 597 test images;
* ``mnist``: the MNIST subset of common.py, the same CNN for 2 epochs (uncertainty.py's set-up: IVON_BASE with
  ``hessian_window=0.1``), scored on a fixed 2,000 of the clean test images.

    OMP_NUM_THREADS=1 python benchmarks/posterior_samples.py [--datasets digits mnist]   # no names: report only

Runs are cached by common.run under results/posterior_samples/runs/; the table goes to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import common  # noqa: E402

SCRIPT = "posterior_samples"
SETUPS = {"digits": {"epochs": 30, "hyperparams": {}, "test_size": None},
          "mnist": {"epochs": 2, "hyperparams": {"hessian_window": 0.1}, "test_size": 2000}}
NOISE = "sym40"
#: the reading's tolerance: the smallest S whose NLL is within this of the NLL at the largest S
NLL_TOLERANCE = 0.01


def curve(dataset: str) -> dict[str, Any]:
    from varsmooth.evaluation import posterior_samples_curve

    setup = SETUPS[dataset]

    def analyze(trainer: Any, val: Any, test: Any) -> dict[str, Any]:
        if setup["test_size"] is not None:
            sub = np.random.RandomState(0).permutation(len(test))[: setup["test_size"]]
            test = common.ArrayDataset(test.x[sub].numpy(), test.y[sub].numpy())
        return {"samples_curve": posterior_samples_curve(trainer, test), "test_size": len(test)}

    return common.run("ivon", setup["hyperparams"], noise=NOISE, seed=0, epochs=setup["epochs"], dataset=dataset,
                      history_every=0, script=SCRIPT, analyze=analyze)


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = ["## How many posterior samples? (`posterior_samples.py`)", "",
             "One IVON model per dataset, trained with 40 % symmetric label noise, scored on clean test labels by the "
             "Bayesian model average over its first S posterior draws (the same draws for every S); seconds: one "
             "prediction of the test set on one CPU thread of a shared machine (timings are noisy).", ""]
    for dataset, result in results.items():
        rows = result["analysis"]["samples_curve"]
        hess, hess_init = result["hessian"].get("hess_median", float("nan")), result["settings"]["hess_init"]
        lines += [f"### {dataset} ({result['analysis']['test_size']} test images, "
                  f"{SETUPS[dataset]['epochs']} epochs)", "",
                  f"Posterior: median Hessian {hess:.3g} (initialised at {hess_init:g}: "
                  + ("barely moved, so the posterior spread is still the prior setting's"
                     if abs(hess - hess_init) < 0.1 * hess_init else "learned")
                  + f"), median posterior std {result['hessian'].get('posterior_std_median', float('nan')):.3g}.", "",
                  "| S | accuracy % | NLL | ECE % | AURC ×100 | seconds |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['num_samples']} | {100 * r['accuracy']:.2f} | {r['nll']:.4f} | {100 * r['ece']:.2f} | "
                  f"{100 * r['aurc']:.2f} | {r['seconds']:.2f} |" for r in rows]
        last = rows[-1]
        enough = next(r for r in rows if r["nll"] <= last["nll"] + NLL_TOLERANCE)
        lines += ["", f"Reading: NLL at S = 1 is {rows[0]['nll']:.4f}, at S = {last['num_samples']} {last['nll']:.4f}; "
                      f"S = {enough['num_samples']} is the smallest S within {NLL_TOLERANCE} of it "
                      f"({enough['seconds']:.2f} s vs {last['seconds']:.2f} s per prediction of the test set).", ""]
    # before runs recorded a device, `common.run` trained with use_cpu=True
    return "\n".join([*lines, common.stamp_line(results.values(), unrecorded_device="cpu")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="*", default=list(SETUPS), choices=list(SETUPS),
                        help="datasets to train (if not cached); the others are reported from their cached runs")
    args = parser.parse_args()
    results = {}
    for dataset, setup in SETUPS.items():  # the datasets not asked for are reported from their cached runs
        try:
            result = curve(dataset) if dataset in args.datasets else common.cached(
                SCRIPT, "ivon", setup["hyperparams"], NOISE, 0, setup["epochs"], dataset=dataset)
        except common.DataUnavailable as error:
            print(f"skipping {dataset}: {error}", flush=True)
            continue
        if result is not None:
            results[dataset] = result
    common.write_readme_section(SCRIPT, report(results))


if __name__ == "__main__":
    main()
