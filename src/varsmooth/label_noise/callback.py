"""`LabelNoiseCallback`: export the per-example label noise of the posterior at the end of training."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import datasets
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..prediction.batchnorm import batchnorm_layers
from .compute import EXPORT_NUM_SAMPLES, write_label_noise

__all__ = ["LabelNoiseCallback"]

logger = logging.getLogger(__name__)


class LabelNoiseCallback(TrainerCallback):
    """Writes `label_noise.parquet` and `label_noise_summary.json` into `output_dir` when training ends.

    The rows are `compute_label_noise` results (Variational Learning Induces Adaptive Label Smoothing (2025),
    Eq. 15 and Eq. 19), measured with the learned posterior (τ = 1) whatever τ the trainer chose for prediction,
    for every example of `dataset` (default: the training set, with its `clean_label`/
    `is_corrupted` columns when present), in dataset order; under DDP each process measures its shard and the main
    process writes one file. Both files are written to a temporary name and renamed, so a crash never leaves half a
    file.

    `VariationalTrainer(callbacks=[...])` and `VariationalTrainer.add_callback` connect it to what it measures with
    (`connect`); with a plain `transformers.Trainer` (no posterior) it refuses to start.

    Args:
        num_samples: posterior samples S per example (default `EXPORT_NUM_SAMPLES`, one antithetic pair); costs S + 1
            forward passes over `dataset`. Its seconds go into the summary (`export_seconds`) and the model card.
        every_n_epochs: also export after every n-th epoch, as `label_noise_epoch<n>.parquet` (+ summary).
        dataset: the examples to measure (a `datasets.Dataset` the trainer's collator can batch).
        seed: seed of the posterior draws (default `args.eval_seed`, the draws evaluation uses).
        plots: also draw Fig. 4 of that paper (smoothed labels per class) and, when the dataset holds images,
            Fig. 3 (highest- and lowest-noise examples) into `output_dir`.
    """

    def __init__(
        self,
        num_samples: int = EXPORT_NUM_SAMPLES,
        every_n_epochs: int | None = None,
        dataset: datasets.Dataset | None = None,
        *,
        seed: int | None = None,
        plots: bool = False,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1 or None, got {every_n_epochs}.")
        self.num_samples = num_samples
        self.every_n_epochs = every_n_epochs
        self.dataset = dataset
        self.seed = seed
        self.plots = plots
        self._measure: Callable[..., datasets.Dataset] | None = None

    def connect(self, measure: Callable[..., datasets.Dataset], predictor: Callable[[], Any],
                record_output: Callable[[str], None], train_dataset: Callable[[], Any]) -> "LabelNoiseCallback":
        """Give the callback what it exports with (`VariationalTrainer` does it on init and in `add_callback`):
        `measure(dataset, num_samples=, seed=)` the label noise (`VariationalTrainer.label_noise`), `predictor()` the
        current prediction (`PosteriorPredictor`: its posterior's summary and its τ go into the metadata),
        `record_output(path)` notes a file the run wrote beside its saves, `train_dataset()` the examples measured by
        default."""
        self._measure, self._predictor, self._record_output, self._train_dataset = (measure, predictor, record_output,
                                                                                    train_dataset)
        return self

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._measure is None:  # fail before training rather than after it
            raise RuntimeError(
                "LabelNoiseCallback is not connected to a posterior: it needs a varsmooth.VariationalTrainer (pass it "
                "in VariationalTrainer(callbacks=[...]) or trainer.add_callback(...)), not a plain "
                "transformers.Trainer."
            )

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        epoch = round(state.epoch or 0)
        # the last epoch is exported by on_train_end
        if self.every_n_epochs and epoch % self.every_n_epochs == 0 and state.global_step < state.max_steps:
            self.export(args, state, name=f"label_noise_epoch{epoch}")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.export(args, state)

    def export(self, args: TrainingArguments, state: TrainerState, name: str = "label_noise") -> str | None:
        """Measure the label noise now and write it; returns the parquet path on the main process, else None.

        Every process must call it (the results are gathered across processes).
        """
        dataset = self.dataset if self.dataset is not None else self._train_dataset()
        seed = args.eval_seed if self.seed is None else self.seed
        start = time.perf_counter()
        noise = self._measure(dataset, num_samples=self.num_samples, seed=seed)
        seconds = time.perf_counter() - start
        # on every process: under FSDP2 the posterior's σ is sharded, and its summary gathers it (a collective)
        predictor = self._predictor()
        posterior = predictor.posterior
        # the export samples the learned posterior (τ = 1, `compute_label_noise`); τ of the predictions is noted apart
        metadata = {"epoch": state.epoch, "global_step": state.global_step, "num_samples": self.num_samples,
                    "export_seconds": round(seconds, 2), "seed": seed, **posterior.summary(),
                    "posterior_temperature": 1.0,
                    "prediction_posterior_temperature": predictor.temperature,
                    "batchnorm_statistics_per_draw": bool(batchnorm_layers(posterior.model))}  # compute_label_noise
        if not args.should_save:
            return None
        path, summary_path = write_label_noise(noise, args.output_dir, name, metadata)
        if self.plots:
            self._draw(noise, dataset, args.output_dir, name, _model_class_names(posterior.model))
        # the next save keeps these files and lists them in the folder's manifest (they are this run's)
        for written in (path, summary_path, *(os.path.join(args.output_dir, f"{name}_{kind}.png")
                                                for kind in ("smoothed_labels", "extremes"))):
            if os.path.isfile(written):
                self._record_output(written)
        logger.info("Wrote the label noise of %d examples to %s (%d posterior draws, %.1f s)", len(noise), path,
                    self.num_samples, seconds)
        return path

    @staticmethod
    def _draw(noise: datasets.Dataset, dataset: datasets.Dataset, output_dir: str, name: str,
              class_names: list[str] | None) -> None:
        from . import plots  # matplotlib is imported only when pictures are asked for

        if "smoothed_label" in noise.column_names:
            plots.plot_smoothed_labels(noise, output_dir, class_names=class_names,
                                       filename=f"{name}_smoothed_labels.png")
        if plots.find_image_column(dataset) is not None:
            plots.plot_noise_extremes(noise, dataset, output_dir, class_names=class_names,
                                      filename=f"{name}_extremes.png")
        else:
            logger.info("The dataset has no image column: no picture of the highest/lowest-noise examples.")


def _model_class_names(model: Any) -> list[str] | None:
    """The class names of `model`'s config (`id2label`, in class order); None without a config or with transformers'
    placeholders LABEL_k, so that the pictures fall back to the dataset's ClassLabel names."""
    id2label = getattr(getattr(model, "config", None), "id2label", None) or {}
    names = [str(id2label[k]) for k in sorted(id2label, key=int)]
    return None if not names or names == [f"LABEL_{k}" for k in range(len(names))] else names
