"""`VariationalTrainingArguments`: `TrainingArguments` plus IVON's settings and variational prediction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from .defaults import FINETUNE_PRESET
from .methods import METHODS, get_method_class

__all__ = ["VariationalTrainingArguments"]


@dataclass
class VariationalTrainingArguments(TrainingArguments):
    """Arguments of `VariationalTrainer`; every field parses with `HfArgumentParser` (`--ess 1e4`, ...).

    IVON defaults are the authors' CIFAR recipe for training from scratch (ivon.md §3): lr 0.2, hess_init 0.5, β1 0.9,
    β2 0.99999, prior precision 2e-4, ess = training-set size, one MC sample per micro-batch. For a pretrained model,
    `ivon_preset="finetune"` (varsmooth.defaults.FINETUNE_PRESET) replaces those left at their defaults.
    """

    method: str = field(
        default="ivon",
        metadata={"help": "Training method: " + ", ".join(sorted(METHODS)) + ". 'ivon' trains by variational learning."},
    )
    ivon_preset: str = field(
        default="scratch",
        metadata={"help": "IVON defaults: 'scratch' (the authors' recipe) or 'finetune' (a pretrained model: posterior "
                          "around the pretrained weights, bounded steps; see varsmooth.defaults.FINETUNE_PRESET). Fields "
                          "you set to a non-default value keep it.", "choices": ["scratch", "finetune"]},
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate. Default: the method's own (IVON 0.2, which is not an AdamW rate: "
                          "the first IVON step is an SGD step of this size; others 5e-5 as in TrainingArguments)."},
    )
    ess: float | None = field(
        default=None,
        metadata={"help": "IVON effective sample size λ (seed 000, Eq. 6). Default: the number of training examples."},
    )
    hess_init: float = field(default=0.5, metadata={"help": "IVON initial Hessian h0 (> 0); sets the initial posterior std 1/sqrt(ess (h0 + prior_precision))."})
    beta1: float = field(default=0.9, metadata={"help": "IVON gradient momentum β1."})
    beta2: float = field(default=0.99999, metadata={"help": "IVON Hessian EMA rate β2 (1 = fixed Hessian). Ignored when hessian_window is set."})
    hessian_window: float | None = field(
        default=None,
        metadata={"help": "Run-length rule instead of beta2: β2 = 1 - 1/max(hessian_window * T, 300), T = the run's "
                          "optimizer steps (varsmooth.defaults), with clip_radius defaulting to 0.05. 0.1 let the posterior "
                          "adapt and beat the authors' β2 on MNIST at 20 epochs, but hurt on the 1.4k-image digits "
                          "(benchmarks/training_length.py, README 'Does it work?'). None: beta2 as given."},
    )
    prior_precision: float = field(
        default=2e-4,
        metadata={"help": "IVON weight decay δ = precision of the Gaussian prior. Replaces `weight_decay`, which IVON ignores."},
    )
    mc_samples: int = field(default=1, metadata={"help": "Posterior samples (forward+backward) per micro-batch during training."})
    clip_radius: float | None = field(
        default=None,
        metadata={"help": "IVON element-wise clipping of the preconditioned update (None = no clipping). Gradient-norm "
                          "clipping (`max_grad_norm`) is applied inside each sample, before IVON reads the gradient."},
    )
    rescale_lr: bool = field(default=True, metadata={"help": "Multiply lr by (hess_init + prior_precision), ivon-opt's default."})
    eval_mc_samples: int = field(
        default=32,
        metadata={"help": "Posterior samples averaged (BMA) by evaluate()/predict(); 0 predicts at the posterior mean."},
    )
    eval_seed: int = field(default=0, metadata={"help": "Seed of the posterior samples used for prediction (common across evaluations)."})
    posterior_temperature: float | None = field(
        default=None,
        metadata={"help": "τ >= 0 scaling the posterior std σ at prediction time (0 = predict at the posterior mean, 1 = "
                          "the learned posterior). None: chosen when training ends, by the eval dataset's NLL over "
                          "varsmooth.posterior.temperature.TEMPERATURE_GRID (which holds 0 and 1); 1 without an eval "
                          "dataset. A number fixes τ for every prediction; 1 turns the selection off."},
    )

    # -- baselines (methods.md §9 lists the defaults) -----------------------------------------------
    smoothing: float = field(
        default=0.1,
        metadata={"help": "method='ls': smoothing rate α in [0, 1]; target (1-α)·onehot + α/K (uniform over all K classes)."},
    )
    gls_rate: float = field(
        default=0.1,
        metadata={"help": "method='gls': smoothing rate r < 1 of (1-r)·onehot + r/K; r < 0 is negative label smoothing "
                          "(seed 003). Default 0.1 as in the reference code; varsmooth.methods.optimal_smoothing_rate "
                          "gives r_opt for a known symmetric noise rate."},
    )
    gls_warmup_epochs: float = field(
        default=0.0,
        metadata={"help": "method='gls': epochs of plain cross-entropy before switching to gls_rate (the reference "
                          "warms up with CE before NLS, whose loss is unbounded below)."},
    )
    ols_alpha: float = field(
        default=0.5,
        metadata={"help": "method='ols': weight α of the hard-label CE in α·CE + (1-α)·soft-label CE (Zhang et al. 2021)."},
    )
    sam_rho: float = field(default=0.05, metadata={"help": "method='sam': neighbourhood radius ρ (Foret et al. 2020)."})
    sam_adaptive: bool = field(
        default=False,
        metadata={"help": "method='sam': adaptive SAM (ASAM), perturbation scaled by |w|; use a ~10x larger sam_rho."},
    )
    gce_q: float = field(default=0.7, metadata={"help": "method='gce': q in (0, 1] of the generalized cross-entropy (1 - p_y^q)/q."})
    ln_temperature: float = field(
        default=1.0, metadata={"help": "method='logistic_normal': temperature τ of the softmax-centred link (seed 004)."}
    )
    ln_min_scale: float = field(
        default=1.0, metadata={"help": "method='logistic_normal': λ > 0 in Σ^{1/2} = c cᵀ + λI (reference flag `min_scale`)."}
    )
    ln_target_smoothing: float = field(
        default=0.01, metadata={"help": "method='logistic_normal': t in the observed target (1-t)·onehot + t/(K+1)."}
    )
    alasca_lambda: float = field(default=2.0, metadata={"help": "method='alasca': weight λ of the auxiliary classifiers' loss (seed 002)."})
    alasca_ema: float = field(default=0.7, metadata={"help": "method='alasca': EMA coefficient β of the per-example logits."})
    alasca_temperature: float = field(
        default=1 / 3, metadata={"help": "method='alasca': sharpening temperature τ of the EMA logits (softmax(t/τ))."}
    )
    alasca_warmup_epochs: float = field(
        default=30.0,
        metadata={"help": "method='alasca': epochs over which the AC targets move linearly from hard to adaptive (reference code)."},
    )
    alasca_num_classifiers: int = field(
        default=3,
        metadata={"help": "method='alasca': auxiliary classifiers on evenly spaced intermediate blocks (ResNet-34: layers 1-3)."},
    )

    def __post_init__(self) -> None:
        method_cls = get_method_class(self.method)
        if self.ivon_preset not in ("scratch", "finetune"):
            raise ValueError(f"ivon_preset must be 'scratch' or 'finetune', got {self.ivon_preset!r}.")
        if self.ivon_preset == "finetune" and method_cls.uses_ivon:
            defaults = {f.name: f.default for f in fields(VariationalTrainingArguments)}
            for name, value in FINETUNE_PRESET.items():
                if getattr(self, name) == defaults[name]:  # left at the from-scratch default
                    setattr(self, name, value)
        if self.learning_rate is None:
            self.learning_rate = method_cls.default_learning_rate
        if method_cls.uses_ivon:
            if self.fp16:
                raise ValueError(
                    "fp16 with a gradient scaler is not supported with IVON: IVON reads the gradients when each weight "
                    "sample ends, before the scaler unscales them, so every update would be ~65536x too large. "
                    "Use bf16=True (autocast with fp32 weights) or full precision."
                )
            if self.mc_samples < 1:
                raise ValueError(f"mc_samples must be >= 1, got {self.mc_samples}.")
            if self.hess_init <= 0:
                raise ValueError(f"hess_init must be > 0 (IVON's posterior std is 1/sqrt(ess (h + δ))), got {self.hess_init}.")
            if not 0.0 <= self.beta2 <= 1.0 or not 0.0 <= self.beta1 < 1.0:
                raise ValueError(f"Need 0 <= beta1 < 1 and 0 <= beta2 <= 1, got beta1={self.beta1}, beta2={self.beta2}.")
            if self.prior_precision < 0:
                raise ValueError(f"prior_precision must be >= 0, got {self.prior_precision}.")
            if self.ess is not None and not self.ess > 0:
                raise ValueError(f"ess must be > 0, got {self.ess}.")
            if self.hessian_window is not None and not self.hessian_window > 0:
                raise ValueError(f"hessian_window must be > 0 (a fraction of the run's steps) or None, got {self.hessian_window}.")
            if self.clip_radius is not None and not self.clip_radius > 0:
                raise ValueError(f"clip_radius must be > 0 or None, got {self.clip_radius}.")
        if self.posterior_temperature is not None and not 0 <= self.posterior_temperature < float("inf"):
            raise ValueError(f"posterior_temperature must be a finite number >= 0 or None (choose it on the eval dataset), "
                             f"got {self.posterior_temperature}.")
        if self.eval_mc_samples < 0:
            raise ValueError(f"eval_mc_samples must be >= 0 (0 = predict at the posterior mean), got {self.eval_mc_samples}.")
        super().__post_init__()
        if method_cls.uses_ivon and (self.fsdp or self.deepspeed):
            raise ValueError(
                "IVON is not supported with FSDP or DeepSpeed (yet): it keeps all parameters in one flat vector and "
                "replaces their storage, which clashes with sharded parameters. Use DDP (torchrun / accelerate launch "
                "--multi_gpu) instead."
            )

