"""Training length and Hessian adaptivity: when does each method memorise the noisy labels,
and which IVON setting, stated as a rule from the run's size, reaches the best label smoothing without tuning?

MNIST (9k noisy train / 1k noisy val / 10k clean test, the reference study's split), small CNN, batch 64,
symmetric 40 % and pair-flip 40 % noise. Per run: clean-test accuracy at the mean weights after every epoch
(2k-image subset, descriptive only), final clean-test BMA/mean accuracy, NLL, ECE, noisy-val accuracy, the share
of flipped training labels the final model fits, and IVON's Hessian.

IVON candidates are rules of T = epochs·ceil(N/B), the run's optimizer steps (N = training examples, B = batch):

  S1         the library default / authors' recipe: β2 = 0.99999 (window 1e5 steps, the Hessian does not move)
  W<c>c      β2 = 1 − 1/(c·T) (the Hessian EMA window is a fraction c of the run) with clip_radius = 0.05
  fixed      β2 = 1 (the fixed-Hessian ablation of Yang et al. 2025, Fig. 6)

The selected rule is the library option `hessian_window=0.1` (varsmooth.presets), which adds a floor: the window
is max(0.1·T, 300) steps (300 instead of 282 for these 20-epoch runs; the floor comes from the digits check in
`robustness.py --quick --ivon-check`).

Selection protocol (fixed before looking at any result): candidates are screened on seed 0; the default rule is
the candidate with the highest noisy-validation BMA accuracy averaged over sym-40 and pair-40, confirmed on seeds
1 and 2. LS's α is chosen per seed on noisy validation from {0 (= ERM), 0.1, 0.3, 0.5, 0.7, 0.9} at 20 epochs and
from {0, 0.7, 0.9} at 60 epochs. Nothing is chosen on clean labels.

    OMP_NUM_THREADS=1 python benchmarks/training_length.py --phase screen   --workers 2   # seed 0 (~40 min)
    OMP_NUM_THREADS=1 python benchmarks/training_length.py --phase confirm  --workers 2   # seeds 1, 2 (~60 min)
    OMP_NUM_THREADS=1 python benchmarks/training_length.py --phase long     --workers 2   # 60 epochs, 3 seeds (~2 h)
    python benchmarks/training_length.py --phase report                                   # tables + plot only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SCRIPT = "training_length"
OUT_DIR = common.RESULTS_DIR / SCRIPT
NOISES = ["sym40", "pair40"]
LS_ALPHAS_ALL = [0.1, 0.3, 0.5, 0.7, 0.9]
LS_ALPHAS_CONFIRM = [0.5, 0.7, 0.9]
CLIP = 0.05
#: the window fraction c of the rule selected by the protocol above (see benchmarks/README.md)
SELECTED_WINDOW = 0.1
#: prediction of the selected rule: "mean" (posterior mean) or "bma" (noisy validation preferred the mean)
IVON_PREDICTION = "mean"


def total_steps(epochs: int, n_train: int = 9000, batch_size: int = 64) -> int:
    return epochs * common.steps_per_epoch(n_train, batch_size)


def window_beta2(c: float, total_steps: int) -> float:
    """A screening candidate's β2: the library's rule (`varsmooth.presets.beta2_for_window`) without its 300-step floor,
    which did not exist when the candidates were screened (the cache keys of the committed runs hold these values)."""
    from varsmooth.presets import beta2_for_window

    return round(beta2_for_window(total_steps, c, min_window_steps=0), 9)


def ivon_candidates(epochs: int) -> dict[str, tuple[str, dict]]:
    """name -> (method, hyperparameters) for a run of `epochs` epochs."""
    T = total_steps(epochs)
    cands: dict[str, tuple[str, dict]] = {"S1": ("ivon", {})}
    for c in (0.1, 0.03, 0.3):
        cands[f"W{c:g}c"] = ("ivon", {"beta2": window_beta2(c, T), "clip_radius": CLIP})
    # second screening round (added after the first: W0.1c's mean weights did not memorise but plateaued below LS on
    # sym-40 with σ at its prior cap 1/sqrt(N·δ) ≈ 0.7): a larger prior precision δ caps σ lower (δ 1e-3 is the
    # paper's CIFAR-10 weight decay)
    for c, delta in ((0.1, 1e-3),):
        cands[f"W{c:g}c-d{delta:g}"] = ("ivon", {"beta2": window_beta2(c, T), "clip_radius": CLIP,
                                                 "prior_precision": delta})
    cands["fixed"] = ("ivon_fixed_hessian", {})
    return cands


def default_rule_hyperparams(epochs: int, n_train: int, batch_size: int = 64) -> dict:
    """The IVON setting this study selects (= the library's `hessian_window=0.1`: β2 = 1 − 1/max(0.1·T, 300) with
    clip_radius 0.05, see varsmooth.presets), as explicit hyperparameters for `common.run`."""
    from varsmooth.presets import beta2_for_window

    T = epochs * common.steps_per_epoch(n_train, batch_size)
    return {"beta2": round(beta2_for_window(T, SELECTED_WINDOW), 9), "clip_radius": CLIP}


def baselines() -> dict[str, tuple[str, dict]]:
    out = {"ERM": ("erm", {})}
    for a in LS_ALPHAS_ALL:
        out[f"LS{a:g}"] = ("ls", {"smoothing": a})
    return out


def job(name: str, spec: tuple[str, dict], noise: str, seed: int, epochs: int) -> dict:
    method, hp = spec
    return dict(method=method, hyperparams=hp, noise=noise, seed=seed, epochs=epochs, script=SCRIPT, label=name)


def jobs_for(phase: str, epochs: int, candidates: list[str] | None, seeds: list[int] | None = None) -> list[dict]:
    """Seed-major (an interrupted phase leaves complete seeds behind), most informative first within a seed."""
    specs = {**baselines(), **ivon_candidates(epochs)}
    if phase == "screen":
        names, seeds = (candidates or ["ERM", "LS0.7", "LS0.9", "S1", "W0.1c", "W0.03c", "W0.3c", "LS0.5", "LS0.3",
                                       "LS0.1"]), [0]
    elif phase == "confirm":
        names, seeds = candidates or ["ERM", "LS0.7", "LS0.9", "S1", "W0.1c", "LS0.5"], seeds or [1, 2]
    elif phase == "long":
        names, seeds = ["ERM", "LS0.7", "S1", *(candidates or ["W0.1c"]), "LS0.9"], seeds or [0, 1, 2]
    else:
        raise ValueError(phase)
    return [job(name, specs[name], noise, seed, epochs) for seed in seeds for name in names for noise in NOISES]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=["screen", "confirm", "long", "report"], required=True)
    p.add_argument("--epochs", type=int, default=None, help="20 for screen/confirm, 60 for long")
    p.add_argument("--candidates", default=None,
                   help="comma-separated labels (ERM, LS0.7, S1, W0.1c, ...) to run, in order")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (confirm: default 1,2; long: default 0,1,2)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    if a.phase != "report":
        try:
            common.load_data("mnist")
        except common.DataUnavailable as e:
            print(f"SKIP: {e}")
            return
        epochs = a.epochs or (60 if a.phase == "long" else 20)
        jobs = jobs_for(a.phase, epochs, a.candidates.split(",") if a.candidates else None,
                        [int(x) for x in a.seeds.split(",")] if a.seeds else None)
        if a.dry_run:
            for j in jobs:
                print(j)
            return
        common.run_parallel([{k: v for k, v in j.items() if k != "label"} for j in jobs], workers=a.workers)
    import training_length_report

    training_length_report.report()


if __name__ == "__main__":
    main()
