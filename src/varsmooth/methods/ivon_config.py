"""`IVONConfig`: every setting of IVON, declared, defaulted (from its `ivon_preset`) and checked in one place; the
ranges of those the optimizer takes are `varsmooth.posterior.settings.SETTING_RANGES`."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from ..posterior.settings import USER_NAMES, check_ivon_setting
from ..presets import (
    DEFAULT_HESSIAN_WINDOW,
    FINETUNE_PRESET,
    IVON_PRESETS,
    LORA_PRESET,
    MIN_HESSIAN_WINDOW_STEPS,
    SCRATCH_PRESET,
    choose_preset,
    newly_initialized_modules,
)
from .base import MethodConfig

__all__ = ["IVONConfig"]

logger = logging.getLogger(__name__)

#: the preset values that are fields of IVONConfig (the others are `VariationalTrainingArguments`' or β2's rule)
_PRESET_FIELDS = frozenset({"ess", "hess_init", "prior_precision", "clip_radius", "rescale_lr", "new_weight_lr_scale"})


def _preset_default(name: str) -> str:
    return (f"Default (None): {SCRATCH_PRESET[name]} with ivon_preset scratch, {FINETUNE_PRESET[name]} with finetune, "
            f"{LORA_PRESET[name]} with lora.")


@dataclass
class IVONConfig(MethodConfig):
    """IVON's settings (`VariationalTrainingArguments(method_config=IVONConfig(ess=1e4))`, or `--ess 1e4` after
    `--method ivon` in the examples). The preset-controlled fields default to None ("not set") and `__post_init__`
    fills them from `ivon_preset`, so a value the user gives is kept even when it equals another preset's. None left
    after that means "decided by the run": `ess` the training-set size, `beta2` the run-length rule, `clip_radius`
    none (0.05 under the run-length rule)."""

    ivon_preset: str | None = field(
        default=None,
        metadata={"help": "IVON defaults: 'scratch' (the authors' recipe), 'finetune' (a pretrained model: posterior "
                          "around the pretrained weights, bounded steps; see varsmooth.presets.FINETUNE_PRESET) or "
                          "'lora' (LoRA adapters: Cong et al. 2024's IVON-LoRA recipe, varsmooth.presets.LORA_PRESET). "
                          "Default (None): chosen by VariationalTrainer from the model it is handed "
                          "(varsmooth.presets.choose_preset: peft adapters lora, weights loaded from a checkpoint "
                          "finetune, else scratch). Fields you set keep their value.",
                  "choices": list(IVON_PRESETS)},
    )
    ess: float | None = field(
        default=None,
        metadata={"help": "IVON effective sample size λ (Eq. 6 of 'Variational Learning Induces Adaptive Label "
                          "Smoothing'). Default: the number of training examples (1e8 with ivon_preset finetune, 1e7 "
                          "with lora)."},
    )
    hess_init: float | None = field(
        default=None,
        metadata={"help": "IVON initial Hessian h0 (> 0); sets the initial posterior std 1/sqrt(ess (h0 + "
                          "prior_precision)). " + _preset_default("hess_init")},
    )
    beta1: float = field(default=0.9, metadata={"help": "IVON gradient momentum β1."})
    beta2: float | None = field(
        default=None,
        metadata={"help": "IVON Hessian EMA rate β2 (1 = fixed Hessian). Default (None): the preset's (0.99999 scratch "
                          "and lora, 0.999 finetune) when the run is long enough for it to move the Hessian (1 - β2^T "
                          ">= 0.1) or of unknown length, else the run-length rule of hessian_window "
                          "(varsmooth.presets.default_beta2). A number fixes β2."},
    )
    hessian_window: float = field(
        default=DEFAULT_HESSIAN_WINDOW,
        metadata={"help": f"The run-length rule for runs too short for the preset's β2 (beta2 unset): β2 = 1 - "
                          f"1/max(hessian_window * T, {MIN_HESSIAN_WINDOW_STEPS}), T = the run's optimizer steps "
                          "(varsmooth.presets), so the Hessian averages over the last fraction hessian_window of the "
                          "run and the posterior learns whatever the run's length; clip_radius then defaults to 0.05 "
                          "with ivon_preset scratch. See benchmarks/README.md, 'The default posterior'."},
    )
    prior_precision: float | None = field(
        default=None,
        metadata={"help": "IVON weight decay δ = precision of the Gaussian prior (ivon-opt's weight_decay). Replaces "
                          "`weight_decay`, which is refused with IVON methods. " + _preset_default("prior_precision")},
    )
    ivon_smoothing: float | None = field(
        default=None,
        metadata={"help": "How much IVON smooths the labels, as label smoothing's rate α in (0, 1]: ess is rescaled "
                          "during training so that the mean label noise ‖ε̄‖₁ over a probe of training examples is α "
                          "times the mean ‖p̂ - 1/K‖₁ of the posterior mean's predictions p̂ (LS's α(u - y) with p̂ for "
                          "y: 2α(1 - 1/K) where the mean is certain; varsmooth.label_noise.strength); ess is then "
                          "where it starts. Choose it on noisy validation as you would α. None: ess stays as given "
                          "(the preset's)."},
    )
    frozen_mean_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules (names or name suffixes, as peft's target_modules) whose weights stay in the "
                          "posterior with their mean frozen: IVON learns their σ from the data's curvature but never "
                          "moves them from the loaded (pretrained) values (learning rate 0). Weights the training data "
                          "never reaches, such as the embedding rows of tokens it lacks, then keep a wide σ and draws "
                          "disagree on inputs that use them. None: every trainable weight is trained."},
    )
    new_weight_lr_scale: float | None = field(
        default=None,
        metadata={"help": "Learning-rate multiplier for the weights the checkpoint did not provide "
                          "(new_weight_modules: by default those from_pretrained newly initialised, such as a new "
                          "classification head). They start from a random initialisation, not a pretrained optimum, "
                          "and under a clipped preset's sign step (at most lr·clip_radius a step for every weight) "
                          "would move no faster than the pretrained ones. Default (None): 1 with every preset; 30 "
                          "lifted a pretrained EfficientNet-Lite0's noisy-validation accuracy by 11 points, a "
                          "MiniLM's not at all (benchmarks/studies/hf_finetune.md)."},
    )
    new_weight_modules: list[str] | None = field(
        default=None,
        metadata={"help": "The modules (names or name suffixes, as frozen_mean_modules) whose weights train at "
                          "new_weight_lr_scale times the learning rate. None: those whose weights transformers' "
                          "from_pretrained newly initialised (the MISSING and MISMATCHED rows of its load report), "
                          "found when the trainer is built (varsmooth.presets.newly_initialized_modules); a model "
                          "transformers did not load (timm.create_model) needs them named."},
    )
    mc_samples: int = field(default=1, metadata={"help": "Posterior samples (forward+backward) per micro-batch during "
                                                         "training."})
    ivon_compiled: bool | None = field(
        default=None,
        metadata={"help": "IVON's compiled kernels (torch.compile; varsmooth.posterior.VariationalIVON's `compiled`): "
                          "None uses them where torch.compile works (a C++ compiler on the CPU, Triton on GPUs), "
                          "else warns and uses foreach ops; true requires them; false uses foreach ops."},
    )
    ivon_foreach: bool | None = field(
        default=None,
        metadata={"help": "IVON's implementation, as torch.optim's `foreach` (varsmooth.posterior.VariationalIVON's "
                          "`foreach`): None or true, the foreach kernels (compiled per ivon_compiled); false, the "
                          "for-loop reference, one function per formula of the paper (kernels._single_tensor_ivon): "
                          "slower, for reading and checking. Not with ivon_compiled true."},
    )
    clip_radius: float | None = field(
        default=None,
        metadata={"help": "IVON element-wise clipping of the preconditioned update (None = no clipping). Gradient-norm "
                          "clipping (`max_grad_norm`) is applied inside each sample, before IVON reads the gradient. "
                          "Default: 1e-3 with ivon_preset finetune and lora."},
    )
    rescale_lr: bool | None = field(
        default=None,
        metadata={"help": "Multiply lr by (hess_init + prior_precision), ivon-opt's default (`--rescale_lr false` to "
                          "turn it off). " + _preset_default("rescale_lr")},
    )

    def __post_init__(self) -> None:
        if self.ivon_preset is not None and self.ivon_preset not in IVON_PRESETS:
            raise ValueError(f"ivon_preset must be one of {list(IVON_PRESETS)} or None (chosen from the model), got "
                             f"{self.ivon_preset!r}.")
        for name, value in self._preset().items():
            if self.ivon_preset is not None and name in _PRESET_FIELDS and getattr(self, name) is None:
                setattr(self, name, value)
        # a count: 2.5 would fail mid-run
        if (isinstance(self.mc_samples, bool) or not isinstance(self.mc_samples, numbers.Real)
                or not float(self.mc_samples).is_integer()):
            raise ValueError(f"mc_samples is a number of samples, a whole number, got {self.mc_samples!r}: pass e.g. "
                             "mc_samples=2.")
        self.mc_samples = int(self.mc_samples)
        if self.mc_samples < 1:
            raise ValueError(f"mc_samples must be >= 1, got {self.mc_samples}.")
        # None: decided by the run, which the optimizer then checks
        for keyword in ("ess", "hess_init", "beta1", "beta2", "weight_decay", "clip_radius"):
            name = USER_NAMES.get(keyword, keyword)
            if getattr(self, name) is not None:
                check_ivon_setting(keyword, getattr(self, name), called=name)
        if not 0 < self.hessian_window < math.inf:
            raise ValueError(f"hessian_window must be finite and > 0 (a fraction of the run's steps), got "
                             f"{self.hessian_window}; to fix β2 instead, pass beta2.")
        if isinstance(self.frozen_mean_modules, str):  # one name, not its characters
            self.frozen_mean_modules = [self.frozen_mean_modules]
        if isinstance(self.new_weight_modules, str):
            self.new_weight_modules = [self.new_weight_modules]
        if self.new_weight_lr_scale is not None and not 0 < self.new_weight_lr_scale < math.inf:
            raise ValueError(f"new_weight_lr_scale multiplies the learning rate of the new weights: a finite number "
                             f"> 0 (1: the same rate as the others), got {self.new_weight_lr_scale}.")
        if self.ivon_smoothing is not None and not 0 < self.ivon_smoothing <= 1:
            raise ValueError(f"ivon_smoothing is a label-smoothing rate α in (0, 1] (or None: ess as given), got "
                             f"{self.ivon_smoothing}.")

    def _preset(self) -> dict[str, float | bool]:
        return {**SCRATCH_PRESET, **IVON_PRESETS[self.ivon_preset or "scratch"]}

    def training_argument_defaults(self) -> dict[str, Any] | None:
        """The preset's learning rate (finetune and lora) and posterior samples per prediction; None while the preset
        is to be chosen from the model (`for_model`)."""
        if self.ivon_preset is None:
            return None
        return {name: value for name, value in self._preset().items() if name in ("learning_rate", "eval_mc_samples")}

    def for_model(self, model: Any) -> tuple[IVONConfig, str]:
        """This config with its preset chosen for `model` where none was named (`varsmooth.presets.choose_preset`)
        and, where the new weights train at their own rate, the modules `from_pretrained` newly initialised
        (`varsmooth.presets.newly_initialized_modules`: read now, before a wrapper such as FSDP2's replaces the
        weights), with a sentence saying which preset and why; `scratch` named for a loaded model warns."""
        chosen, reason = choose_preset(model)
        if self.ivon_preset is None:
            config = dataclasses.replace(self, ivon_preset=chosen)
            choice = f"ivon_preset={chosen!r}, chosen because {reason}"
        else:
            config, choice = self, f"ivon_preset={self.ivon_preset!r}, as given"
        if self.ivon_preset == "scratch" and chosen != "scratch":
            logger.warning("ivon_preset='scratch' given, but %s: the scratch preset (lr 0.2, h0 0.5, ess = N) "
                           "is the authors' recipe for training from scratch and leaves a fine-tune at chance "
                           "accuracy; leave ivon_preset unset (%r is chosen) unless you mean it.", reason, chosen)
        if config.new_weight_lr_scale != 1 and config.new_weight_modules is None:
            modules = newly_initialized_modules(model)
            if modules is None:
                logger.warning("new_weight_lr_scale=%g, but no weight of the model carries the mark transformers' "
                               "from_pretrained leaves on the weights it loaded, so nothing tells its new weights: "
                               "every weight trains at one rate. Name the new modules with new_weight_modules (e.g. "
                               "['classifier'] for a timm model's head).", config.new_weight_lr_scale)
            config = dataclasses.replace(config, new_weight_modules=modules or [])
            if modules:
                choice += (f"; the weights from_pretrained newly initialised ({', '.join(modules)}) train at "
                           f"{config.new_weight_lr_scale:g}× the rate")
        return config, choice

    def long_run_beta2(self) -> float:
        """The preset's β2, kept in runs long enough for it to move the Hessian (`varsmooth.presets.default_beta2`)."""
        return float(self._preset()["long_run_beta2"])
