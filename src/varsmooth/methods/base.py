"""The one small interface every training method implements, and the registry of methods (peft-style).

A method decides three things for `VariationalTrainer`: whether IVON is the optimizer (and with which
settings), the training loss computed from the model's logits, and any extra state it must checkpoint.
Optional hooks: `attach` (extra heads trained with the model, see `heads.py`), `training_step` (methods with
their own forward/backward schedule, e.g. SAM's two passes) and `needs_example_index` (per-example state).

A method never sees the trainer: each call gets a `MethodContext` (step, epoch, training or not, the accelerator,
the batch's example indices) built by the trainer, so that a method can be run and tested without one.
Its settings are its own config dataclass (`MethodConfig` subclass), registered together with it by
`register_method(name, config_cls, method_cls)`; `VariationalTrainingArguments.method_config` holds one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..outputs import IGNORE_INDEX, logits_of, model_outputs  # IGNORE_INDEX: the label every loss skips

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..posterior import DiagonalGaussianPosterior

__all__ = [
    "EXAMPLE_INDEX_KEY", "IGNORE_INDEX", "METHODS", "ExampleIndexDataset", "MethodConfig", "MethodContext",
    "MethodInfo", "OptimizerContext", "TrainingMethod", "build_method_config", "get_method_class",
    "get_method_config_class", "learns_posterior", "list_methods", "register_method",
]

#: batch key holding each example's position in the training set (added by the trainer, never seen by the model)
EXAMPLE_INDEX_KEY = "example_index"


@dataclass
class MethodConfig:
    """Settings of a method that has none (ERM).

    Subclasses are dataclasses, the one place each setting of their method is declared, defaulted and checked (in
    `__post_init__`). The examples parse `--method` first, then that method's config class as flags of their own
    (`--sam_rho 0.1`), so a field may not share the name of a `VariationalTrainingArguments` field.
    """

    def training_argument_defaults(self) -> dict[str, Any] | None:
        """Defaults of `VariationalTrainingArguments` fields left unset (None) that this config decides (IVON's preset
        its `learning_rate` and `eval_mc_samples`); none by default; None while they wait for the model
        (`for_model`)."""
        return {}

    def for_model(self, model: Any) -> tuple[MethodConfig, str | None]:
        """This config completed for the model the trainer was handed (IVON chooses its preset), and a sentence for
        the log and the model card saying what was chosen and why (None: nothing to say)."""
        return self, None


@dataclass(frozen=True)
class MethodContext:
    """What a method may know about the run when the trainer calls it on one micro-batch.

    The defaults describe a single-process training pass at step 0, so a method's loss can be called directly:
    `method.loss(logits, labels, MethodContext())`.
    """

    #: optimizer steps done so far (`TrainerState.global_step`)
    step: int = 0
    #: fractional epoch (`TrainerState.epoch`; 0 before training)
    epoch: float = 0.0
    #: whether the model runs in training mode (False in evaluation passes: collect no statistics then)
    is_training: bool = True
    #: the run's `accelerate.Accelerator` (gather / backward / no_sync under DDP); None: one process, plain autograd
    accelerator: Accelerator | None = None
    #: position of each example of the batch in the training set (only for methods with `needs_example_index`)
    example_index: torch.Tensor | None = None
    #: the Trainer's count of labels in the whole accumulated batch (the losses here are micro-batch means)
    num_items_in_batch: Any = None
    #: micro-batches per optimizer step: a `training_step` returns and backpropagates its loss divided by this
    gradient_accumulation_steps: int = 1
    #: a loss given to the trainer (`compute_loss_func(outputs, labels, num_items_in_batch=<labelled examples of the
    #: micro-batch>)`) that replaces the method's cross-entropy (only for methods whose `loss` is the plain one)
    loss_func: Callable[..., torch.Tensor] | None = None
    # -- for `training_step` only -----------------------------------------------------------------------------
    #: a trainer subclass's own `compute_loss(model, inputs)` (the Trainer's extension point), which then replaces
    #: `TrainingMethod.compute_loss` in every pass (`training_loss`)
    loss_override: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor] | None = None
    #: the context a loss is computed under (the Trainer's autocast)
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    #: the trainer's optimizer (accelerate's wrapper, which a method unwraps for what the wrapper does not forward)
    optimizer: torch.optim.Optimizer | None = None
    #: DDP with the gradient all-reduce off for the passes inside it (a null context without DDP)
    no_sync: Callable[[torch.nn.Module], contextlib.AbstractContextManager] = lambda model: contextlib.nullcontext()
    #: whether the parameters are FSDP2 shards
    sharded: bool = False
    #: gradient-norm clipping (0: none)
    max_grad_norm: float = 0.0
    #: whether this micro-batch's backward completes the step's gradients (accumulated, all-reduced)
    gradients_complete: bool = True
    #: records whether a loss and the gradients of the given parameters (None: not complete yet) are finite; the
    #: trainer stops the step before it is applied when one is not
    note_finite: Callable[[torch.Tensor, list[torch.Tensor] | None], None] = lambda loss, params: None

    def backward(self, loss: torch.Tensor) -> None:
        """`accelerator.backward` (gradient scaling, DeepSpeed, ...) or plain `loss.backward()` without one."""
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()


@dataclass(frozen=True)
class OptimizerContext:
    """What a method may know of the run when it builds its optimizer (`TrainingMethod.create_optimizer`)."""

    #: optimizer steps of the whole run (`TrainerState.max_steps`); None when unknown (an IterableDataset)
    total_steps: int | None = None
    #: the run's seed (IVON's weight-noise seed)
    seed: int = 0
    #: this process's rank (IVON draws other noise on each rank)
    rank: int = 0
    #: whether the optimizer averages its gradient statistics over processes itself (DDP with the all-reduce off)
    sync: bool = False
    #: the run's peak learning rate (`TrainingArguments.learning_rate`); None: the method's `default_learning_rate`
    learning_rate: float | None = None


@dataclass
class CallbackContext:
    """What a method's callbacks may use of the run (`TrainingMethod.callbacks`): handles, never the trainer."""

    #: (mean ‖ε̄‖₁, mean ‖p̂ − 1/K‖₁) of the current posterior over a fixed probe of training examples, for
    #: (number of draws, seed) (`VariationalTrainer.probe_label_noise`)
    measure_label_noise: Callable[[int, int], tuple[float, float]] | None = None
    #: the seed of the draws that measure (`TrainingArguments.eval_seed`)
    seed: int = 0
    #: the optimizer of the moment (None before training builds it)
    optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None


@dataclass(frozen=True)
class MethodInfo:
    """One registered method, as `list_methods()` describes it."""

    name: str
    config_class: type[MethodConfig]
    method_class: type["TrainingMethod"]

    @property
    def summary(self) -> str:
        """The first paragraph of the method class's docstring, on one line."""
        return " ".join((self.method_class.__doc__ or "").strip().split("\n\n")[0].split())

    @property
    def paper(self) -> str | None:
        return self.method_class.paper

    @property
    def settings(self) -> dict[str, Any]:
        """The method's main settings with their defaults: the learning rate it gets when none is given (and, where it
        differs, `scratch_learning_rate`, the image example's rate for a network trained from scratch), then its
        config's fields as its default config holds them (for IVON, those of `ivon_preset="scratch"`; None: decided by
        the run)."""
        rates = {"learning_rate": self.method_class.default_learning_rate}
        if self.method_class.scratch_learning_rate is not None:
            rates["scratch_learning_rate"] = self.method_class.scratch_learning_rate
        return {**rates, **dataclasses.asdict(self.config_class())}

    def __str__(self) -> str:
        """One line: name, description, main settings and paper."""
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.name}: {self.summary} Settings: {settings}." + (f" Paper: {self.paper}." if self.paper else "")


#: method name -> its registration, in the order of registration
METHODS: dict[str, MethodInfo] = {}


def register_method(name: str, config_cls: type[MethodConfig],
                    method_cls: type["TrainingMethod"]) -> type["TrainingMethod"]:
    """Make `method_cls` the training method `name` (`VariationalTrainingArguments(method=name)`), configured by
    `config_cls`. Sets `method_cls.name`; returns `method_cls`.

    Raises if `name` is taken or if `method_cls` is already registered under another name.
    """
    if name in METHODS:
        existing = METHODS[name]
        raise ValueError(f"A training method named {name!r} is already registered ({existing.method_class.__name__} "
                         f"with {existing.config_class.__name__}); choose another name.")
    if not (isinstance(method_cls, type) and issubclass(method_cls, TrainingMethod)):
        raise TypeError(f"method_cls must be a subclass of TrainingMethod, got {method_cls!r}.")
    if not (isinstance(config_cls, type) and issubclass(config_cls, MethodConfig)
            and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"config_cls must be a dataclass subclassing MethodConfig, got {config_cls!r}.")
    for info in METHODS.values():
        if info.method_class is method_cls:
            raise ValueError(f"{method_cls.__name__} is already registered as {info.name!r}; subclass it to register "
                             "it again.")
    method_cls.name = name
    METHODS[name] = MethodInfo(name, config_cls, method_cls)
    return method_cls


def list_methods() -> list[MethodInfo]:
    """Every registered method, sorted by name: its name, config and method classes, one-line `summary`, main
    `settings` with their defaults, and `paper`; `print(*list_methods(), sep="\n")` shows one line each."""
    return [METHODS[name] for name in sorted(METHODS)]


def _info(name: str) -> MethodInfo:
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}. Choose one of: {', '.join(sorted(METHODS))}.")
    return METHODS[name]


def get_method_class(name: str) -> type["TrainingMethod"]:
    """The `TrainingMethod` subclass registered as `name` (`register_method`); an unknown name is refused with the
    registered ones."""
    return _info(name).method_class


def get_method_config_class(name: str) -> type[MethodConfig]:
    """The `MethodConfig` subclass registered for the method `name` (`register_method`); an unknown name is refused
    with the registered ones."""
    return _info(name).config_class


def learns_posterior(method: str | TrainingMethod | type[TrainingMethod]) -> bool:
    """Whether a method (its name, class or instance) learns a posterior, which predictions then average over
    (`TrainingMethod.learns_posterior`)."""
    cls = get_method_class(method) if isinstance(method, str) else method if isinstance(method, type) else type(method)
    return cls.learns_posterior


def _field_names(config_cls: type[MethodConfig]) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls) if f.init}


def build_method_config(method: str, config: MethodConfig | Mapping[str, Any] | str | None) -> MethodConfig:
    """The config of `method` from None (its defaults), a dict or JSON object string of its fields, or a config
    instance of its class (copied, so that the caller's object is never changed)."""
    config_cls = get_method_config_class(method)
    if config is None:
        return config_cls()
    if isinstance(config, MethodConfig):
        if type(config) is not config_cls:
            raise TypeError(f"method_config is a {type(config).__name__}, but method={method!r} is configured by "
                            f"{config_cls.__name__}.")
        return dataclasses.replace(config)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as error:
            raise ValueError(f"method_config must be a JSON object of {config_cls.__name__}'s fields, got {config!r} "
                             f"({error}).") from None
    if not isinstance(config, Mapping):
        raise TypeError(f"method_config must be a {config_cls.__name__}, a dict or a JSON object string, got "
                        f"{type(config).__name__}.")
    valid = _field_names(config_cls)
    unknown = sorted(set(config) - valid)
    if unknown:
        raise ValueError(f"method_config has {unknown}, which method={method!r} ({config_cls.__name__}) does not know; "
                         f"its fields are: {', '.join(sorted(valid)) or 'none'}.")
    return config_cls(**config)


class TrainingMethod:
    """Empirical risk minimisation: plain cross-entropy with whatever optimizer the Trainer's `optim` names.

    Subclasses override `loss` (and `create_optimizer` to train with an optimizer of their own), and may keep state that
    is saved in checkpoints through `state_dict`/`load_state_dict`. `self.config` is the method's `MethodConfig`.
    """

    #: the registered name (set by `register_method`)
    name: ClassVar[str]
    #: the paper the method comes from (authors, year, title), shown by `list_methods()`
    paper: ClassVar[str | None] = None
    #: per-example state (e.g. ALASCA's EMA): the trainer adds `EXAMPLE_INDEX_KEY` to every training batch
    needs_example_index: ClassVar[bool] = False
    #: learning rate used when the user gives none (TrainingArguments' own default for optimizer-agnostic methods)
    default_learning_rate: ClassVar[float] = 5e-5
    #: the rate for a network trained from scratch, where `default_learning_rate` (a fine-tuning rate) hardly moves it:
    #: the image example's default, chosen on its noisy validation split (benchmarks/example_learning_rates.py); None
    #: where `default_learning_rate` is already one
    scratch_learning_rate: ClassVar[float | None] = 1e-4
    #: whether the method learns a weight posterior, which predictions then average over (`posterior`)
    learns_posterior: ClassVar[bool] = False
    #: the settings that bound an update, named to the user who has to make steps smaller (a non-finite step)
    step_settings: ClassVar[str] = "learning_rate / set max_grad_norm"
    #: whether `training_step` clips the gradient norm (`MethodContext.max_grad_norm`) inside its passes, where the
    #: Trainer's clip after them would come too late; the Trainer then logs `last_grad_norm` as its grad_norm
    clips_inside_step: ClassVar[bool] = False
    #: the gradient norm, before clipping, of the last pass that clipped (with `clips_inside_step`)
    last_grad_norm: torch.Tensor | None = None

    def __init__(self, config: MethodConfig | Mapping[str, Any] | None = None,
                 num_train_examples: int | None = None) -> None:
        self.config = build_method_config(self.name, config)
        self.num_train_examples = num_train_examples

    @staticmethod
    def check_parallelism(fsdp_version: int | None, deepspeed: bool) -> None:
        """Refuse a sharding the method cannot train under (`fsdp_version` None: no FSDP); every method can by
        default."""

    def create_optimizer(self, named_parameters: list[tuple[str, torch.nn.Parameter]],
                         run: OptimizerContext) -> torch.optim.Optimizer | None:
        """The optimizer of the trainable `named_parameters` (as `Module.named_parameters` gives them); None (the
        default): the Trainer's own, as `optim` names it."""
        return None

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer passed to the trainer (`optimizers`) that the method cannot train with; any will do by
        default."""

    def use_optimizer(self, optimizer: torch.optim.Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]],
                      new: bool) -> None:
        """Called with the run's optimizer once the trainer has it (the method's, the Trainer's own or one passed in
        `optimizers`; `new`: just built) and the model's `named_parameters`. Nothing by default."""

    def posterior(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  metadata: Mapping[str, Any]) -> DiagonalGaussianPosterior | None:
        """The posterior of `model`'s weights learned so far in `optimizer` (accelerate's wrapper or not), recording
        `metadata` too; None (the default): none learned."""
        return None

    def discard_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Forget what `optimizer` gathered for a step that is not applied (a non-finite one); the next step starts
        afresh. Nothing by default: the Trainer zeroes the gradients itself."""

    def restore_state(self, optimizer: torch.optim.Optimizer | None, model: torch.nn.Module, checkpoint: str,
                      step: int) -> str | None:
        """Restore the optimizer state that belongs with the weights just loaded from `checkpoint` into `model` (the
        best model at the end of training); returns the file it came from, None (the default) when nothing needs it.
        `step`: the step count when the checkpoint records none."""
        return None

    def settings_before_resume(self, optimizer: torch.optim.Optimizer | None) -> Any:
        """What `reconcile_resume` compares the resumed optimizer's settings with, taken before its state is loaded;
        None by default."""
        return None

    def reconcile_resume(self, optimizer: torch.optim.Optimizer | None, before: Any, checkpoint: str,
                         optimizer_state_loaded: bool, model: torch.nn.Module, step: int) -> None:
        """After the Trainer loaded the optimizer state of `checkpoint` (or skipped it: `optimizer_state_loaded`
        False), settle what the method's own settings and state need: refuse settings that contradict the
        checkpoint's, restore state the Trainer skipped. Nothing by default."""

    def after_training(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Called once training ends, after the trainer's own steps (e.g. a warning about what was learned)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        """Mean training loss of one micro-batch (labels equal to -100 are ignored)."""
        return F.cross_entropy(logits.float(), labels)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any],
                     context: MethodContext) -> tuple[torch.Tensor, Any]:
        """(mean loss, model outputs) of one micro-batch: `loss` on the model's logits (or `context.loss_func` on its
        outputs); a micro-batch without any label gives a zero-gradient loss, for every method."""
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(f"The training batch has no 'labels' (keys: {sorted(inputs)}); name the label column "
                             "'label' or 'labels'.")
        outputs = model_outputs(model, inputs, exclude=(EXAMPLE_INDEX_KEY,))
        logits = logits_of(outputs)
        if labels.numel() and (labels == IGNORE_INDEX).all():
            return logits.sum() * 0.0, outputs
        if context.loss_func is not None:
            # the labelled examples of this micro-batch: HF's documented `sum / num_items_in_batch` is then its mean
            return context.loss_func(outputs, labels, num_items_in_batch=(labels != IGNORE_INDEX).sum()), outputs
        return self.loss(logits, labels,
                         dataclasses.replace(context, example_index=inputs.get(EXAMPLE_INDEX_KEY))), outputs

    def training_loss(self, model: torch.nn.Module, inputs: dict[str, Any], context: MethodContext) -> torch.Tensor:
        """The loss a `training_step` backpropagates: `compute_loss` (or `context.loss_override`) under
        `context.loss_context()`."""
        with context.loss_context():
            if context.loss_override is not None:
                return context.loss_override(model, dict(inputs))
            return self.compute_loss(model, dict(inputs), context)[0]

    def attach(self, model: torch.nn.Module) -> None:
        """Called once by the trainer before the optimizer exists: add extra heads or hooks to `model`."""

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], context: MethodContext) -> torch.Tensor:
        """Override to schedule the forward/backward passes of one micro-batch yourself (the Trainer's own
        `training_step` runs otherwise). `model` is in training mode and `inputs` are on its device; compute losses
        with `training_loss`, backpropagate `loss / context.gradient_accumulation_steps`,
        note the loss and the complete gradients with `context.note_finite`, and return the detached loss to log,
        divided the same way."""
        raise NotImplementedError(f"{self.name} uses the Trainer's training_step")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def callbacks(self, run: CallbackContext) -> list[Any]:
        """`TrainerCallback`s the method needs (e.g. end-of-epoch updates), connected to what they use of `run`."""
        return []

    def training_log(self, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        """What a training log reports of the method's state beside the loss (IVON: whether its posterior learns)."""
        return {}

    def hyperparameters(self) -> dict[str, Any]:
        """What the model card reports about this method: its name and config."""
        return {"method": self.name, **dataclasses.asdict(self.config)}


register_method("erm", MethodConfig, TrainingMethod)


class ExampleIndexDataset(Dataset):
    """A map-style dataset whose rows also carry their position, under `EXAMPLE_INDEX_KEY`.

    Wrapping (instead of adding a column) keeps `set_transform`/`with_transform` outputs intact, and the
    index survives the Trainer's column removal because the trainer lists it among the signature columns.
    """

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"This method keeps per-example state and needs a map-style training dataset with a length, got "
                f"{type(dataset).__name__} (an IterableDataset has no stable example index)."
            )
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def _with_index(self, row: Any, index: int) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise TypeError(f"Training examples must be dicts to carry {EXAMPLE_INDEX_KEY!r}, got "
                            f"{type(row).__name__}.")
        return {**row, EXAMPLE_INDEX_KEY: index}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._with_index(self.dataset[index], index)

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        # `datasets.Dataset` fetches a whole batch at once; keep that fast path
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return [self._with_index(row, i) for row, i in zip(rows, indices)]
