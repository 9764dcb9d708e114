"""`VariationalTrainingArguments`: `TrainingArguments` plus IVON's settings and variational prediction."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .methods import (
    METHODS,
    MethodConfig,
    build_method_config,
    get_method_class,
    get_method_config_class,
    learns_posterior,
)
from .presets import (
    DEFAULT_HESSIAN_WINDOW,
    FINETUNE_PRESET,
    IVON_PRESETS,
    LORA_PRESET,
    MIN_HESSIAN_WINDOW_STEPS,
    SCRATCH_PRESET,
)

__all__ = ["IVON_ONLY_FIELDS", "VariationalTrainingArguments"]

#: the fields only methods that learn a posterior (IVON) read; with another method a value other than the field's
#: default is refused (`refuse_ivon_settings_without_ivon`), and the preset leaves them unset
IVON_ONLY_FIELDS = ("ess", "hess_init", "beta1", "beta2", "hessian_window", "prior_precision", "mc_samples", "ivon_fused",
                    "clip_radius", "rescale_lr", "posterior_temperature", "recompute_batchnorm_statistics",
                    "ivon_smoothing")


def _preset_default(name: str) -> str:
    return (f"Default (None): {SCRATCH_PRESET[name]} with ivon_preset scratch, {FINETUNE_PRESET[name]} with finetune, "
            f"{LORA_PRESET[name]} with lora.")



@dataclass
class VariationalTrainingArguments(TrainingArguments):
    """Arguments of `VariationalTrainer`; every field parses with `HfArgumentParser` (`--ess 1e4`, ...).

    IVON defaults are the authors' CIFAR recipe for training from scratch (`ivon_preset="scratch"`,
    varsmooth.presets.SCRATCH_PRESET): lr 0.2, hess_init 0.5, β1 0.9, prior precision 2e-4, ess = training-set size,
    one MC sample per micro-batch; the authors' β2 = 0.99999 in runs long enough for it to move the Hessian (~10k
    steps), and in shorter ones β2 follows the run's length (`hessian_window`, every preset), so that the posterior
    learns there too (in the image example's 1,080 steps σ stayed at its initial value under 0.99999). For a pretrained model, `ivon_preset="finetune"`
    (varsmooth.presets.FINETUNE_PRESET) fills them instead. The preset-controlled fields default to `None` ("not set")
    and `__post_init__` resolves them, so a value the user gives is kept even when it equals the other preset's.

    The other methods' settings are not fields here: `method_config` holds the chosen method's own config
    (`VariationalTrainingArguments(method="sam", method_config={"sam_rho": 0.1})`, or a `SAMConfig`); after
    `__post_init__` it is always an instance of that method's config class (for IVON an `IVONConfig` built from the
    IVON fields here).

    Names of draws and seeds: `mc_samples` posterior samples per training micro-batch and `seed` (the run, and IVON's
    weight noise during training); `eval_mc_samples` samples per prediction and `eval_seed` (every draw of evaluation,
    τ's choice and the label-noise export). A function that draws takes `num_samples` and `seed` for that call, with
    these as the trainer's defaults. `weight_decay` is refused with IVON methods: their weight decay is
    `prior_precision`, the precision of the Gaussian prior.

    Defaults of `TrainingArguments` that varsmooth overrides (the fields are redefined below, in one block):

    - `learning_rate` (`float` or `None`, default `None`): the method's own rate (IVON 0.2, whose first step is an
      SGD step of that size; the finetune preset 0.3; other methods `TrainingArguments`' 5e-5). Overrides 5e-5.
    - `max_grad_norm` (`float`, default `0.0`: no gradient-norm clipping). Overrides 1.0. Under IVON the clipping
      acts on every posterior sample's gradient before IVON reads it, so a norm of 1.0 clips most samples of a
      small network early in training and shrinks the gradient *and* the Hessian estimate IVON builds from it.
      The default is 0 for every method, not only IVON: all committed benchmarks ran every method without
      clipping, as the reference studies do, and clipping one method but not another would bias comparisons
      (clipping slows memorisation of noisy labels). Pass `max_grad_norm=1.0` for the stock behaviour.
    """

    method: str = field(
        default="ivon",
        metadata={"help": "Training method: " + ", ".join(sorted(METHODS)) + ". 'ivon' trains by variational learning."},
    )
    method_config: dict | str | MethodConfig | None = field(
        default=None,
        metadata={"help": "Settings of the chosen method: its config (e.g. varsmooth.methods.SAMConfig), a dict or a "
                          "JSON object of its fields (e.g. '{\"sam_rho\": 0.1}'); None: the method's defaults. "
                          "varsmooth.methods.list_methods() lists each method's config class."},
    )
    ivon_preset: str = field(
        default="scratch",
        metadata={"help": "IVON defaults: 'scratch' (the authors' recipe), 'finetune' (a pretrained model: posterior "
                          "around the pretrained weights, bounded steps; see varsmooth.presets.FINETUNE_PRESET) or "
                          "'lora' (LoRA adapters: Cong et al. 2024's IVON-LoRA recipe, varsmooth.presets.LORA_PRESET). "
                          "Fields you set keep their value.", "choices": list(IVON_PRESETS)},
    )
    # -- TrainingArguments defaults overridden by varsmooth (the class docstring says why) -----------------
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate. Default: the method's own (IVON 0.2, which is not an AdamW rate: "
                          "the first IVON step is an SGD step of this size; 0.3 with ivon_preset finetune; others 5e-5 "
                          "as in TrainingArguments)."},
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Gradient-norm clipping (0 = none, the default here; TrainingArguments' is 1.0). With IVON "
                          "it clips each posterior sample's gradient before IVON reads it, which also scales the "
                          "Hessian estimate."},
    )

    # -- varsmooth's own fields -------------------------------------------------------------------------
    ess: float | None = field(
        default=None,
        metadata={"help": "IVON effective sample size λ (Eq. 6 of 'Variational Learning Induces Adaptive Label "
                          "Smoothing'). Default: the number of training examples."},
    )
    hess_init: float | None = field(
        default=None,
        metadata={"help": "IVON initial Hessian h0 (> 0); sets the initial posterior std 1/sqrt(ess (h0 + prior_precision)). "
                          + _preset_default("hess_init")},
    )
    beta1: float = field(default=0.9, metadata={"help": "IVON gradient momentum β1."})
    beta2: float | None = field(
        default=None,
        metadata={"help": "IVON Hessian EMA rate β2 (1 = fixed Hessian). Default (None): the preset's (0.99999 scratch "
                          "and lora, 0.999 finetune) when the run is long enough for it to move the Hessian (1 - β2^T >= "
                          "0.1) or of unknown length, else the run-length rule of hessian_window "
                          "(varsmooth.presets.default_beta2). A number fixes β2."},
    )
    hessian_window: float = field(
        default=DEFAULT_HESSIAN_WINDOW,
        metadata={"help": f"The run-length rule for runs too short for the preset's β2 (beta2 unset): β2 = 1 - "
                          f"1/max(hessian_window * T, {MIN_HESSIAN_WINDOW_STEPS}), T = the run's optimizer steps "
                          "(varsmooth.presets), so the Hessian averages over the last fraction hessian_window of the run "
                          "and the posterior learns whatever the run's length; clip_radius then defaults to 0.05 with "
                          "ivon_preset scratch. See benchmarks/README.md, 'The default posterior'."},
    )
    prior_precision: float | None = field(
        default=None,
        metadata={"help": "IVON weight decay δ = precision of the Gaussian prior. Replaces `weight_decay`, which is "
                          "refused with IVON methods. " + _preset_default("prior_precision")},
    )
    ivon_smoothing: float | None = field(
        default=None,
        metadata={"help": "How much IVON smooths the labels, as label smoothing's rate α in (0, 1]: ess is rescaled "
                          "during training so that the mean label noise ‖ε̄‖₁ over a probe of training examples equals "
                          "LS's 2α(1 - 1/K) (varsmooth.label_noise.strength); ess is then where it starts. Choose it on "
                          "noisy validation as you would α. None: ess stays as given (the preset's)."},
    )
    mc_samples: int = field(default=1, metadata={"help": "Posterior samples (forward+backward) per micro-batch during training."})
    ivon_fused: bool | None = field(
        default=None,
        metadata={"help": "IVON's compiled kernels (torch.compile; varsmooth.posterior.VariationalIVON's `compiled`): "
                          "None uses them where torch.compile works (a C++ compiler on the CPU, Triton on GPUs), "
                          "else warns and uses foreach ops; true requires them; false uses foreach ops."},
    )
    clip_radius: float | None = field(
        default=None,
        metadata={"help": "IVON element-wise clipping of the preconditioned update (None = no clipping). Gradient-norm "
                          "clipping (`max_grad_norm`) is applied inside each sample, before IVON reads the gradient."},
    )
    rescale_lr: bool | None = field(
        default=None,
        metadata={"help": "Multiply lr by (hess_init + prior_precision), ivon-opt's default (`--rescale_lr false` to "
                          "turn it off). " + _preset_default("rescale_lr")},
    )
    eval_mc_samples: int | None = field(
        default=None,
        metadata={"help": "Posterior samples averaged (BMA) by evaluate()/predict(); 0 predicts at the posterior mean. "
                          "Default (None): 32, 10 with ivon_preset lora (IVON-LoRA's test-time samples)."},
    )
    eval_seed: int = field(default=0, metadata={"help": "Seed of the posterior samples used for prediction (common across evaluations)."})
    posterior_temperature: float | None = field(
        default=None,
        metadata={"help": "τ >= 0 scaling the posterior std σ at prediction time (0 = predict at the posterior mean, 1 = "
                          "the learned posterior). None: chosen when training ends, by the eval dataset's NLL over "
                          "varsmooth.posterior.temperature.TEMPERATURE_GRID (which holds 0 and 1); 1 without an eval "
                          "dataset. A number fixes τ for every prediction; 1 turns the selection off."},
    )
    recompute_batchnorm_statistics: bool = field(
        default=True,
        metadata={"help": "With a method that learns a posterior (IVON): when training ends, recompute BatchNorm's "
                          "running statistics at the posterior mean from up to 10,000 training examples (as stochastic "
                          "weight averaging does), since those gathered while training average over sampled weights. "
                          "No effect on models without BatchNorm."},
    )
    temperature_scaling: bool = field(
        default=False,
        metadata={"help": "Post-hoc temperature scaling (Guo et al. 2017): when training ends, fit one temperature T on "
                          "the eval dataset by NLL and predict softmax(log P / T) from then on, for any method (after the "
                          "posterior temperature of IVON); saved with the model (temperature_scaling.json). Off by "
                          "default: it changes every reported metric and needs a validation split."},
    )
    mc_dropout_samples: int = field(
        default=0,
        metadata={"help": "MC-dropout prediction (Gal & Ghahramani 2016): evaluate()/predict() average this many softmax "
                          "predictions with the model's dropout layers on (0 = off). For methods without a posterior (not "
                          "IVON, which predicts by BMA)."},
    )

    def __post_init__(self) -> None:
        method_cls = get_method_class(self.method)
        for name in ("mc_samples", "eval_mc_samples", "mc_dropout_samples"):  # counts: 2.5 would fail mid-run
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
                raise ValueError(f"{name} is a number of samples, a whole number, got {value!r}: pass e.g. {name}=2.")
            setattr(self, name, int(value))
        learns = learns_posterior(method_cls)
        refuse_ivon_settings_without_ivon(self)
        # None = not set by the user: the preset fills it (finetune and lora only for IVON methods, others keep
        # their own learning rate); ess and clip_radius stay None in the scratch preset (training-set size, no clip)
        if self.ivon_preset not in IVON_PRESETS:
            raise ValueError(f"ivon_preset must be one of {list(IVON_PRESETS)}, got {self.ivon_preset!r}.")
        preset = {**SCRATCH_PRESET, **(IVON_PRESETS[self.ivon_preset] if learns else {})}
        preset.pop("long_run_beta2")  # not a field: IVONMethod.beta2 reads it (varsmooth.presets.default_beta2)
        if not learns:  # left unset, so that a copy (dataclasses.replace) is not refused as if the user had set them
            preset = {name: value for name, value in preset.items() if name not in IVON_ONLY_FIELDS}
        for name, value in preset.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.learning_rate is None:
            self.learning_rate = method_cls.default_learning_rate
        # always the method's own config class from here on (a copy: the caller's object is not changed)
        config_cls = get_method_config_class(self.method)
        if config_cls.mirrors_training_arguments:  # IVON's: built from these fields, which it also checks
            config = config_cls.from_training_arguments(self)
            given = self.method_config
            if given is not None and given != {} and build_method_config(self.method, given) != config:
                raise ValueError(
                    f"method={self.method!r} takes its settings from the arguments' own fields, and method_config "
                    f"({given!r}) differs from them: set those fields instead (e.g. ess=..., beta2=...), and drop method_config."
                )
            self.method_config = config
        else:
            self.method_config = build_method_config(self.method, self.method_config)
        if learns and self.weight_decay:
            raise ValueError(
                f"weight_decay={self.weight_decay} with method={self.method!r}: IVON's weight decay is the precision of its "
                "Gaussian prior, `prior_precision` (δ, which also sets the posterior's σ); IVON would ignore weight_decay. "
                "Pass prior_precision= instead and leave weight_decay at 0."
            )
        if learns and self.fp16:
            raise ValueError(
                "fp16 with a gradient scaler is not supported with IVON: IVON reads the gradients when each weight "
                "sample ends, before the scaler unscales them, so every update would be ~65536x too large. "
                "Use bf16=True (autocast with fp32 weights) or full precision."
            )
        if self.posterior_temperature is not None and not 0 <= self.posterior_temperature < float("inf"):
            raise ValueError(f"posterior_temperature must be a finite number >= 0 or None (choose it on the eval dataset), "
                             f"got {self.posterior_temperature}.")
        if self.mc_dropout_samples < 0:
            raise ValueError(f"mc_dropout_samples must be >= 0 (0 = no MC dropout), got {self.mc_dropout_samples}.")
        if self.mc_dropout_samples and learns:
            raise ValueError(
                f"mc_dropout_samples={self.mc_dropout_samples} with method={self.method!r}: IVON methods predict by "
                "Bayesian model averaging over their posterior (eval_mc_samples). Use MC dropout with a method without "
                "a posterior (e.g. method='erm'), or set mc_dropout_samples=0."
            )
        if self.eval_mc_samples < 0:
            raise ValueError(f"eval_mc_samples must be >= 0 (0 = predict at the posterior mean), got {self.eval_mc_samples}.")
        super().__post_init__()
        fsdp_version = (getattr(self, "fsdp_plugin_args", None) or {}).get("fsdp_version") if self.fsdp else None
        method_cls.check_parallelism(fsdp_version, bool(self.deepspeed))

    def to_dict(self) -> dict[str, Any]:
        """`TrainingArguments.to_dict` with `method_config` as a dict of its fields, so that `to_json_string`, the
        model card and `HfArgumentParser.parse_dict` round-trip it."""
        d = super().to_dict()
        if isinstance(self.method_config, MethodConfig):
            d["method_config"] = dataclasses.asdict(self.method_config)
        return d


def refuse_ivon_settings_without_ivon(args: VariationalTrainingArguments) -> None:
    """Refuse IVON's settings (`IVON_ONLY_FIELDS`) given a value other than their default with a method that does not
    learn a posterior (`method="erm"`, "sam", ...): the run would train without them and its record would look as if
    they had been used."""
    if learns_posterior(get_method_class(args.method)):
        return
    defaults = {f.name: f.default for f in dataclasses.fields(VariationalTrainingArguments)}
    given = [f"{name}={getattr(args, name)!r}" for name in IVON_ONLY_FIELDS if getattr(args, name) != defaults[name]]
    if given:
        raise ValueError(
            f"{', '.join(given)} {'is an IVON setting' if len(given) == 1 else 'are IVON settings'}, and "
            f"method={args.method!r} does not train with IVON: {'it' if len(given) == 1 else 'they'} would be silently "
            f"ignored. Drop {', '.join(g.split('=')[0] for g in given)}, or choose an IVON method (method='ivon')."
        )
