"""CI: the main job's outputs mean what they say, or CI fails.

    python .ci/check_main_job.py outputs/image-classification

IVON's posterior must have learned (median relative change of its Hessian from h0 at least 10 %), the label-noise
export must be nonzero, and the prediction the run reports must not be worse in NLL on the test split than the
prediction at the posterior mean. How much ε̄ varies across examples (90th/10th percentile of ‖ε̄‖₁) and whether it is
larger for ambiguous examples are printed, not checked (benchmarks/README.md, "The default posterior"): with each
draw's own BatchNorm statistics the spread sits at 2 on this run (1.98 ± 0.02 over 3 seeds, 2.02 on its seed), so a
threshold would pass or fail with the CPU's floating-point path; tests/test_default_posterior.py checks it (≥ 2) on
the 10-epoch variant of the same command (2.5), and ε̄ is larger for confident examples here (ρ ≈ −0.7).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def problems(folder: Path) -> list[str]:
    summary = json.loads((folder / "label_noise_summary.json").read_text())
    metrics = json.loads((folder / "all_results.json").read_text())
    found = []
    if not summary.get("hess_change_median", 0.0) >= 0.1:
        found.append(f"the posterior did not learn: the Hessian's median relative change is "
                     f"{summary.get('hess_change_median')} (< 0.1)")
    if not summary["all"]["noise_l1"]["mean"] > 0:
        found.append("the label-noise export is zero")
    if not metrics["test_nll"] <= metrics["test_mean_nll"] * (1 + 1e-6):  # τ = 0: equal up to float rounding
        found.append(f"the reported prediction is worse than the posterior mean: test NLL {metrics['test_nll']} > "
                     f"{metrics['test_mean_nll']}")
    return found


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/image-classification")
    found = problems(folder)
    for problem in found:
        print(f"main job check FAILED ({folder}): {problem}", file=sys.stderr)
    if not found:
        summary = json.loads((folder / "label_noise_summary.json").read_text())
        print(f"main job check passed ({folder}): the posterior learned (Hessian change "
              f"{summary['hess_change_median']:.3g}; the data, not h0's decay, set h in "
              f"{summary.get('hess_data_share', float('nan')):.0%} of the weights), the label noise is nonzero (mean "
              f"‖ε̄‖₁ {summary['all']['noise_l1']['mean']:.3g}), and the reported prediction is no worse than the "
              "mean. Reported, not checked (see the docstring): the spread of ‖ε̄‖₁ across examples, q90/q10 "
              f"{summary['adaptivity']['noise_l1_q90_over_q10']:.3g}, and its Spearman correlation with the entropy at "
              f"the mean, {summary['adaptivity']['noise_l1_entropy_spearman']:.3g} "
              f"({summary['adaptivity']['below_noise_peak_share']:.0%} of the examples are predicted less confidently "
              f"than the {summary['adaptivity']['noise_l1_peak_confidence']:.2f} where it peaks).")
    sys.exit(1 if found else 0)
