"""`LabelNoiseMixin`: `VariationalTrainer.label_noise()`, the per-example label noise measured with the trainer's
batches."""

from __future__ import annotations

from typing import Any

import datasets
import torch
from torch.utils.data import SequentialSampler, Subset

from ..utils import length_order
from .compute import EXPORT_NUM_SAMPLES, compute_label_noise
from .strength import mean_label_noise

__all__ = ["LabelNoiseMixin"]

#: training examples on which `ivon_smoothing` measures the mean label noise (its standard error over examples is
#: about 1/sqrt(128) of their spread)
SMOOTHING_PROBE_SIZE = 128


class LabelNoiseMixin:
    """For a `transformers.Trainer` subclass with a `posterior()` and a `posterior_predictor()`
    (`VariationalTrainer`)."""

    def label_noise(self, dataset: Any = None, num_samples: int = EXPORT_NUM_SAMPLES,
                    **kwargs: Any) -> datasets.Dataset:
        """Per-example label noise ε̄ = p̄ − P̂ of the current posterior (Variational Learning Induces Adaptive Label
        Smoothing, 2025, Eq. 15) as a `datasets.Dataset`.

        One row per example of `dataset` (default: the training set), in dataset order, with its `clean_label` and
        `is_corrupted` columns carried over; the columns and `kwargs` are those of
        `varsmooth.label_noise.compute_label_noise` (`seed` defaults to `args.eval_seed`). The batches come from the
        Trainer's own machinery (column removal, collator, device, DDP sharding); every process must call this.
        """
        dataset = self.train_dataset if dataset is None else dataset
        # not get_eval_dataloader(): it may return the cached loader of eval_dataset; sentences go by length (each
        # batch pads to its longest), and the rows come back in dataset order
        order = length_order(dataset)
        sampler_fn = SequentialSampler if order is None else (lambda _: order)
        # batches at least as large as training's: an inference pass holds no gradients, so they fit where those did,
        # and HF's evaluation default (8) runs a CNN's passes several times slower than its training batches
        batch_size = max(self.args.eval_batch_size, self.args.train_batch_size)
        loader = self._get_dataloader(dataset, "Label noise", batch_size, sampler_fn=sampler_fn)
        kwargs.setdefault("seed", self.args.eval_seed)
        return compute_label_noise(
            self.accelerator.unwrap_model(self.model), self.posterior_predictor(), dataset, num_samples=num_samples,
            dataloader=loader, accelerator=self.accelerator, device=self.args.device, order=order,
            progress=self.shows_progress(), **kwargs,
        )

    def probe_label_noise(self, num_samples: int, seed: int) -> tuple[float, float]:
        """Mean ‖ε̄‖₁ of the current posterior and mean ‖p̂ − 1/K‖₁ of its mean's prediction over a fixed random probe
        of `SMOOTHING_PROBE_SIZE` training examples (the same rows all run long, drawn with `args.seed`), with
        `num_samples` draws seeded by `seed`: what `ivon_smoothing` holds at its target. Every process must call this;
        each measures its shard and they add up."""
        if getattr(self, "_smoothing_probe", None) is None:
            dataset = self.train_dataset
            rows = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.args.seed))
            rows = rows[:SMOOTHING_PROBE_SIZE].tolist()
            subset = dataset.select(rows) if isinstance(dataset, datasets.Dataset) else Subset(dataset, rows)
            loader = self._get_dataloader(subset, "Smoothing probe", self.args.eval_batch_size,
                                          sampler_fn=SequentialSampler)
            self._smoothing_probe = list(loader)
        batches = (self._prepare_inputs(batch) for batch in self._smoothing_probe)
        sums = mean_label_noise(self.accelerator.unwrap_model(self.model), self.posterior(), batches, num_samples,
                                seed)
        summed = self.accelerator.reduce(
            torch.tensor([sums.noise_l1, sums.distance_from_uniform, float(sums.count)], device=self.args.device),
            "sum")
        return float(summed[0] / summed[2]), float(summed[1] / summed[2])
