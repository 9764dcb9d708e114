"""What a trained `VariationalTrainer` predicts, scored: OOD detection against an out-of-distribution dataset, and how
many posterior samples to predict with (the metrics and the time of the Bayesian model average against S).

These sit above the trainer (they call its `predict` and dataloaders); the metrics themselves are functions of arrays
in `varsmooth.metrics`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .metrics.ood import ood_metrics

if TYPE_CHECKING:
    from .trainer.trainer import VariationalTrainer

__all__ = ["DEFAULT_SAMPLE_COUNTS", "ood_evaluation", "posterior_samples_curve", "predictive_outputs"]

#: the numbers of posterior samples S `posterior_samples_curve` scores by default
DEFAULT_SAMPLE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def posterior_samples_curve(trainer: "VariationalTrainer", eval_dataset: Any = None,
                            sample_counts: Sequence[int] = DEFAULT_SAMPLE_COUNTS) -> list[dict[str, float]]:
    """Accuracy, NLL, ECE (and the other `classification_metrics`) of the posterior-averaged prediction of `trainer`
    on `eval_dataset` (default: its eval dataset) for every number of posterior samples S in `sample_counts`, with
    the seconds one prediction of the dataset took (`trainer.predict`, so the time a user pays per S).

    The draws are the trainer's (`eval_seed`): the S-sample prediction uses the first S draws of every larger one, so
    the rows differ by the added samples only. Each S is prepared as the trainer prepares its prediction
    (`prepare_predictor`: each draw's BatchNorm statistics, not timed); `args.eval_mc_samples` and the prediction are
    restored afterwards. Returns one dict per S with `num_samples`, `seconds` and the metrics.
    """
    counts = list(sample_counts)
    if not counts or any(isinstance(s, bool) or int(s) != s or s < 1 for s in counts):
        raise ValueError(f"sample_counts must be positive integers (e.g. {DEFAULT_SAMPLE_COUNTS}), got "
                         f"{sample_counts!r}.")
    if trainer.posterior().is_point_mass:
        raise ValueError(f"This trainer (method={trainer.method.name!r}) has no posterior to sample: every S would "
                         "give the prediction at the weights. Train with an IVON method first, or pass posterior= to "
                         "the trainer.")
    dataset = trainer.eval_dataset if eval_dataset is None else eval_dataset
    if dataset is None:
        raise ValueError("No eval_dataset: pass the (validation) dataset to score the sample counts on.")
    original = trainer.args.eval_mc_samples
    rows = []
    try:
        for s in counts:
            trainer.args.eval_mc_samples = int(s)
            trainer.prepare_predictor()
            start = time.perf_counter()
            metrics = trainer.predict(dataset, metric_key_prefix="samples").metrics
            seconds = time.perf_counter() - start
            rows.append({"num_samples": int(s), "seconds": seconds,
                         **{k.removeprefix("samples_"): float(v) for k, v in metrics.items()
                            if k.startswith("samples_") and not k.startswith("samples_mean_")
                            and k not in ("samples_runtime", "samples_samples_per_second",
                                          "samples_steps_per_second")}})
    finally:
        trainer.args.eval_mc_samples = original
        trainer.prepare_predictor()
    return rows


@torch.no_grad()
def predictive_outputs(trainer: "VariationalTrainer", dataset: Any) -> dict[str, np.ndarray]:
    """What `trainer.evaluate()` predicts on `dataset` (BMA, MC dropout or an ensemble, then the temperature scaling
    if fitted), as arrays: `probs` (N, K), `logits` (the logits at the weights / posterior mean, for the energy score)
    and `mutual_information` (N,; absent for a prediction without draws). Labels are not needed."""
    model = trainer.model
    was_training = model.training
    model.eval()
    predictor = trainer.predictor()
    parts: dict[str, list[np.ndarray]] = {"probs": [], "logits": [], "mutual_information": []}
    try:
        for batch in trainer.get_test_dataloader(dataset):
            out = trainer.predictive(model, trainer._prepare_inputs(batch), predictor)
            parts["probs"].append(out.probs.float().cpu().numpy())
            parts["logits"].append(out.mean_logits.float().cpu().numpy())
            if out.mutual_information is not None:  # None: a prediction without draws, where none was measured
                parts["mutual_information"].append(out.mutual_information.float().cpu().numpy())
    finally:
        model.train(was_training)
    return {k: np.concatenate(v) for k, v in parts.items() if v}


def ood_evaluation(trainer: "VariationalTrainer", in_dataset: Any, ood_dataset: Any) -> dict[str, float]:
    """`ood_metrics` (AUROC and FPR95 of the maximum probability, entropy, mutual information and energy) of what
    `trainer` predicts, with `in_dataset` as the in-distribution (positive) set and `ood_dataset` as the
    out-of-distribution one; the mutual information only where the prediction has several draws."""
    inside, outside = predictive_outputs(trainer, in_dataset), predictive_outputs(trainer, ood_dataset)
    with_mi = "mutual_information" in inside and "mutual_information" in outside
    return ood_metrics(inside["probs"], outside["probs"], logits_in=inside["logits"], logits_out=outside["logits"],
                       **({"mutual_information_in": inside["mutual_information"],
                           "mutual_information_out": outside["mutual_information"]} if with_mi else {}))
