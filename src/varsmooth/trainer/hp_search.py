"""`hyperparameter_search` of `VariationalTrainer`: each trial's settings reach the method and its optimizer, and the
default objective is the stock Trainer's (the evaluation loss), not a sum over the metrics varsmooth adds.

The stock `Trainer._hp_search_setup` sets a trial's values as attributes of `args`; the values of the method's config
fields (IVON's `ess`, LS's `smoothing`, ...) go into a copy of `args.method_config` instead, and the method (with
IVON, which it builds) is rebuilt per trial from both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import BestRun, HPSearchBackend, default_compute_objective

from ..methods import MethodConfig
from .arguments import VariationalTrainingArguments, check_unhonoured_arguments

__all__ = ["HyperparameterSearchMixin", "trial_method_config"]

#: fixed for a whole search: a study compares settings of one method (the presets fill fields at construction)
_NOT_SEARCHABLE = ("method", "method_config", "ivon_preset")


def trial_method_config(args: VariationalTrainingArguments, settings: dict[str, Any]) -> MethodConfig:
    """The method's config for a trial: with the trial's values of its fields (`settings`, e.g. {"smoothing": 0.2}
    for method='ls', {"ess": 1e4} for IVON), checked again."""
    return dataclasses.replace(args.method_config, **settings)


class HyperparameterSearchMixin:
    """`Trainer.hyperparameter_search` for `VariationalTrainer`.

    A trial's hyperparameter space may name `TrainingArguments` fields (`learning_rate`, ...) and the fields of the
    chosen method's config (IVON's `ess`, `hess_init`, `prior_precision`, ...; `smoothing` of method='ls', `sam_rho`,
    ...); all of them reach the method and its optimizer. `method`, `method_config` and `ivon_preset` are
    fixed for a search. A trial setting a field the method cannot honour is refused as at construction.
    """

    def hyperparameter_search(self, hp_space: Callable[[Any], dict[str, Any]] | None = None,
                              compute_objective: Callable[[dict[str, float]], float] | None = None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend: str | HPSearchBackend | None = None,
                              hp_name: Callable[[Any], str] | None = None, **kwargs: Any) -> BestRun | list[BestRun]:
        """As `Trainer.hyperparameter_search`; the default `compute_objective` is `default_objective`."""
        return super().hyperparameter_search(hp_space, compute_objective or self.default_objective, n_trials, direction,
                                             backend, hp_name, **kwargs)

    def default_objective(self, metrics: dict[str, float]) -> float:
        """HF's `default_compute_objective` over what the stock Trainer would report: the evaluation loss (the NLL of
        the prediction), or the sum of the metrics of the user's `compute_metrics` when there is one; the metrics
        varsmooth adds (accuracy, ECE, `posterior_samples_averaged`, ...) are left out."""
        user = {k: v for k, v in metrics.items() if k.removeprefix("eval_") in self._metrics.user_metric_names}
        return default_compute_objective({"eval_loss": metrics.get("eval_loss"), **user})

    def _hp_search_setup(self, trial: Any) -> None:
        if self.hp_search_backend is None or trial is None:
            return super()._hp_search_setup(trial)
        params = dict(self.hp_space(trial) if self.hp_search_backend == HPSearchBackend.OPTUNA else trial)
        fixed = sorted(set(params) & set(_NOT_SEARCHABLE))
        if fixed:
            raise ValueError(f"The hyperparameter space sets {fixed}, which are fixed for a search: build one trainer "
                             "per method (and ivon_preset), and search the method's own settings by name (e.g. "
                             "'smoothing').")
        own = {f.name for f in dataclasses.fields(self.args.method_config) if f.init}
        settings = {k: params.pop(k) for k in list(params) if k in own}
        space = self.hp_space
        self.hp_space = lambda _: params  # the stock setup sets the rest on args (it warns of names it does not know)
        try:
            super()._hp_search_setup(trial if self.hp_search_backend == HPSearchBackend.OPTUNA else params)
        finally:
            self.hp_space = space
        self._trial = trial
        check_unhonoured_arguments(self.args)
        self.args.method_config = trial_method_config(self.args, settings)
        self._build_method()
