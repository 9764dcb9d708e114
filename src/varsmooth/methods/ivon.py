"""IVON (Shen et al. 2024, Variational Learning is Effective for Large Deep Networks) — training by variational
learning, the method of "Variational Learning Induces Adaptive Label Smoothing" (2025) — and its fixed-Hessian ablation.

`IVONConfig` (`ivon_config`) declares, defaults (from its `ivon_preset`) and checks every IVON setting; the method and
its optimizer take them from it as they are, under the optimizer's names (`varsmooth.posterior.settings.USER_NAMES`).
What only IVON knows of a run, the trainer asks of the method (`TrainingMethod`'s hooks): the posterior, clipping
inside each sample, ess scaling, the state a resume or the best checkpoint restores, the check after training.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from ..label_noise.strength import SmoothingStrengthCallback
from ..posterior.diagnostics import hessian_summary, warn_if_hessian_stuck
from ..posterior.gaussian import POSTERIOR_FILE, DiagonalGaussianPosterior, _reshard
from ..posterior.optimizer import VariationalIVON, unwrap_ivon
from ..posterior.resume import RESUMED_SETTINGS, load_ivon_state, resumed_settings
from ..posterior.settings import USER_NAMES
from ..presets import (
    HESSIAN_WINDOW_CLIP_RADIUS,
    IVON_PRESETS,
    MIN_STEP_BOUND,
    default_beta2,
)
from .base import CallbackContext, MethodContext, OptimizerContext, TrainingMethod, register_method
from .ivon_config import IVONConfig

__all__ = ["IVONConfig", "IVONFixedHessianMethod", "IVONMethod", "check_ivon_sharding"]

logger = logging.getLogger(__name__)


def _in_module(parameter_name: str, module: str) -> bool:
    """Whether the parameter belongs to the module named `module` or to one whose name ends in `.module` (peft's
    target_modules rule)."""
    owner = parameter_name.rpartition(".")[0]
    return owner == module or owner.endswith("." + module)



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
    learns_posterior: ClassVar[bool] = True
    step_settings: ClassVar[str] = "learning_rate / set max_grad_norm or clip_radius (e.g. 0.05)"
    # IVON reads each sample's gradient when the sample ends, before the Trainer would clip
    clips_inside_step: ClassVar[bool] = True
    #: optimizer steps of the run, known when IVON is built (`create_optimizer`; for the run-length β2 rule)
    total_steps: int | None = None
    #: the run's peak learning rate (`TrainingArguments.learning_rate`), known when IVON is built
    learning_rate: float | None = None
    #: the names of IVON's parameters in the order of its groups, which is that of its σ (`use_optimizer`)
    param_names: list[str] | None = None

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
                               compiled=self.config.ivon_compiled, foreach=self.config.ivon_foreach, sync=run.sync,
                               **self.ivon_settings())

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if unwrap_ivon(optimizer) is None:
            raise ValueError(
                f"method={self.name!r} trains with IVON, which the trainer builds itself; got a "
                f"{type(optimizer).__name__} in `optimizers`. Drop `optimizers=` (or pass a varsmooth.VariationalIVON)."
            )

    def use_optimizer(self, optimizer: torch.optim.Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]],
                      new: bool) -> None:
        # once per optimizer: a later call may come after accelerate swapped the parameters (FSDP2's DTensors)
        if new or self.param_names is None:
            names = {id(p): n for n, p in named_parameters}
            self.param_names = [names[id(p)] for g in unwrap_ivon(optimizer).param_groups for p in g["params"]]

    def posterior(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  metadata: Mapping[str, Any]) -> DiagonalGaussianPosterior | None:
        """q = N(m, diag σ²) with σ = 1/sqrt(ess·(h + δ)) from IVON's state, recording `hyperparameters()`, the step
        and `metadata`; None before IVON exists."""
        ivon = unwrap_ivon(optimizer)
        if ivon is None:
            return None
        return DiagonalGaussianPosterior.from_ivon(model, ivon, self.param_names,
                                                   {**self.hyperparameters(), "step": ivon.current_step, **metadata})

    def discard_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Drop the step's posterior samples: IVON stays at the last finite step."""
        ivon = unwrap_ivon(optimizer)
        if ivon is not None:
            ivon.reset_samples()

    def restore_state(self, optimizer: torch.optim.Optimizer | None, model: torch.nn.Module, checkpoint: str,
                      step: int) -> str | None:
        """IVON's Hessian and step from `checkpoint` (its optimizer.pt, else the posterior saved there), which the
        weights' σ needs (`varsmooth.posterior.resume.load_ivon_state`)."""
        ivon = unwrap_ivon(optimizer)
        return None if ivon is None else load_ivon_state(ivon, model, checkpoint, self.param_names, step)

    def settings_before_resume(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        ivon = unwrap_ivon(optimizer)
        return None if ivon is None else dict(ivon.param_groups[0])

    def reconcile_resume(self, optimizer: torch.optim.Optimizer | None, before: dict[str, Any] | None,
                         checkpoint: str, optimizer_state_loaded: bool, model: torch.nn.Module, step: int) -> None:
        """A setting this run left to be derived (ess from the training set or from `ivon_smoothing`, β2 and
        clip_radius from the run's length) takes the checkpoint's value, recorded in the config so that the
        posterior's metadata and the model card report what was used; one given another value is refused
        (`varsmooth.posterior.resume.resumed_settings`). Where the Trainer skipped the optimizer state (it loads it
        only with a scheduler.pt), IVON's Hessian and step count are restored here rather than restarted."""
        ivon = unwrap_ivon(optimizer)
        if ivon is None:
            return
        if before is not None:
            derived = {name for name in RESUMED_SETTINGS.values() if getattr(self.config, name, 0) is None}
            if self.config.ivon_smoothing is not None:
                derived.add("ess")
            kept = resumed_settings(ivon.param_groups[0], before, derived, checkpoint)
            if kept:
                self.config = dataclasses.replace(self.config, **kept)
                logger.info("Resumed IVON from %s with its %s (left unset here, so the checkpoint's values are kept "
                            "and recorded).", checkpoint, ", ".join(f"{k}={v!r}" for k, v in kept.items()))
        if optimizer_state_loaded:
            return
        if self.restore_state(ivon, model, checkpoint, step) == POSTERIOR_FILE:
            logger.warning("%s has no optimizer state (save_only_model=True?): IVON's Hessian and step count were "
                           "restored from its %s; the gradient momentum restarts at zero and the learning-rate "
                           "schedule from its start.", checkpoint, POSTERIOR_FILE)
        else:
            logger.warning("%s has no scheduler.pt: IVON's state was restored, the learning-rate schedule restarts.",
                           checkpoint)

    def after_training(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Warn when the Hessian hardly moved (`varsmooth.posterior.diagnostics.warn_if_hessian_stuck`)."""
        warn_if_hessian_stuck(unwrap_ivon(optimizer), self.config.beta2 is not None)

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
        """The trained weights; then the new ones (`new_weight_modules`, where `new_weight_lr_scale` is not 1) at
        that multiple of the rate; then the frozen-mean ones (`frozen_mean_modules`) at lr 0: IVON's Hessian update
        does not involve the learning rate, so their σ learns while their mean stays. The trained group comes first
        because the Trainer logs the first group's rate (the scheduler scales each group's own)."""
        frozen = self._module_matcher(named_parameters, self.config.frozen_mean_modules, "frozen_mean_modules")
        scale = self.config.new_weight_lr_scale
        new = self._module_matcher(named_parameters, self.config.new_weight_modules if scale != 1 else None,
                                   "new_weight_modules")
        groups = [{"params": [p for name, p in named_parameters if not frozen(name) and not new(name)]},
                  {"params": [p for name, p in named_parameters if new(name) and not frozen(name)],
                   "lr": self.learning_rate * (scale or 1.0)},
                  {"params": [p for name, p in named_parameters if frozen(name)], "lr": 0.0}]
        return [group for group in groups if group["params"]]

    @staticmethod
    def _module_matcher(named_parameters: list[tuple[str, torch.nn.Parameter]], keys: list[str] | None,
                        setting: str) -> Callable[[str], bool]:
        """Whether a parameter name belongs to one of the modules `keys` names (`_in_module`); a key matching no
        trainable weight is refused, naming the setting and the modules there are."""
        keys = keys or []
        unmatched = [key for key in keys if not any(_in_module(name, key) for name, _ in named_parameters)]
        if unmatched:
            modules = sorted({name.rpartition(".")[0] for name, _ in named_parameters})
            raise ValueError(f"{setting} names {unmatched}, which match no module with trainable weights; the "
                             f"trainable modules are {modules[:8]}{' …' if len(modules) > 8 else ''}. Name one of "
                             "them (or a suffix of its name, e.g. 'word_embeddings').")
        return lambda name: any(_in_module(name, key) for key in keys)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], context: MethodContext) -> torch.Tensor:
        """`mc_samples` posterior samples, each running forward *and* backward inside one weight-sampling context:
        IVON's Hessian estimate ε⊙g is unbiased only when g was computed at the same ε. The gradients are zeroed before
        each sample (the Trainer zeroes only after `step()`), the loss is the micro-batch *mean* (IVON averages its
        samples itself: no division by the accumulation steps), and gradient-norm clipping happens inside the sample,
        since IVON has read the gradients before the Trainer would clip. DDP's all-reduce is off for every sample: IVON
        (sync=True) averages g and ε⊙g over ranks in `step()`, where DDP's would average g over other ranks' draws;
        FSDP2 reduce-scatters each sample's gradient onto the shards IVON updates."""
        opt = unwrap_ivon(context.optimizer)  # inside accelerate's wrapper, which forwards no sampled_params
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

    def callbacks(self, run: CallbackContext) -> list[Any]:
        """With `ivon_smoothing`, the callback that sets ess from the label noise `run` measures."""
        if self.config.ivon_smoothing is None:
            return []
        return [SmoothingStrengthCallback(self.config.ivon_smoothing).connect(
            measure=run.measure_label_noise, scale_ess=lambda factor: self.scale_ess(run.optimizer(), factor),
            seed=run.seed)]

    def training_log(self, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        """The Hessian summary (`varsmooth.posterior.diagnostics.hessian_summary`): whether the posterior learns."""
        return hessian_summary(unwrap_ivon(optimizer))

    def scale_ess(self, optimizer: torch.optim.Optimizer, factor: float) -> float:
        """Multiply ess by `factor` in `optimizer` (accelerate's wrapper or not) and in the config it is recorded
        from (the posterior's metadata, the model card and a resume read it there); returns the new ess."""
        ess = self.ess() * factor
        self.config = dataclasses.replace(self.config, ess=ess)
        for group in unwrap_ivon(optimizer).param_groups:
            group["ess"] = ess
        return ess

    def ivon_settings(self) -> dict[str, Any]:
        """Keyword arguments for `VariationalIVON`: the config's as they are, δ under ivon-opt's name `weight_decay`."""
        return self._settings(self.beta2())

    def _settings(self, beta2: float | None) -> dict[str, Any]:
        a = self.config
        settings = {"learning_rate": self.learning_rate, "ess": self.ess(), "hess_init": a.hess_init, "beta1": a.beta1,
                    "beta2": beta2, "prior_precision": a.prior_precision, "clip_radius": self.clip_radius(),
                    "rescale_lr": a.rescale_lr}
        keywords = {name: keyword for keyword, name in USER_NAMES.items()}
        return {keywords.get(name, name): value for name, value in settings.items()}

    def hyperparameters(self) -> dict[str, Any]:
        known = not self.follows_run_length() or self.total_steps  # the default β2 is known once T is
        settings = self._settings(self.beta2() if known else None)
        return {"method": self.name, "ivon_preset": self.config.ivon_preset, **settings,
                "hessian_window": self.config.hessian_window if self._window_rule_applies() else None,
                "mc_samples": self.config.mc_samples,
                **({} if not self.config.frozen_mean_modules else
                   {"frozen_mean_modules": list(self.config.frozen_mean_modules)}),
                **({} if self.config.new_weight_lr_scale == 1 or not self.config.new_weight_modules else
                   {"new_weight_lr_scale": self.config.new_weight_lr_scale,
                    "new_weight_modules": list(self.config.new_weight_modules)}),
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
