"""`transformers` pipelines whose scores are posterior-averaged probabilities (Bayesian model averaging).

    classify = varsmooth.pipeline("image-classification", model="user/repo")
    classify(image)                               # [{"label": ..., "score": P̂(label | image)}, ...]
    classify(image, return_uncertainty=True)      # {"predictions": [...], "entropy": H[P̂], "expected_entropy": ...,
                                                  #  "mutual_information": ..., "uncertainty_temperature": τ of the
                                                  #  draws that measured them}

With `return_uncertainty=True` both tasks answer in one shape: a dict for one input (a list of them for a list of
inputs) whose "predictions" is a list of {"label", "score"} (the stock text pipeline's top label alone, in a list).

The uncertainty is one measurement (`Predictor.uncertainty`): the entropy H[P̂] of the uncalibrated average of the
draws, their mean entropy ("expected_entropy") and the mutual information, their difference, so the mutual information
never exceeds the entropy beside it. The draws are the prediction's own; a model that predicts at its posterior mean
(τ = 0) reports all three under the learned posterior (τ = 1) instead, while its labels and scores stay those at τ = 0.
A model without a posterior reports the entropy of its prediction and None for the other two.

The model may also be a deep-ensemble folder (`varsmooth.DeepEnsemble`), and a temperature fitted by temperature
scaling and saved with the model is applied. The pipeline classes can also be passed to
`transformers.pipeline(..., pipeline_class=...)`; they then read the posterior and the temperature from the model's
folder or repo.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import transformers
from transformers import ImageClassificationPipeline, TextClassificationPipeline
from transformers.image_utils import load_image

from ..adapters import is_peft_model
from .modeling import VariationalModel, predictive_model
from .predictors import PredictiveModel

__all__ = ["VariationalImageClassificationPipeline", "VariationalTextClassificationPipeline", "pipeline"]


class _VariationalMixin:
    """Replaces the pipeline's forward pass by `variational_model`: a `VariationalModel` around the pipeline's model
    (BMA over `num_samples` posterior draws, the trainer's draws for the same seed) or a `DeepEnsemble` of which it is
    member 0."""

    def __init__(self, *args: Any, num_samples: int | None = None,
                 seed: int | None = None, variational_model: PredictiveModel | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # built by `transformers.pipeline(..., pipeline_class=...)`, which loaded the model
        if variational_model is None:
            variational_model = predictive_model(self.model, self.model.name_or_path, num_samples=num_samples,
                                                 seed=seed)
        # the pipeline has moved its model (member 0 of an ensemble) to its device: the other members follow
        self.variational_model = variational_model.to(self.model.device)

    def __call__(self, inputs: Any, **kwargs: Any) -> Any:
        if isinstance(inputs, (list, tuple)) and len(inputs) == 0:  # the stock pipeline fails with an IndexError
            raise ValueError("The pipeline got an empty list of inputs: pass one input or a non-empty list.")
        return super().__call__(inputs, **kwargs)

    def _sanitize_parameters(self, return_uncertainty: bool | None = None, **kwargs: Any) -> tuple[dict, dict, dict]:
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        if return_uncertainty is not None:
            forward["return_uncertainty"] = postprocess["return_uncertainty"] = return_uncertainty
        return preprocess, forward, postprocess

    def _forward(self, model_inputs: dict[str, Any], return_uncertainty: bool = False) -> dict[str, Any]:
        if not return_uncertainty:  # log P̂ as "logits": the pipeline's softmax turns them back into P̂
            return {"logits": self.variational_model(**model_inputs).logits}
        out, measured = self.variational_model.predict_with_uncertainty(**model_inputs)
        measured_with = (None if measured.mutual_information is None
                         else self.variational_model.predictor.uncertainty_temperature)
        return {"logits": out.logits, "entropy": measured.entropy, "mutual_information": measured.mutual_information,
                "uncertainty_temperature": measured_with}

    def postprocess(self, model_outputs: dict[str, Any], return_uncertainty: bool = False, **kwargs: Any) -> Any:
        result = super().postprocess(model_outputs, **kwargs)
        if not return_uncertainty:
            return result
        entropy, mi = float(model_outputs["entropy"].reshape(-1)[0]), model_outputs["mutual_information"]
        mi = None if mi is None else float(mi.reshape(-1)[0])
        return {"predictions": result if isinstance(result, list) else [result], "entropy": entropy,
                "expected_entropy": None if mi is None else entropy - mi, "mutual_information": mi,
                "uncertainty_temperature": model_outputs["uncertainty_temperature"]}


def _num_channels(config: Any) -> int:
    """Input channels of an image classifier: `num_channels` of transformers' vision configs, or the `in_chans` a
    `TimmWrapperConfig` builds its timm model with (it has no `num_channels`); 3 when neither says."""
    channels = getattr(config, "num_channels", None)
    if channels is None:
        channels = (getattr(config, "model_args", None) or {}).get("in_chans")
    return 3 if channels is None else int(channels)


class VariationalImageClassificationPipeline(_VariationalMixin, ImageClassificationPipeline):
    """`ImageClassificationPipeline` with posterior-averaged scores; grayscale models get grayscale images."""

    def preprocess(self, image: Any, timeout: float | None = None) -> Any:
        channels = _num_channels(self.model.config)
        if isinstance(image, np.ndarray) and image.ndim == 2:
            # a (height, width) array is a grayscale image; image processors take only arrays with a channel axis
            image = np.repeat(image[..., None], channels, axis=-1)
        # `load_image` always converts to RGB, which a 1-channel model (e.g. trained on digits) cannot take
        if channels != 1 or isinstance(image, (np.ndarray, torch.Tensor)):
            return super().preprocess(image, timeout=timeout)
        image = load_image(image, timeout=timeout).convert("L")
        return self.image_processor(images=image, return_tensors="pt").to(self.dtype)


class VariationalTextClassificationPipeline(_VariationalMixin, TextClassificationPipeline):
    """`TextClassificationPipeline` with posterior-averaged scores; texts longer than the model takes are truncated."""

    def __call__(self, inputs: Any, **kwargs: Any) -> Any:
        result = super().__call__(inputs, **kwargs)
        # the stock pipeline wraps one text's answer in a list (its legacy shape); with the uncertainty, one input
        # gets one dict, as from the image pipeline
        if kwargs.get("return_uncertainty") and isinstance(inputs, str) and isinstance(result, list):
            return result[0]
        return result

    def preprocess(self, inputs: Any, **tokenizer_kwargs: Any) -> Any:
        # a text longer than the position embeddings would fail inside the model with a tensor-size error
        tokenizer_kwargs.setdefault("truncation", True)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if (tokenizer_kwargs["truncation"] and limit and "max_length" not in tokenizer_kwargs
                and self.tokenizer.model_max_length > limit):
            tokenizer_kwargs["max_length"] = limit  # the tokenizer does not know the model's limit
        return super().preprocess(inputs, **tokenizer_kwargs)


_PIPELINES = {"image-classification": VariationalImageClassificationPipeline,
              "text-classification": VariationalTextClassificationPipeline}


def pipeline(task: str, model: str | os.PathLike, *, num_samples: int | None = None, seed: int | None = None,
             temperature: float | None = None, mc_dropout_samples: int = 0, temperature_scaling: bool = True,
             **kwargs: Any) -> Any:
    """`transformers.pipeline` for a varsmooth model or deep-ensemble folder (or Hub repo) that predicts with its
    posterior (or by MC dropout with `mc_dropout_samples > 0`), calibrated by the temperature saved with it unless
    `temperature_scaling=False`. `num_samples`, `seed` and the posterior `temperature` τ default to those chosen in
    training (`VariationalModel.from_pretrained`)."""
    if task not in _PIPELINES:
        raise ValueError(f"varsmooth pipelines support {sorted(_PIPELINES)}, got {task!r}.")
    loaded = VariationalModel.from_pretrained(model, num_samples=num_samples, seed=seed, temperature=temperature,
                                              mc_dropout_samples=mc_dropout_samples,
                                              temperature_scaling=temperature_scaling,
                                              **{k: kwargs.pop(k) for k in ("revision", "token") if k in kwargs})
    # the pipeline runs one transformers model (an ensemble's first member's); an adapter model runs as its base with
    # the adapters injected (the pipeline knows only transformers classes), and the posterior still samples the adapter
    # weights, which are the same tensors
    first = next(module for module in loaded.modules() if isinstance(module, VariationalModel)).model
    network = first.get_base_model() if is_peft_model(first) else first
    return transformers.pipeline(task, model=network, pipeline_class=_PIPELINES[task], variational_model=loaded,
                                 **({"tokenizer": os.fspath(model)} if task == "text-classification"
                                    else {"image_processor": os.fspath(model)}),
                                 **kwargs)
