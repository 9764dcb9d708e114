"""Label smoothing (LS, Szegedy et al. 2016) and generalized / negative label smoothing (GLS/NLS, Wei et al. 2022).

Both use the uniform-over-K convention (Szegedy et al. 2016; "Variational Learning Induces Adaptive Label
Smoothing", Eq. 1; Wei et al. 2022, "To Smooth or Not? When Label Smoothing Meets Noisy Labels", Eq. 1; torch's and
HF's `label_smoothing`): the target is (1 − r)·e_y + (r/K)·1, so the labelled class gets 1 − r + r/K.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from .base import IGNORE_INDEX, MethodConfig, MethodContext, TrainingMethod, register_method

__all__ = [
    "GeneralizedLabelSmoothingConfig", "GeneralizedLabelSmoothingMethod", "LabelSmoothingConfig",
    "LabelSmoothingMethod", "optimal_smoothing_rate", "smoothed_cross_entropy",
]

logger = logging.getLogger(__name__)


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, rate: float) -> torch.Tensor:
    """Mean CE against y^{GLS,r} = (1 − r)·e_y + (r/K)·1 (Wei et al. 2022, Eq. 1), for any r < 1.

    Equals (1 − r)·(−log p_y) + r·mean_k(−log p_k), the reference `loss_gls`. Written out because torch's
    `label_smoothing=r` silently returns plain CE for r < 0.
    """
    keep = labels != IGNORE_INDEX
    log_probs = F.log_softmax(logits[keep].float(), dim=-1)
    nll = -log_probs.gather(1, labels[keep].unsqueeze(1)).squeeze(1)
    uniform = -log_probs.mean(dim=-1)
    return ((1.0 - rate) * nll + rate * uniform).mean()


def optimal_smoothing_rate(noise_rate: float, num_classes: int, clean_rate: float = 0.0) -> float:
    """r_opt = ((K−1)·r* − K·ε) / ((K−1) − K·ε) for symmetric noise T_ij = ε/(K−1) (Wei et al. 2022, Thm 3.3/3.6).

    `clean_rate` is r*, the best rate on clean data. NLS (r_opt < 0) is preferred iff ε > (K−1)·r*/K. At
    ε = (K−1)/K the labels carry no information about the class (the pole), so ε must stay below it.
    """
    k = num_classes
    if k < 2:
        raise ValueError(f"num_classes must be >= 2, got {k}.")
    if not clean_rate < 1.0:
        raise ValueError(f"clean_rate r* must be < 1, got {clean_rate}.")
    if not 0.0 <= noise_rate < (k - 1) / k:
        raise ValueError(
            f"noise_rate must be in [0, (K-1)/K) = [0, {(k - 1) / k:.4g}) for K={k}, got {noise_rate}: at (K-1)/K the "
            "noisy labels are independent of the true class and no smoothing rate helps."
        )
    return ((k - 1) * clean_rate - k * noise_rate) / ((k - 1) - k * noise_rate)


@dataclass
class LabelSmoothingConfig(MethodConfig):
    """Settings of method='ls'."""

    smoothing: float = field(
        default=0.1,
        metadata={"help": "method='ls': smoothing rate α in [0, 1]; target (1-α)·onehot + α/K (uniform over all K "
                          "classes)."},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in [0, 1], got {self.smoothing} (for negative rates use "
                             "method='gls').")


class LabelSmoothingMethod(TrainingMethod):
    """Label smoothing: cross-entropy against (1 − α)·e_y + α/K·1 with α = `smoothing`, the convention of HF
    `label_smoothing_factor`."""

    paper: ClassVar[str] = "Szegedy et al. 2016, Rethinking the Inception Architecture for Computer Vision"
    config: LabelSmoothingConfig

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        return smoothed_cross_entropy(logits, labels, self.config.smoothing)


@dataclass
class GeneralizedLabelSmoothingConfig(MethodConfig):
    """Settings of method='gls'."""

    gls_rate: float = field(
        default=0.1,
        metadata={"help": "method='gls': smoothing rate r < 1 of (1-r)·onehot + r/K; r < 0 is negative label smoothing "
                          "(Wei et al. 2022). Default 0.1 as in the reference code; "
                          "varsmooth.methods.optimal_smoothing_rate gives r_opt for a known symmetric noise rate."},
    )
    gls_warmup_epochs: float = field(
        default=0.0,
        metadata={"help": "method='gls': epochs of plain cross-entropy before switching to gls_rate (the reference "
                          "warms up with CE before NLS, whose loss is unbounded below)."},
    )

    def __post_init__(self) -> None:
        if not self.gls_rate < 1.0:
            raise ValueError(f"gls_rate must be < 1 (the labelled class keeps 1 - r + r/K > 0), got {self.gls_rate}.")
        if self.gls_warmup_epochs < 0:
            raise ValueError(f"gls_warmup_epochs must be >= 0, got {self.gls_warmup_epochs}.")


class GeneralizedLabelSmoothingMethod(TrainingMethod):
    """Generalized label smoothing: cross-entropy against (1 − r)·e_y + r/K·1 with rate r = `gls_rate` < 1; r < 0 is
    negative label smoothing (Wei et al. 2022, Eq. 1).

    NLS is unbounded below: the target has negative entries, so scaling up correct logits drives the loss to
    −∞ (r = −0.5, K = 5: loss 0.5, −4, −40, −400 for logit scales 1, 10, 100, 1000). The reference
    therefore trains with CE first (`main_warmup.py`) and fine-tunes with GLS at a tiny learning rate; here
    `gls_warmup_epochs` trains with r = 0 (CE) for that many epochs before switching, and the first negative
    batch loss is logged as a warning.
    """

    paper: ClassVar[str] = "Wei et al. 2022, To Smooth or Not? When Label Smoothing Meets Noisy Labels"
    config: GeneralizedLabelSmoothingConfig

    def __init__(self, config: Any = None, num_train_examples: int | None = None) -> None:
        super().__init__(config, num_train_examples)
        self._warmup_ended_logged = False
        self._negative_loss_logged = False

    def rate(self, epoch: float) -> float:
        """The smoothing rate in use at (fractional) `epoch`: 0 during the CE warm-up, then `gls_rate`."""
        return 0.0 if epoch < self.config.gls_warmup_epochs else self.config.gls_rate

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, context: MethodContext) -> torch.Tensor:
        epoch = context.epoch
        rate = self.rate(epoch)
        if self.config.gls_warmup_epochs > 0 and rate != 0.0 and not self._warmup_ended_logged:
            logger.info("GLS: CE warm-up over at epoch %.2f (step %d); training with smoothing rate %s from now on.",
                        epoch, context.step, rate)
            self._warmup_ended_logged = True
        loss = smoothed_cross_entropy(logits, labels, rate)
        if rate < 0 and not self._negative_loss_logged and loss.item() < 0:
            logger.warning(
                "NLS loss is negative (%.4g at step %d): with gls_rate=%s the loss is unbounded below and grows more "
                "negative as logits grow. Keep the learning rate small after the warm-up (the reference fine-tunes "
                "at 1e-6), use weight decay, or set gls_warmup_epochs.", loss.item(), context.step, rate,
            )
            self._negative_loss_logged = True
        return loss


register_method("ls", LabelSmoothingConfig, LabelSmoothingMethod)
register_method("gls", GeneralizedLabelSmoothingConfig, GeneralizedLabelSmoothingMethod)
