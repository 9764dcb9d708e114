"""IVON (Shen et al. 2024, Variational Learning is Effective for Large Deep Networks) — training by variational
learning, the method of "Variational Learning Induces Adaptive Label Smoothing" (2025) — and its fixed-Hessian ablation.

`IVONConfig` declares, defaults (from its `ivon_preset`) and checks every IVON setting; the method and its optimizer
take them from it as they are, but for `prior_precision`, which ivon-opt's optimizer calls `weight_decay`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..label_noise.strength import SmoothingStrengthCallback
from ..posterior.gaussian import _reshard
from ..posterior.optimizer import VariationalIVON
from ..presets import (
    DEFAULT_HESSIAN_WINDOW,
    FINETUNE_PRESET,
    HESSIAN_WINDOW_CLIP_RADIUS,
    IVON_PRESETS,
    LORA_PRESET,
    MIN_HESSIAN_WINDOW_STEPS,
    MIN_STEP_BOUND,
    SCRATCH_PRESET,
    choose_preset,
    default_beta2,
)
from .base import MethodConfig, MethodContext, OptimizerContext, TrainingMethod, get_method_class, register_method

__all__ = ["IVONConfig", "IVONFixedHessianMethod", "IVONMethod", "check_ivon_sharding", "learns_posterior"]

logger = logging.getLogger(__name__)


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
    mc_samples: int = field(default=1, metadata={"help": "Posterior samples (forward+backward) per micro-batch during "
                                                         "training."})
    ivon_compiled: bool | None = field(
        default=None,
        metadata={"help": "IVON's compiled kernels (torch.compile; varsmooth.posterior.VariationalIVON's `compiled`): "
                          "None uses them where torch.compile works (a C++ compiler on the CPU, Triton on GPUs), "
                          "else warns and uses foreach ops; true requires them; false uses foreach ops."},
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
        if self.hess_init is not None and not 0 < self.hess_init < math.inf:
            raise ValueError("hess_init must be finite and > 0 (IVON's posterior std is 1/sqrt(ess (h + δ))), got "
                             f"{self.hess_init}.")
        if not 0.0 <= (self.beta2 if self.beta2 is not None else 0.0) <= 1.0 or not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"Need 0 <= beta1 < 1 and 0 <= beta2 <= 1, got beta1={self.beta1}, beta2={self.beta2}.")
        if self.prior_precision is not None and not 0 <= self.prior_precision < math.inf:
            raise ValueError(f"prior_precision must be finite and >= 0, got {self.prior_precision}.")
        if self.ess is not None and not 0 < self.ess < math.inf:
            raise ValueError(f"ess must be finite and > 0, got {self.ess}.")
        if not 0 < self.hessian_window < math.inf:
            raise ValueError(f"hessian_window must be finite and > 0 (a fraction of the run's steps), got "
                             f"{self.hessian_window}; to fix β2 instead, pass beta2.")
        if self.clip_radius is not None and not self.clip_radius > 0:
            raise ValueError(f"clip_radius must be > 0 or None, got {self.clip_radius}.")
        if isinstance(self.frozen_mean_modules, str):  # one name, not its characters
            self.frozen_mean_modules = [self.frozen_mean_modules]
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
        """This config with its preset chosen for `model` where none was named (`varsmooth.presets.choose_preset`),
        and a sentence saying which preset and why; `scratch` named for a model loaded from a checkpoint warns."""
        chosen, reason = choose_preset(model)
        if self.ivon_preset is None:
            return dataclasses.replace(self, ivon_preset=chosen), f"ivon_preset={chosen!r}, chosen because {reason}"
        if self.ivon_preset == "scratch" and chosen != "scratch":
            logger.warning("ivon_preset='scratch' given, but %s: the scratch preset (lr 0.2, h0 0.5, ess = N) "
                           "is the authors' recipe for training from scratch and leaves a fine-tune at chance "
                           "accuracy; leave ivon_preset unset (%r is chosen) unless you mean it.", reason, chosen)
        return self, f"ivon_preset={self.ivon_preset!r}, as given"

    def long_run_beta2(self) -> float:
        """The preset's β2, kept in runs long enough for it to move the Hessian (`varsmooth.presets.default_beta2`)."""
        return float(self._preset()["long_run_beta2"])


def _in_module(parameter_name: str, module: str) -> bool:
    """Whether the parameter belongs to the module named `module` or to one whose name ends in `.module` (peft's
    target_modules rule)."""
    owner = parameter_name.rpartition(".")[0]
    return owner == module or owner.endswith("." + module)


#: the preset values that are fields of IVONConfig (the others are `VariationalTrainingArguments`' or β2's rule)
_PRESET_FIELDS = frozenset({"ess", "hess_init", "prior_precision", "clip_radius", "rescale_lr"})


def learns_posterior(method: "str | TrainingMethod | type[TrainingMethod]") -> bool:
    """Whether a method (its name, class or instance) learns a posterior, which predictions then average over."""
    cls = get_method_class(method) if isinstance(method, str) else method if isinstance(method, type) else type(method)
    return issubclass(cls, IVONMethod)


def check_ivon_sharding(fsdp_version: int | None, deepspeed: bool) -> None:
    """Refuse what IVON cannot train under: FSDP1 (its FlatParameters hide the per-parameter weights IVON samples
    and keeps state for) and DeepSpeed (ZeRO steps the optimizer itself, outside IVON's weight sampling); FSDP2
    (`fully_shard`, DTensor parameters) is supported. `fsdp_version` is None without FSDP."""
    if deepspeed:
        raise ValueError(
            "IVON is not supported with DeepSpeed: ZeRO partitions and steps the optimizer itself, outside IVON's "
            "weight sampling. Shard with FSDP2 instead (fsdp='full_shard', fsdp_config={'version': 2}; or "
            "`accelerate launch` with fsdp_version: 2), or use DDP (accelerate launch --multi_gpu)."
        )
    if fsdp_version is not None and int(fsdp_version) != 2:
        raise ValueError(
            f"IVON needs FSDP2 (fully_shard, DTensor parameters), got FSDP version {fsdp_version}: FSDP1 flattens the "
            "weights into FlatParameters that IVON cannot sample per parameter. Set fsdp_config={'version': 2} "
            "(--fsdp_config '{\"version\": 2}', or fsdp_version: 2 in the accelerate config), or use DDP."
        )

class IVONMethod(TrainingMethod):
    """Cross-entropy minimised in expectation over q = N(m, diag σ²) by IVON (variational learning).

    The objective is Eq. 6 of "Variational Learning Induces Adaptive Label Smoothing" with λ = `ess`; the update is
    Shen et al. 2024, Alg. 1.
    """

    paper: ClassVar[str] = ("Shen et al. 2024, Variational Learning is Effective for Large Deep Networks; Variational "
                            "Learning Induces Adaptive Label Smoothing (2025)")
    config: IVONConfig
    default_learning_rate: ClassVar[float] = 0.2
    scratch_learning_rate: ClassVar[float | None] = None
    #: optimizer steps of the run, known when IVON is built (`create_optimizer`; for the run-length β2 rule)
    total_steps: int | None = None
    #: the run's peak learning rate (`TrainingArguments.learning_rate`), known when IVON is built
    learning_rate: float | None = None
    #: the gradient norm of the last posterior sample, before clipping (what the Trainer logs as grad_norm)
    last_grad_norm: torch.Tensor | None = None

    def create_optimizer(self, named_parameters: list[tuple[str, torch.nn.Parameter]],
                         run: OptimizerContext) -> VariationalIVON:
        """IVON over the trainable `named_parameters` with `ivon_settings()` for a run of `run.total_steps` steps, the
        `frozen_mean_modules`' weights in a group of their own at learning rate 0."""
        params = [p for _, p in named_parameters]
        low_precision = sorted({str(p.dtype) for p in params if p.dtype not in (torch.float32, torch.float64)})
        if low_precision:
            raise ValueError(
                f"IVON needs fp32 trainable weights, found {low_precision}: in bf16 β2=0.99999 rounds to 1 and the "
                "Hessian never updates. Load the model in float32 and use bf16=True for mixed precision."
            )
        self.total_steps = run.total_steps
        self.learning_rate = self.default_learning_rate if run.learning_rate is None else run.learning_rate
        self.check_step_bound()
        return VariationalIVON(self.param_groups(named_parameters), sample_seed=run.seed, rank=run.rank,
                               compiled=self.config.ivon_compiled, sync=run.sync, **self.ivon_settings())

    def check_step_bound(self) -> None:
        """Refuse, before the first step, a learning rate whose largest step of a weight, lr·clip_radius, is below
        `MIN_STEP_BOUND`: an AdamW habit (2e-5, 5e-5) given to a clipped preset (finetune, lora), whose lr multiplies
        an update clipped to ±clip_radius, moves no weight measurably (2e-5 under finetune: 2e-8 a step; a MiniLM
        fine-tune ended near chance, 54.3 %, against AdamW's 90.0 % at 5e-5)."""
        radius = self.config.clip_radius
        if radius is None or self.learning_rate * radius >= MIN_STEP_BOUND:
            return
        preset_rate = IVON_PRESETS[self.config.ivon_preset or "scratch"].get("learning_rate")
        fix = (f"leave learning_rate unset for the {self.config.ivon_preset!r} preset's {preset_rate:g} (a step of "
               f"at most {preset_rate * radius:.0e})" if preset_rate is not None else
               f"pass learning_rate >= {MIN_STEP_BOUND / radius:g}")
        raise ValueError(
            f"learning_rate={self.learning_rate:g} looks like an AdamW rate, but IVON's learning rate multiplies its "
            f"preconditioned update, clipped here to ±clip_radius={radius:g}: no weight would move more than "
            f"{self.learning_rate * radius:.1e} a step, and the run would end near chance. {fix[0].upper() + fix[1:]}.")

    def param_groups(self, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
        """The trained weights, then (where `frozen_mean_modules` names any) the frozen-mean ones at lr 0: IVON's
        Hessian update does not involve the learning rate, so their σ learns while their mean stays. The trained
        group comes first because the Trainer logs and schedules from the first group's rate."""
        keys = self.config.frozen_mean_modules or []
        frozen = lambda name: any(_in_module(name, key) for key in keys)  # noqa: E731
        unmatched = [key for key in keys if not any(_in_module(name, key) for name, _ in named_parameters)]
        if unmatched:
            modules = sorted({name.rpartition(".")[0] for name, _ in named_parameters})
            raise ValueError(f"frozen_mean_modules names {unmatched}, which match no module with trainable weights; "
                             f"the trainable modules are {modules[:8]}{' …' if len(modules) > 8 else ''}. Name one "
                             "of them (or a suffix of its name, e.g. 'word_embeddings').")
        groups = [{"params": [p for name, p in named_parameters if not frozen(name)]},
                  {"params": [p for name, p in named_parameters if frozen(name)], "lr": 0.0}]
        return [group for group in groups if group["params"]]

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], context: MethodContext) -> torch.Tensor:
        """`mc_samples` posterior samples, each running forward *and* backward inside one weight-sampling context:
        IVON's Hessian estimate ε⊙g is unbiased only when g was computed at the same ε. The gradients are zeroed before
        each sample (the Trainer zeroes only after `step()`), the loss is the micro-batch *mean* (IVON averages its
        samples itself: no division by the accumulation steps), and gradient-norm clipping happens inside the sample,
        since IVON has read the gradients before the Trainer would clip. DDP's all-reduce is off for every sample: IVON
        (sync=True) averages g and ε⊙g over ranks in `step()`, where DDP's would average g over other ranks' draws;
        FSDP2 reduce-scatters each sample's gradient onto the shards IVON updates."""
        opt = context.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        losses = []
        for _ in range(self.config.mc_samples):
            if context.sharded:  # IVON writes the sample into the shards: no forward may reuse gathered weights
                _reshard(model)
            with opt.sampled_params(train=True), context.no_sync(model):
                model.zero_grad(set_to_none=True)
                loss = self.training_loss(model, inputs, context)
                context.backward(loss)
                # IVON records the gradients when the sample ends: they are checked here, before (no host sync)
                context.note_finite(loss, params)
                if context.max_grad_norm > 0:
                    self.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, context.max_grad_norm)
            losses.append(loss.detach())
        # for logging only: the Trainer sums this over micro-batches and divides by the optimizer steps
        return torch.stack(losses).mean() / context.gradient_accumulation_steps

    @staticmethod
    def check_parallelism(fsdp_version: int | None, deepspeed: bool) -> None:
        check_ivon_sharding(fsdp_version, deepspeed)

    def follows_run_length(self) -> bool:
        """Whether β2 is the library's default (`varsmooth.presets.default_beta2`): no `beta2` was given."""
        return self.config.beta2 is None

    def _window_rule_applies(self) -> bool:
        """Whether β2 comes from the run-length rule: the default, and a run too short for the preset's β2."""
        return (self.follows_run_length() and bool(self.total_steps)
                and default_beta2(self.config.long_run_beta2(), self.total_steps,
                                  self.config.hessian_window) != self.config.long_run_beta2())

    def beta2(self) -> float:
        """`beta2` if given, else `default_beta2`: the preset's β2 in a run long enough for it to move the Hessian, the
        run-length rule 1 − 1/max(c·T, 300) (c = `hessian_window`) in a shorter one; the preset's when T is unknown."""
        if not self.follows_run_length():
            return self.config.beta2
        if self.total_steps:
            return default_beta2(self.config.long_run_beta2(), self.total_steps, self.config.hessian_window)
        logger.warning(
            "The run's number of optimizer steps is unknown (an IterableDataset without max_steps?), so β2 cannot "
            "follow the run's length: using the %s preset's beta2=%s, under which the Hessian may hardly move in a "
            "short run. Set max_steps, or pass beta2.", self.config.ivon_preset, self.config.long_run_beta2(),
        )
        return self.config.long_run_beta2()

    def clip_radius(self) -> float:
        """`clip_radius` if given; 0.05 under the run-length rule (the Hessian may fall far below h0, which would
        blow up the step lr·(h0+δ)/(h+δ), as the run-length β2 did in 100-epoch runs without it); else no clipping."""
        if self.config.clip_radius is not None:
            return self.config.clip_radius
        return HESSIAN_WINDOW_CLIP_RADIUS if self._window_rule_applies() else math.inf

    def ess(self) -> float:
        """λ in Eq. 6 of the adaptive-label-smoothing paper: the user's `ess`, else the training-set size N (the
        authors' choice)."""
        if self.config.ess is not None:
            return float(self.config.ess)
        if not self.num_train_examples:
            raise ValueError(
                "IVON needs the effective sample size `ess`, which defaults to the training-set size, but the "
                "training dataset has no length (an IterableDataset?). Pass `ess=<number of training examples>`."
            )
        return float(self.num_train_examples)

    def callbacks(self) -> list[Any]:
        """With `ivon_smoothing`, the callback that sets ess from the label noise it measures (the trainer connects
        it)."""
        return [] if self.config.ivon_smoothing is None else [SmoothingStrengthCallback(self.config.ivon_smoothing)]

    def scale_ess(self, optimizer: VariationalIVON, factor: float) -> float:
        """Multiply ess by `factor` in `optimizer` and in the config it is recorded from (the posterior's metadata,
        the model card and a resume read it there); returns the new ess."""
        ess = self.ess() * factor
        self.config = dataclasses.replace(self.config, ess=ess)
        for group in optimizer.param_groups:
            group["ess"] = ess
        return ess

    def ivon_settings(self) -> dict[str, Any]:
        """Keyword arguments for `VariationalIVON`: the config's as they are, δ under ivon-opt's name `weight_decay`."""
        return self._settings(self.beta2())

    def _settings(self, beta2: float | None) -> dict[str, Any]:
        a = self.config
        return {
            "lr": self.learning_rate,
            "ess": self.ess(),
            "hess_init": a.hess_init,
            "beta1": a.beta1,
            "beta2": beta2,
            "weight_decay": a.prior_precision,
            "clip_radius": self.clip_radius(),
            "rescale_lr": a.rescale_lr,
        }

    def hyperparameters(self) -> dict[str, Any]:
        known = not self.follows_run_length() or self.total_steps  # the default β2 is known once T is
        settings = self._settings(self.beta2() if known else None)
        return {"method": self.name, "ivon_preset": self.config.ivon_preset, **settings,
                "hessian_window": self.config.hessian_window if self._window_rule_applies() else None,
                "mc_samples": self.config.mc_samples,
                **({} if not self.config.frozen_mean_modules else
                   {"frozen_mean_modules": list(self.config.frozen_mean_modules)}),
                **({} if self.config.ivon_smoothing is None else {"ivon_smoothing": self.config.ivon_smoothing})}


class IVONFixedHessianMethod(IVONMethod):
    """IVON with β2 = 1: h stays at hess_init and σ never adapts (the ablation of Fig. 6 of the adaptive-label-smoothing
    paper)."""

    paper: ClassVar[str] = "Variational Learning Induces Adaptive Label Smoothing (2025), Fig. 6 and App. C.2"

    def follows_run_length(self) -> bool:
        return False

    def beta2(self) -> float:
        return 1.0


register_method("ivon", IVONConfig, IVONMethod)
register_method("ivon_fixed_hessian", IVONConfig, IVONFixedHessianMethod)
