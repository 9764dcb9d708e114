"""Post-hoc temperature scaling (Guo et al. 2017, "On Calibration of Modern Neural Networks", §4.2).

The calibrated prediction is softmax(z / T) with one scalar T > 0 fitted by the NLL of a held-out (validation) split.
Here z are the log-probabilities of whatever the model predicts: a network's log-softmax (then softmax(z / T) is
the softmax of its logits divided by T, since log-softmax only shifts the logits), IVON's Bayesian model average
log P̂, an MC-dropout average or an ensemble's average. Rescaling the *pooled* prediction, rather than every draw,
is the "pool-then-calibrate" order that Rahaman & Thiery (2021, "Uncertainty Quantification and Deep Ensembles")
found better calibrated for ensembles; it leaves the argmax, hence the accuracy, unchanged.

The NLL is convex in β = 1/T (a log-sum-exp of β·z minus a linear term), so a 1-D minimisation finds the global
optimum; it is run on log T and the result is kept only if it lowers the validation NLL below that at T = 1.

A fitted T belongs to the weights it was fitted with: `save` records a fingerprint of them, and `load` refuses the
file when the weights differ (a later run saved into the same folder), so a stale T is never applied.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..files import atomic_path
from ..model_parts import AUX_MODULE_NAME
from ..outputs import VariationalClassifierOutput, entropy
from ..posterior.gaussian import weights_fingerprint

__all__ = ["TEMPERATURE_SCALING_FILE", "TemperatureScaling", "network_fingerprint", "scaled_nll"]

#: the file of a saved model folder that holds its fitted temperature T (`TemperatureScaling.save`)
TEMPERATURE_SCALING_FILE = "temperature_scaling.json"
#: the fitted T is kept inside [1/100, 100]: on a validation set the model fits perfectly the NLL keeps falling as
#: T → 0, and such a T would only encode that the validation set was separable
TEMPERATURE_BOUNDS = (1e-2, 1e2)


def scaled_nll(log_probs: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Mean −log softmax(z / T)_y over the rows whose label is not -100 (the HF ignore index)."""
    keep = labels != -100
    z = log_probs[keep] / temperature
    return (torch.logsumexp(z, -1) - z.gather(-1, labels[keep, None]).squeeze(-1)).mean()


def network_fingerprint(network: torch.nn.Module) -> tuple[str, str | None]:
    """(SHA-256, dtype) of the parameters a saved model holds: all of `network`'s, less training-only method heads
    (they are not saved with the model, see `varsmooth.methods.heads`; `varsmooth.model_parts`)."""
    names = [name for name, _ in network.named_parameters() if AUX_MODULE_NAME not in name.split(".")]
    params = dict(network.named_parameters())
    dtypes = sorted({str(params[name].dtype) for name in names})
    return weights_fingerprint(network, names), ",".join(dtypes) or None


@dataclass
class TemperatureScaling:
    """A fitted temperature T: `calibrate` turns a prediction's log-probabilities z into log softmax(z / T).

    Attributes:
        temperature: T > 0 (1 is the identity).
        nll_uncalibrated / nll_calibrated: validation NLL at T = 1 and at T.
        num_examples: validation examples T was fitted on.
        prediction: how the calibrated prediction is made (e.g. {"kind": "bma", "num_samples": 32}); loading warns
            when the model is set to predict otherwise.
    """

    temperature: float = 1.0
    nll_uncalibrated: float | None = None
    nll_calibrated: float | None = None
    num_examples: int | None = None
    prediction: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"The temperature must be a finite number > 0 (1 = no scaling), got {self.temperature!r}.")
        self.temperature = float(self.temperature)

    # -- fitting -----------------------------------------------------------------------------------
    @classmethod
    def fit(cls, log_probs: Any, labels: Any, prediction: dict[str, Any] | None = None) -> "TemperatureScaling":
        """Fit T by the NLL of `labels` under softmax(`log_probs` / T) (inputs are not modified).

        Args:
            log_probs: (N, K) log-probabilities or logits of the validation predictions.
            labels: (N,) class ids; -100 entries are skipped.
            prediction: recorded with T (see the class docstring).
        """
        z = torch.as_tensor(np.asarray(log_probs), dtype=torch.float64)
        y = torch.as_tensor(np.asarray(labels)).long()
        if z.ndim != 2 or y.shape != z.shape[:1]:
            raise ValueError(f"Expected log_probs of shape (N, K) and labels of shape (N,), got {tuple(z.shape)} and "
                             f"{tuple(y.shape)}.")
        keep = y != -100
        if not keep.any():
            raise ValueError("Temperature scaling got no labelled validation example: fit it on a validation split "
                             "with labels.")
        if y[keep].min() < 0 or y[keep].max() >= z.shape[1]:
            raise ValueError(f"Labels must lie in [0, {z.shape[1]}); got range [{int(y[keep].min())}, "
                             f"{int(y[keep].max())}].")
        # a class the model gives probability 0 has z = -inf; a large finite value keeps the gradient finite
        z = z.clamp_min(-1e4)
        if not torch.isfinite(z).all():
            raise ValueError("The validation predictions are not finite (NaN or +inf): temperature scaling cannot be "
                             "fitted.")
        log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=100, tolerance_grad=1e-10, tolerance_change=1e-12,
                                      line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = scaled_nll(z, y, log_t.exp())
            loss.backward()
            return loss

        optimizer.step(closure)
        low, high = TEMPERATURE_BOUNDS
        fitted = float(min(max(math.exp(log_t.item()), low), high))
        with torch.no_grad():
            before, after = float(scaled_nll(z, y, 1.0)), float(scaled_nll(z, y, fitted))
        if not after < before:  # the optimum is T = 1 (up to rounding): keep the identity
            fitted, after = 1.0, before
        return cls(temperature=fitted, nll_uncalibrated=before, nll_calibrated=after, num_examples=int(keep.sum()),
                   prediction=dict(prediction or {}))

    # -- prediction --------------------------------------------------------------------------------
    def calibrate_log_probs(self, log_probs: torch.Tensor) -> torch.Tensor:
        """log softmax(z / T)."""
        return torch.log_softmax(log_probs.float() / self.temperature, -1)

    def calibrate(self, output: VariationalClassifierOutput) -> VariationalClassifierOutput:
        """The output with `logits`, `probs` and `entropy` of the calibrated prediction.

        `mean_logits`/`mean_probs` (the prediction at the weights) and `mutual_information` (the disagreement between
        the draws, which a rescaling of their average does not change) stay as they were.
        """
        log_probs = self.calibrate_log_probs(output.logits)
        probs = log_probs.exp()
        return replace(output, logits=log_probs, probs=probs, entropy=entropy(probs))

    # -- files -------------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike, network: torch.nn.Module) -> str:
        """Write `temperature_scaling.json` into `folder` (whole or not at all), bound to `network`'s weights."""
        sha, dtype = network_fingerprint(network)
        path = os.path.join(os.fspath(folder), TEMPERATURE_SCALING_FILE)
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": 1, **asdict(self), "weights_sha256": sha, "weights_dtype": dtype}, f, indent=2)
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike, network: torch.nn.Module) -> "TemperatureScaling | None":
        """The temperature saved in `folder` (a folder or the file itself) for `network`, or None if there is none.

        Refuses (naming the file) a file that is unreadable or was fitted for other weights than `network`'s.
        """
        path = os.fspath(folder)
        if os.path.isdir(path):
            path = os.path.join(path, TEMPERATURE_SCALING_FILE)
        if not os.path.isfile(path):
            return None
        from ..files import check_manifest

        check_manifest(os.path.dirname(os.path.abspath(path)), [os.path.basename(path)])  # edited after the save
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            scaling = cls(**{key: raw[key] for key in ("temperature", "nll_uncalibrated", "nll_calibrated",
                                                        "num_examples", "prediction") if key in raw})
            expected, expected_dtype = raw["weights_sha256"], raw.get("weights_dtype")
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a valid temperature-scaling file ({type(error).__name__}: {error}). "
                             f"Fit and save it again, or delete it to predict without temperature scaling.") from None
        sha, dtype = network_fingerprint(network)
        if dtype != expected_dtype:
            warnings.warn(f"The weights are {dtype} but {path} was fitted for {expected_dtype} weights: its "
                          "fingerprint cannot be checked. Load the model in that dtype to check it.", UserWarning,
                          stacklevel=2)
        elif sha != expected:
            raise ValueError(
                f"{path} was fitted for other weights than the model's (their fingerprint differs): the weights were "
                "replaced after the temperature was fitted (e.g. a later run saved into the same folder). Fit it again "
                "on the validation split (trainer.fit_temperature_scaling(), then save), or delete "
                f"{TEMPERATURE_SCALING_FILE}."
            )
        return scaling

    def check_prediction(self, prediction: dict[str, Any], source: str) -> None:
        """Warn when the model predicts otherwise (other number of draws, posterior temperature...) than T was fitted
        for."""
        differs = {k: (v, prediction.get(k)) for k, v in self.prediction.items() if prediction.get(k) != v}
        if differs:
            warnings.warn(
                f"The temperature {self.temperature:.4g} of {source} was fitted for another prediction than the one "
                f"now made ({', '.join(f'{k}: fitted {a!r}, now {b!r}' for k, (a, b) in differs.items())}); it may not "
                "calibrate this one. Predict as it was fitted, or fit it again.", UserWarning, stacklevel=3)
