"""`EvaluationMetrics`: the `compute_metrics` of `VariationalTrainer`, scoring the prediction `evaluate()` made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers.trainer_utils import EvalPrediction

from .classification import classification_metrics, reliability_diagram

__all__ = ["EvaluationMetrics"]


class EvaluationMetrics:
    """Metrics of the prediction (`classification_metrics` of P̂, the BMA), `mean_*` of the posterior mean beside them,
    what was computed (`describe`), then the user's `compute_metrics`, with inputs and losses passed through as the
    stock Trainer does.

    The user's `compute_metrics` gets as predictions the logits of the prediction, log P̂: logits normalised so that
    softmax(log P̂) = P̂, so what one computes from a stock Trainer's logits (argmax, softmax, cross-entropy) gives the
    class, probabilities and NLL of the prediction made; or, with the user's `preprocess_logits_for_metrics`, what
    that function returned for (log P̂, labels) (`preprocess`).

    The trainer calls `start` before each evaluation with what it predicts; predictions are (log P̂, mean logits), and
    the user's preprocessed log P̂ third when there is a `preprocess_logits_for_metrics`. With
    `batch_eval_metrics` the Trainer calls this once per batch (`compute_result` True on the last): the user's function
    sees every call; these metrics keep the batches' probabilities (N·K numbers) until the last.
    """

    def __init__(self, user_metrics: Callable[..., dict[str, float]] | None = None,
                 user_preprocess: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> None:
        self.user_metrics = user_metrics
        self.user_preprocess = user_preprocess
        #: the names of the metrics the user's `compute_metrics` returned last (the default objective of a search)
        self.user_metric_names: set[str] = set()
        #: per-bin confidence/accuracy/count of the last prediction scored (`reliability_diagram`)
        self.reliability_diagram: dict[str, np.ndarray] | None = None
        self._batches: list[tuple[np.ndarray, ...]] = []
        self._at_mean_only, self._with_mean, self._describe = False, False, {}

    def start(self, *, at_mean_only: bool, with_mean: bool, describe: dict[str, float] | None = None) -> None:
        """Before an evaluation. `at_mean_only`: a BMA was asked for without a posterior, so the prediction is the
        mean's and its metrics are named `mean_*`; `with_mean`: the posterior mean is scored too (as `mean_*`);
        `describe`: entries saying what was computed (posterior temperature, samples averaged)."""
        self._batches = []
        self._at_mean_only, self._with_mean, self._describe = at_mean_only, with_mean, dict(describe or {})

    def preprocess(self, logits: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The trainer's `preprocess_logits_for_metrics` when the user gave one: keeps (log P̂, mean logits), which
        these metrics score, and adds the user's function of (log P̂, labels)."""
        return (*logits, self.user_preprocess(logits[0], labels))

    def user_predictions(self, predictions: tuple[Any, ...] | list[tuple[Any, ...]]) -> Any:
        """What the user's functions see of an evaluation's predictions: the preprocessed ones, else log P̂ (per batch,
        as a list, with `eval_do_concat_batches=False`)."""
        if isinstance(predictions, list):
            return [self.user_predictions(batch) for batch in predictions]
        return predictions[-1] if self.user_preprocess is not None else predictions[0]

    def __call__(self, eval_pred: EvalPrediction, compute_result: bool | None = None) -> dict[str, float]:
        if isinstance(eval_pred.predictions, list):  # eval_do_concat_batches=False: (predictions, labels) per batch
            log_probs, mean_logits = (np.concatenate(parts) for parts in list(zip(*eval_pred.predictions))[:2])
            labels = np.concatenate(eval_pred.label_ids)
        else:
            log_probs, mean_logits = eval_pred.predictions[:2]
            labels = eval_pred.label_ids
        user_pred = EvalPrediction(predictions=self.user_predictions(eval_pred.predictions),
                                   label_ids=eval_pred.label_ids, inputs=eval_pred.inputs, losses=eval_pred.losses)
        user_kwargs = {} if compute_result is None else {"compute_result": compute_result}
        user_metrics = self.user_metrics(user_pred, **user_kwargs) if self.user_metrics is not None else None
        self.user_metric_names |= set(user_metrics or ())
        if compute_result is None:
            log_probs, mean_logits, labels = (np.asarray(a) for a in (log_probs, mean_logits, labels))
        else:
            self._batches.append(tuple(_numpy(a) for a in (log_probs, mean_logits, labels)))
            if not compute_result:
                return {}
            log_probs, mean_logits, labels = (np.concatenate(parts) for parts in zip(*self._batches))
            self._batches = []
        mean_probs = torch.as_tensor(mean_logits).float().softmax(-1).numpy()
        self.reliability_diagram = reliability_diagram(mean_probs if self._at_mean_only else np.exp(log_probs), labels)
        if self._at_mean_only:  # no posterior: name the metrics after the prediction they measure
            metrics = {f"mean_{k}": v for k, v in classification_metrics(mean_probs, labels).items()}
        else:
            metrics = classification_metrics(np.exp(log_probs), labels)
            if self._with_mean:
                metrics.update({f"mean_{k}": v for k, v in classification_metrics(mean_probs, labels).items()})
        metrics.update(self._describe)
        metrics.update(user_metrics or {})
        return metrics


def _numpy(array: Any) -> np.ndarray:
    return array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
