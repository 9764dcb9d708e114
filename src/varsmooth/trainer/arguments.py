"""`VariationalTrainingArguments`: `TrainingArguments` plus the training method (with its config) and prediction."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..methods import METHODS, MethodConfig, build_method_config, get_method_class
from ..presets import FINETUNE_PRESET, SCRATCH_PRESET

__all__ = ["HONOURED_ARGUMENTS", "POSTERIOR_FIELDS", "UNHONOURED_ARGUMENTS", "VariationalTrainingArguments",
           "check_unhonoured_arguments"]

logger = logging.getLogger(__name__)

#: the fields only methods that learn a posterior (IVON) read: with another method a value other than the field's
#: default is refused (`check_unhonoured_arguments`)
POSTERIOR_FIELDS = ("posterior_temperature", "recompute_batchnorm_statistics")


@dataclass
class VariationalTrainingArguments(TrainingArguments):
    """Arguments of `VariationalTrainer`; every field parses with `HfArgumentParser`.

    The training method's settings are not fields here: `method_config` holds the chosen method's own config, where
    each is declared, defaulted and checked (`VariationalTrainingArguments(method_config=IVONConfig(ess=1e4))`, or
    `method="sam", method_config={"sam_rho": 0.1}`); after `__post_init__` it is always an instance of that method's
    config class. The default method is IVON, whose preset (`IVONConfig.ivon_preset`) the trainer chooses from the model
    it is handed unless one is named (`varsmooth.presets.choose_preset`: `lora` for peft adapters, `finetune` for
    weights loaded from a checkpoint, else `scratch`, the authors' CIFAR recipe); until then `learning_rate` and
    `eval_mc_samples` left unset stay None (`for_model` fills them). What is declared here serves every method: the
    fields of `TrainingArguments`, and how a trained model predicts (`eval_mc_samples`, `eval_seed`,
    `posterior_temperature`, ...), which also applies to a posterior loaded rather than trained.

    Names of draws and seeds: IVON's `mc_samples` posterior samples per training micro-batch and `seed` (the run, and
    IVON's weight noise during training); `eval_mc_samples` samples per prediction and `eval_seed` (every draw of
    evaluation, τ's choice and the label-noise export). A function that draws takes `num_samples` and `seed` for that
    call, with these as the trainer's defaults. `weight_decay` is refused with IVON methods: their weight decay is
    `IVONConfig.prior_precision`, the precision of the Gaussian prior.

    Defaults of `TrainingArguments` that varsmooth overrides (the fields are redefined below, in one block):

    - `learning_rate` (`float` or `None`, default `None`): the method's own rate (IVON's preset's: scratch 0.2, whose
      first step is an SGD step of that size; finetune and lora multiply an update clipped to ±clip_radius, so a
      weight moves at most learning_rate × clip_radius a step; other methods `TrainingArguments`' 5e-5; the method's
      config may set it, `MethodConfig.training_argument_defaults`). Overrides 5e-5.
    - `max_grad_norm` (`float`, default `0.0`: no gradient-norm clipping). Overrides 1.0. Under IVON the clipping
      acts on every posterior sample's gradient before IVON reads it, so a norm of 1.0 clips most samples of a
      small network early in training and shrinks the gradient *and* the Hessian estimate IVON builds from it.
      The default is 0 for every method, not only IVON: all committed benchmarks ran every method without
      clipping, as the reference studies do, and clipping one method but not another would bias comparisons
      (clipping slows memorisation of noisy labels). Pass `max_grad_norm=1.0` for the stock behaviour.
    """

    method: str = field(
        default="ivon",
        metadata={"help": "Training method: " + ", ".join(sorted(METHODS)) + ". 'ivon' trains by variational "
                                                                             "learning."},
    )
    method_config: dict | str | MethodConfig | None = field(
        default=None,
        metadata={"help": "Settings of the chosen method: its config (e.g. varsmooth.methods.IVONConfig), a dict or a "
                          "JSON object of its fields (e.g. '{\"ess\": 1e4}'); None: the method's defaults. "
                          "varsmooth.methods.list_methods() lists each method's config class; the examples take its "
                          "fields as flags after --method (--method ivon --ess 1e4)."},
    )
    # -- TrainingArguments defaults overridden by varsmooth (the class docstring says why) -----------------
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate. IVON's is no AdamW rate: under ivon_preset finetune and lora it "
                          "multiplies an update clipped to ±clip_radius (1e-3), so a weight moves at most "
                          "learning_rate x 1e-3 a step, and an AdamW-scale rate (2e-5) is refused before the first "
                          f"step. Default: the method's own (IVON's preset's: scratch 0.2, finetune "
                          f"{FINETUNE_PRESET['learning_rate']:g}, lora 1.0; others 5e-5 as in TrainingArguments)."},
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Gradient-norm clipping (0 = none, the default here; TrainingArguments' is 1.0). With IVON "
                          "it clips each posterior sample's gradient before IVON reads it, which also scales the "
                          "Hessian estimate."},
    )

    # -- varsmooth's own fields -------------------------------------------------------------------------
    eval_mc_samples: int | None = field(
        default=None,
        metadata={"help": "Posterior samples averaged (BMA) by evaluate()/predict(); 0 predicts at the posterior mean. "
                          "Default (None): the preset's, 32, or 10 with ivon_preset lora (IVON-LoRA's test-time "
                          "samples)."},
    )
    eval_seed: int = field(default=0,
                           metadata={"help": "Seed of the posterior samples used for prediction (common across "
                                             "evaluations)."})
    posterior_temperature: float | None = field(
        default=None,
        metadata={"help": "τ >= 0 scaling the posterior std σ at prediction time (0 = predict at the posterior mean, 1 "
                          "= the learned posterior). None: chosen when training ends, by the eval dataset's NLL over "
                          "varsmooth.prediction.temperature.TEMPERATURE_GRID (which holds 0 and 1); 1 without an eval "
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
        metadata={"help": "Post-hoc temperature scaling (Guo et al. 2017): when training ends, fit one temperature T "
                          "on the eval dataset by NLL and predict softmax(log P / T) from then on, for any method "
                          "(after the posterior temperature of IVON); saved with the model (temperature_scaling.json). "
                          "Off by default: it changes every reported metric and needs a validation split."},
    )
    mc_dropout_samples: int = field(
        default=0,
        metadata={"help": "MC-dropout prediction (Gal & Ghahramani 2016): evaluate()/predict() average this many "
                          "softmax predictions with the model's dropout layers on (0 = off). For methods without a "
                          "posterior (not IVON, which predicts by BMA)."},
    )

    def __post_init__(self) -> None:
        method_cls = get_method_class(self.method)
        for name in ("eval_mc_samples", "mc_dropout_samples"):  # counts: 2.5 would fail mid-run
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
                raise ValueError(f"{name} is a number of samples, a whole number, got {value!r}: pass e.g. {name}=2.")
            setattr(self, name, int(value))
        # always the method's own config class from here on (a copy: the caller's object is not changed)
        self.method_config = build_method_config(self.method, self.method_config)
        # None = not set by the user: the method's config (IVON's preset) may decide, else the method's own rate;
        # a config that decides only once the model is known (IVON's preset chosen from it) leaves them to the trainer
        if self.method_config.training_argument_defaults() is not None:
            self._fill_defaults()
        # a NaN rate would train to NaN weights without an error; a config file may give the rate as a string
        if self.learning_rate is not None and not 0 <= float(self.learning_rate) < math.inf:
            raise ValueError(f"learning_rate must be finite and >= 0, got {self.learning_rate}.")
        check_unhonoured_arguments(self)
        if self.posterior_temperature is not None and not 0 <= self.posterior_temperature < float("inf"):
            raise ValueError("posterior_temperature must be a finite number >= 0 or None (choose it on the eval "
                             f"dataset), got {self.posterior_temperature}.")
        if self.mc_dropout_samples < 0:
            raise ValueError(f"mc_dropout_samples must be >= 0 (0 = no MC dropout), got {self.mc_dropout_samples}.")
        if self.eval_mc_samples is not None and self.eval_mc_samples < 0:
            raise ValueError("eval_mc_samples must be >= 0 (0 = predict at the posterior mean), got "
                             f"{self.eval_mc_samples}.")
        super().__post_init__()
        fsdp_version = (getattr(self, "fsdp_plugin_args", None) or {}).get("fsdp_version") if self.fsdp else None
        method_cls.check_parallelism(fsdp_version, bool(self.deepspeed))

    def _fill_defaults(self) -> None:
        """`learning_rate` and `eval_mc_samples` left unset take the method config's defaults, else the method's."""
        defaults = {"learning_rate": get_method_class(self.method).default_learning_rate,
                    "eval_mc_samples": SCRATCH_PRESET["eval_mc_samples"],
                    **self.method_config.training_argument_defaults()}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def for_model(self, model: Any) -> tuple[VariationalTrainingArguments, str | None]:
        """These arguments completed for `model` (`MethodConfig.for_model`: IVON's preset, when none was named, and
        the rate and samples it brings), as a copy when anything changes, so that arguments shared by trainers of
        other models stay as given; and the config's sentence on what it chose."""
        config, choice = self.method_config.for_model(model)
        if config is self.method_config and self.learning_rate is not None and self.eval_mc_samples is not None:
            return self, choice
        args = copy.copy(self)
        args.method_config = config
        args._fill_defaults()
        return args, choice

    def to_dict(self) -> dict[str, Any]:
        """`TrainingArguments.to_dict` with `method_config` as a dict of its fields, so that `to_json_string`, the
        model card and `HfArgumentParser.parse_dict` round-trip it."""
        d = super().to_dict()
        if isinstance(self.method_config, MethodConfig):
            d["method_config"] = dataclasses.asdict(self.method_config)
        return d


_IVON_OPTIMIZER = ("IVON is the optimizer of method={method!r} (its settings: learning_rate, beta1, beta2, hess_init, "
                   "prior_precision, ...); train with method='erm' (or another baseline) to use {name}={value!r}, or "
                   "drop {name}.")

#: The `TrainingArguments` fields that some method cannot honour: name -> (methods, action, why). `methods` is "ivon"
#: (the methods that learn a posterior: IVON is their optimizer) or "all"; `action` "refuse" raises and "ignore"
#: warns, each when the value differs from `TrainingArguments`' default (`check_unhonoured_arguments`). The message
#: may use {name}, {value} and {method}. Every other field is in `HONOURED_ARGUMENTS`; tests/test_hf_parity.py fails
#: on a field of a new transformers release that is in neither.
UNHONOURED_ARGUMENTS: dict[str, tuple[str, str, str]] = {
    **{name: ("ivon", "refuse", _IVON_OPTIMIZER)
       for name in ("optim", "optim_args", "optim_target_modules", "adam_beta1", "adam_beta2", "adam_epsilon")},
    "weight_decay": ("ivon", "refuse",
                     "IVON's weight decay is the precision of its Gaussian prior, `prior_precision` (δ, which also "
                     "sets the posterior's σ): pass method_config={{'prior_precision': ...}} (--prior_precision) "
                     "instead of {name}={value!r} with method={method!r}, and leave weight_decay at 0."),
    "fp16": ("ivon", "refuse", "fp16 with a gradient scaler is not supported with IVON (method={method!r}): IVON reads "
             "the gradients when each weight sample ends, before the scaler unscales them, so every update would be "
             "~65536x too large. Use bf16=True (autocast with fp32 weights) or full precision."),
    "deepspeed": ("ivon", "refuse", "IVON (method={method!r}) cannot train under DeepSpeed, which steps the optimizer "
                  "itself: use FSDP2 (fsdp_config={{'version': 2}}) or DDP."),
    "label_smoothing_factor": ("all", "refuse", "VariationalTrainer does not use it: choose "
                               "method='ls' with method_config={{'smoothing': ...}} instead, so that the method is "
                               "recorded and compared fairly."),
    "average_tokens_across_devices": ("all", "ignore", "every method's loss is a mean over its micro-batch's examples, "
                                      "so there are no token counts to average ({name}={value!r} has no effect)."),
}

#: The `TrainingArguments` fields every method honours as the stock Trainer does.
HONOURED_ARGUMENTS = frozenset("""
    output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type
    lr_scheduler_kwargs warmup_steps gradient_accumulation_steps max_grad_norm bf16 bf16_full_eval fp16_full_eval tf32
    activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing gradient_checkpointing_kwargs
    torch_compile torch_compile_backend torch_compile_mode use_liger_kernel liger_kernel_config use_cache
    neftune_noise_alpha torch_empty_cache_steps auto_find_batch_size logging_strategy logging_steps logging_first_step
    log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level log_level_replica disable_tqdm
    report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id eval_strategy eval_steps
    eval_delay per_device_eval_batch_size prediction_loss_only eval_on_start eval_do_concat_batches
    eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics save_only_model
    save_strategy save_steps save_on_each_node save_total_limit enable_jit_checkpoint push_to_hub hub_token
    hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision load_best_model_at_end
    metric_for_best_model greater_is_better ignore_data_skip restore_callback_states_from_checkpoint full_determinism
    seed data_seed use_cpu accelerator_config parallelism_config dataloader_drop_last dataloader_num_workers
    dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context
    dataloader_in_order remove_unused_columns label_names train_sampling_strategy length_column_name
    ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout fsdp
    fsdp_config debug skip_memory_metrics do_train do_eval do_predict resume_from_checkpoint local_rank
""".split())


def check_unhonoured_arguments(args: VariationalTrainingArguments) -> None:
    """Refuse (or warn about) a field set to a value `args.method` cannot honour: a `TrainingArguments` field as
    `UNHONOURED_ARGUMENTS` declares; with a method that learns no posterior, a setting of prediction with one
    (`POSTERIOR_FIELDS`) other than its default, which the run would ignore while its record looked as if it had been
    used; with one that does, MC dropout."""
    posterior = get_method_class(args.method).learns_posterior
    defaults = {f.name: f.default for f in dataclasses.fields(VariationalTrainingArguments)}
    for name, (methods, action, why) in UNHONOURED_ARGUMENTS.items():
        value = getattr(args, name)
        value = getattr(value, "value", value)  # an enum (optim) as the user wrote it
        if (methods == "ivon" and not posterior) or value in (defaults[name], None):
            continue
        message = why.format(name=name, value=value, method=args.method)
        if action == "refuse":
            raise ValueError(f"{name}={value!r} cannot be honoured: {message}")
        logger.warning("%s=%r is ignored: %s", name, value, message)
    given = [f"{name}={getattr(args, name)!r}" for name in POSTERIOR_FIELDS if getattr(args, name) != defaults[name]]
    if given and not posterior:
        raise ValueError(
            f"{', '.join(given)} {'is a setting' if len(given) == 1 else 'are settings'} of prediction with IVON's "
            f"posterior, and method={args.method!r} learns none: {'it' if len(given) == 1 else 'they'} would be "
            f"silently ignored. Drop {', '.join(g.split('=')[0] for g in given)}, or choose an IVON method "
            "(method='ivon')."
        )
    if args.mc_dropout_samples and posterior:
        raise ValueError(
            f"mc_dropout_samples={args.mc_dropout_samples} with method={args.method!r}: IVON methods predict by "
            "Bayesian model averaging over their posterior (eval_mc_samples). Use MC dropout with a method without "
            "a posterior (e.g. method='erm'), or set mc_dropout_samples=0."
        )
