"""ALASCA (Ko et al. 2023, "A Gift from Label Smoothing: Robust Training with Adaptive Label Smoothing via Auxiliary
Classifier under Label Noise", AAAI-23; jongwooko/ALASCA): adaptive label smoothing on auxiliary classifiers.

Auxiliary classifiers (ACs) on intermediate features are trained with adaptively smoothed labels whose
confidence comes from an exponential moving average of the main head's logits per training example; the main
head keeps the plain loss (CE) on the given labels. Per micro-batch (Ko et al. 2023, Alg. 1, as the reference code
runs it, `losses/ALASCA.py`):

    t_i ← β·t_i + (1 − β)·f(x_i)                  EMA of the main logits (t_i = 0 at the start), before use
    conf_i = softmax(t_i / τ)_{y_i}                sharpening with τ < 1
    conf_i ← r·conf_i + (1 − r),  r = min(1, epoch / warm-up)     hard labels at epoch 0, adaptive from the warm-up on
    loss = CE(f(x), y) + λ·Σ_AC mean_i CE(f_AC(x_i), s_i),  s_i = conf_i on y_i, (1 − conf_i)/(K − 1) elsewhere

Defaults β = 0.7, τ = 1/3, λ = 2 (paper §4.1), warm-up 30 epochs (hard-coded in the code, not in the paper).
Setting `alasca_ema=0, alasca_temperature=1, alasca_lambda=1, alasca_warmup_epochs=3` gives the code's Clothing1M
variant (instantaneous softmax, no sharpening).

Where the reference code and the paper differ, the code is implemented:
* AC target: the code's s_i spreads 1 − conf over the *other* classes, i.e. (1 − α̃)·CE + α̃/(K−1)·Σ_{j≠y} CE_j
  with α̃ = 1 − conf; the paper's Eq. 2 uses Ω(f) = K·CE(f, u), about K times stronger smoothing.
* the warm-up r above is in the code only.
* inference: the code averages the main head and the last AC, the paper's ALASCA* all heads; here the ACs
  are training-only (left out of the saved model), and prediction uses the main head.

Adaptations to the Trainer's models (the paper is CNN-only):
* features are the model's `hidden_states` (`output_hidden_states=True`, added to the training forward by a
  hook; the ACs run in a forward hook of the model, see heads.py): CNN stages (HF ResNet/ConvNeXt, timm
  through `TimmWrapperForImageClassification`) are averaged over space, transformer layers over the tokens
  of the attention mask;
* ACs sit on `alasca_num_classifiers` evenly spaced intermediate blocks (ResNet-34: after layers 1, 2, 3, as
  the code's `--position_all`); each AC is one linear layer on the pooled feature, where the code uses a
  convolutional bottleneck branch (Conv1×1 → strided Conv k×k → Conv1×1 → pool → Linear).
* under DDP the EMA is updated with the logits of all processes (gathered), so every process holds the same
  table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .base import IGNORE_INDEX, MethodConfig, MethodContext, TrainingMethod, register_method
from .heads import AuxiliaryHeads, attach_heads, output_layer, tie_to_logits

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["ALASCAConfig", "ALASCAMethod", "alasca_targets", "auxiliary_positions"]


def auxiliary_positions(num_blocks: int, num_classifiers: int) -> list[int]:
    """Evenly spaced intermediate `hidden_states` indices in [1, num_blocks − 1] (0 is the stem, num_blocks the last
    block)."""
    if num_blocks < 2:
        raise ValueError(f"ALASCA needs a model with at least 2 blocks (one intermediate feature), got {num_blocks}.")
    spots = {round(i * num_blocks / (num_classifiers + 1)) for i in range(1, num_classifiers + 1)}
    return sorted({min(max(s, 1), num_blocks - 1) for s in spots})


def hidden_state_channels(model: nn.Module) -> list[int]:
    """Feature width of each entry of the model's `hidden_states` (stem/embeddings first), without a forward pass."""
    timm_model = getattr(model, "timm_model", None)
    if timm_model is not None and hasattr(timm_model, "feature_info"):
        return [info["num_chs"] for info in timm_model.feature_info]
    config = getattr(model, "config", None)
    if getattr(config, "hidden_sizes", None):
        stem = getattr(config, "embedding_size", None) or config.hidden_sizes[0]
        return [stem, *config.hidden_sizes]
    if getattr(config, "hidden_size", None) and getattr(config, "num_hidden_layers", None):
        return [config.hidden_size] * (config.num_hidden_layers + 1)
    raise ValueError(
        f"ALASCA cannot tell the intermediate feature sizes of {type(model).__name__}: it needs a transformers model "
        "with `config.hidden_sizes` (CNNs) or `config.hidden_size` and `num_hidden_layers` (transformers), or a "
        "TimmWrapperForImageClassification."
    )


def alasca_targets(confidence: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """s = conf on the label and (1 − conf)/(K − 1) on every other class (reference `NLLLoss`)."""
    one_hot = F.one_hot(labels, num_classes).float()
    confidence = confidence.unsqueeze(1)
    return one_hot * confidence + (1.0 - one_hot) * (1.0 - confidence) / (num_classes - 1)


def _pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if hidden.dim() == 4:  # (B, C, H, W)
        return hidden.mean(dim=(2, 3))
    if hidden.dim() == 3:  # (B, T, H)
        if attention_mask is None or attention_mask.shape != hidden.shape[:2]:
            return hidden.mean(dim=1)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    raise ValueError(f"ALASCA expects hidden states of shape (B, C, H, W) or (B, T, H), got {tuple(hidden.shape)}.")


@dataclass
class ALASCAConfig(MethodConfig):
    """Settings of method='alasca' (defaults: the paper's §4.1 and the reference code's warm-up)."""

    alasca_lambda: float = field(default=2.0,
                                 metadata={"help": "method='alasca': weight λ of the auxiliary classifiers' loss (Ko "
                                                   "et al. 2023)."})
    alasca_ema: float = field(default=0.7,
                              metadata={"help": "method='alasca': EMA coefficient β of the per-example logits."})
    alasca_temperature: float = field(
        default=1 / 3, metadata={"help": "method='alasca': sharpening temperature τ of the EMA logits (softmax(t/τ))."}
    )
    alasca_warmup_epochs: float = field(
        default=30.0,
        metadata={"help": "method='alasca': epochs over which the AC targets move linearly from hard to adaptive "
                          "(reference code)."},
    )
    alasca_num_classifiers: int = field(
        default=3,
        metadata={"help": "method='alasca': auxiliary classifiers on evenly spaced intermediate blocks (ResNet-34: "
                          "layers 1-3)."},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.alasca_ema < 1.0:
            raise ValueError(f"alasca_ema (β) must be in [0, 1), got {self.alasca_ema}.")
        if not self.alasca_temperature > 0 or self.alasca_lambda < 0 or self.alasca_warmup_epochs < 0:
            raise ValueError("alasca_temperature must be > 0, alasca_lambda and alasca_warmup_epochs >= 0.")
        if self.alasca_num_classifiers < 1:
            raise ValueError(f"alasca_num_classifiers must be >= 1, got {self.alasca_num_classifiers}.")


class ALASCAMethod(TrainingMethod):
    """CE on the main head plus adaptive label smoothing on auxiliary classifiers (Ko et al. 2023, Alg. 1)."""

    paper: ClassVar[str] = ("Ko et al. 2023 (ALASCA), A Gift from Label Smoothing: Robust Training with Adaptive Label "
                            "Smoothing via Auxiliary Classifier under Label Noise")
    needs_example_index: ClassVar[bool] = True
    config: ALASCAConfig

    def __init__(self, config: Any = None, num_train_examples: int | None = None) -> None:
        super().__init__(config, num_train_examples)
        self.heads: AuxiliaryHeads | None = None
        self.positions: list[int] = []
        self.ema: torch.Tensor | None = None
        self._aux_logits: tuple[torch.Tensor, ...] | None = None
        self._attention_mask: torch.Tensor | None = None

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        if not self.num_train_examples:
            raise ValueError("ALASCA keeps an EMA per training example and needs a training dataset with a length.")
        channels = hidden_state_channels(model)
        num_classes = output_layer(model).out_features
        self.positions = auxiliary_positions(len(channels) - 1, self.config.alasca_num_classifiers)
        self.heads = attach_heads(model,
                                  {f"classifier_{i}": nn.Linear(channels[i], num_classes) for i in self.positions})
        device = next(model.parameters()).device
        self.ema = torch.zeros(self.num_train_examples, num_classes, device=device)
        model.register_forward_pre_hook(self._request_hidden_states, with_kwargs=True)
        model.register_forward_hook(self._auxiliary_logits)

    def _request_hidden_states(self, module: nn.Module, args: tuple,
                               kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if module.training:
            kwargs = {**kwargs, "output_hidden_states": True}
            self._attention_mask = kwargs.get("attention_mask")
        return args, kwargs

    def _auxiliary_logits(self, module: nn.Module, args: tuple, output: Any) -> Any:
        # inside the model's forward, so that DDP sees the ACs' parameters in use (heads.py)
        if not module.training:
            return output
        hidden_states = getattr(output, "hidden_states", None)
        if hidden_states is None:
            raise ValueError(f"alasca: {type(module).__name__} returned no `hidden_states` for "
                             "output_hidden_states=True.")
        attention_mask, self._attention_mask = self._attention_mask, None
        self._aux_logits = tuple(
            self.heads[f"classifier_{i}"](_pool(hidden_states[i], attention_mask)) for i in self.positions
        )
        return tie_to_logits(output, list(self._aux_logits))

    # -- loss --------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_ema(self, index: torch.Tensor, logits: torch.Tensor, accelerator: "Accelerator | None" = None) -> None:
        """t_i ← β·t_i + (1 − β)·f(x_i) for the examples of this micro-batch on every process (gathered through
        `accelerator` under DDP)."""
        if accelerator is not None and accelerator.num_processes > 1:
            index = accelerator.gather(accelerator.pad_across_processes(index, pad_index=-1))
            logits = accelerator.gather(accelerator.pad_across_processes(logits))
            index, logits = index[index >= 0], logits[index >= 0]
        beta = self.config.alasca_ema
        self.ema[index] = beta * self.ema[index] + (1.0 - beta) * logits

    def confidence(self, index: torch.Tensor, labels: torch.Tensor, epoch: int) -> torch.Tensor:
        """conf = r·softmax(t/τ)_y + (1 − r), r = min(1, epoch/warm-up) (reference `ALASCA.forward`)."""
        conf = F.softmax(self.ema[index] / self.config.alasca_temperature, dim=-1).gather(
            1, labels.unsqueeze(1)).squeeze(1)
        warmup = self.config.alasca_warmup_epochs
        ramp = min(1.0, epoch / warmup) if warmup > 0 else 1.0
        return ramp * conf + (1.0 - ramp)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        if self._aux_logits is None:
            raise RuntimeError(
                "alasca: the auxiliary classifiers are not attached; build the trainer with `model=` (not "
                "`model_init`)."
            )
        if context.example_index is None:
            raise KeyError("alasca needs the example index of the training batch (MethodContext.example_index); "
                           "VariationalTrainer adds it to train_dataset.")
        aux_logits, self._aux_logits = self._aux_logits, None
        keep = labels != IGNORE_INDEX
        index, labels = context.example_index[keep].to(self.ema.device), labels[keep]
        logits = logits[keep].float()
        if self.ema.device != logits.device:  # restored from a checkpoint on the CPU
            self.ema = self.ema.to(logits.device)
        loss = F.cross_entropy(logits, labels)
        if context.is_training:
            self.update_ema(index, logits.detach(), context.accelerator)
        target = alasca_targets(self.confidence(index, labels, int(context.epoch)), labels, logits.shape[-1])
        for aux in aux_logits:
            loss = (loss
                    + self.config.alasca_lambda * -(target * F.log_softmax(aux[keep].float(), dim=-1)).sum(-1).mean())
        return loss

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.heads is None:
            return {}
        return {"ema": self.ema.cpu().clone(), "heads": self.heads.heads_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.heads is None:
            raise RuntimeError("alasca: cannot restore the auxiliary classifiers before they are attached to a model.")
        if state["ema"].shape != self.ema.shape:
            raise ValueError(f"alasca: checkpoint EMA has shape {tuple(state['ema'].shape)}, this run needs "
                             f"{tuple(self.ema.shape)}.")
        self.ema = state["ema"].to(self.ema.device)
        self.heads.load_heads_state_dict(state["heads"])

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "auxiliary_positions": self.positions}


register_method("alasca", ALASCAConfig, ALASCAMethod)
