"""IVON's presets, and the run-length rule that lets the posterior adapt in the runs users make.

IVON's Hessian h is an exponential moving average with rate β2 (Variational Learning Induces Adaptive Label Smoothing
(Yang et al. 2025), Alg. 1, line 5): it forgets its initial value h0 over about 1/(1 − β2) optimizer steps. The authors'
β2 = 0.99999 (a window of 1e5 steps) fits their 200-epoch CIFAR runs (~2e5 steps); in a run of a few thousand steps h
never leaves h0, the posterior std σ = 1/sqrt(λ(h + δ)) stays where the prior settings put it, and IVON is in effect the
paper's fixed-Hessian ablation (benchmarks/training_length.py).

The rule here ties the window to the run instead: with T the number of optimizer steps of the run,

    β2 = 1 − 1 / max(c · T, 300),        T = ceil(epochs · ceil(ceil(N / (B · processes)) / accumulation))

This rule is the default (`hessian_window=0.1`, `default_beta2`) for every run too short for its preset's β2 to
move the Hessian (1 − β2^T < 0.1: with the authors' 0.99999, any run under ~10k steps); longer runs keep the preset's
β2, a `beta2` the user gives turns the rule off, and a run of unknown length (an IterableDataset without max_steps)
keeps the preset's β2. Under the rule the Hessian averages over the last fraction c of the run whatever its length,
dataset size N or batch size B, but never over fewer than 300 steps: h starts falling at once (its estimate is ~0 for
most weights), and if σ grows before the network has begun to fit, training never takes off (scikit-learn digits, 1k
examples, 480 steps: a 48-step window left IVON at chance accuracy, a 300-step window trained normally).
As h falls, IVON's effective step lr·(h0 + δ)/(h + δ) grows; element-wise clipping of the preconditioned update
(`clip_radius`) keeps it bounded — without it the 100-epoch reference run diverged in 4 of 4 seeds.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .peft_keys import is_peft_model

__all__ = [
    "FINETUNE_PRESET",
    "LORA_PRESET",
    "SCRATCH_PRESET",
    "HESSIAN_WINDOW_CLIP_RADIUS",
    "DEFAULT_HESSIAN_WINDOW",
    "IVON_PRESETS",
    "MIN_HESSIAN_WINDOW_STEPS",
    "MIN_STEP_BOUND",
    "HESSIAN_MOVE_THRESHOLD",
    "beta2_for_window",
    "choose_preset",
    "default_beta2",
    "hessian_window_of",
    "newly_initialized_modules",
    "total_optimizer_steps",
]

#: IVON settings of `ivon_preset="scratch"` (the default): the authors' CIFAR recipe for training from scratch (Shen et
#: al. 2024, "Variational Learning is Effective for Large Deep Networks"). With lr = 0.2 (the method's default learning
#: rate) and ess = the training-set size, these fill the fields a user leaves unset (None); see FINETUNE_PRESET.
#: `long_run_beta2` is the authors' β2, kept for runs long enough for it to move the Hessian (`default_beta2`).
SCRATCH_PRESET: dict[str, float | bool] = {"hess_init": 0.5, "long_run_beta2": 0.99999, "prior_precision": 2e-4,
                                           "rescale_lr": True, "eval_mc_samples": 32, "new_weight_lr_scale": 1.0}

#: IVON settings for fine-tuning a pretrained model (`ivon_preset="finetune"`, the trainer's choice for weights loaded
#: from a checkpoint). The posterior starts *at* the pretrained weights with σ0 = 1/sqrt(ess·(h0 + δ)) ≈ 3e-3, far
#: below typical weight magnitudes (ess 1e8 was kept over 1e7 and 1e9, σ0 1e-2 and 1e-3, at lr 0.02 on the same noisy
#: validation splits as the rate); δ = 0, so nothing pulls the pretrained weights towards 0; β2 follows 0.999, a
#: ~1,000-step window, in runs of 106 steps or more (shorter ones take the run-length rule; 0.999 was chosen at lr 0.02
#: over the rule and the authors' 0.99999 on the same noisy validation splits as the rate); no lr rescaling, and the
#: element-wise clip bounds each weight's step by lr·clip_radius. With h0 this small the preconditioned update exceeds
#: the clip for nearly every weight, so every weight moves by that bound each step, a sign step (as Lion's), which
#: needs a smaller rate than AdamW's: lr 0.02 (a step of at most 2e-5) was chosen among 0.01-0.1 on the noisy
#: validation splits of a user's `from_pretrained` MiniLM and EfficientNet-Lite0 against AdamW at HF's 5e-5
#: (benchmarks/hf_finetune.py); the former 0.3 (3e-4 for every weight, embeddings and LayerNorm included) left the
#: MiniLM at chance. The new head trains at the same rate (new_weight_lr_scale 1, kept over 10 and 30 on the same
#: splits over 3 seeds: they lift the EfficientNet's validation accuracy by 9-11 points, the MiniLM's not at all,
#: 0.1-0.4 below, and the worst task decides; an image fine-tune may pass 30). The authors' from-scratch settings
#: (lr 0.2, h0 0.5, ess = N) reached 39.6 % vs 66.0 % on CIFAR-10N "worse" with a pretrained EfficientNet-Lite0.
FINETUNE_PRESET: dict[str, float | bool] = {
    "learning_rate": 0.02, "ess": 1e8, "hess_init": 1e-3, "prior_precision": 0.0, "long_run_beta2": 0.999,
    "rescale_lr": False, "clip_radius": 1e-3, "new_weight_lr_scale": 1.0,
}

#: IVON settings for LoRA adapters on a pretrained model (`ivon_preset="lora"`): the recipe of Cong et al. 2024,
#: "Variational Low-Rank Adaptation Using IVON" (their released scripts; r = 8, α = 16 on the query/value projections),
#: but for the learning rate:
#: - lr 1.0 with rescale_lr False and clip_radius 1e-3: the per-coordinate step of the mean is at most
#:   lr·clip_radius = 1e-3, AdamW-LoRA's usual rate. Their lr 0.03 (at most 3e-5 a step) is set for 10k steps: in the
#:   189 steps of benchmarks/lora.py it left the adapters where they started (20-51 points below AdamW-LoRA, near
#:   chance), while lr 1.0 with the run-length β2 matched or beat AdamW-LoRA on all four tasks (+0.2 to +3.7 points,
#:   3 seeds; benchmarks/README.md, "LoRA");
#: - ess 1e7: the middle of the 1e6-1e8 the authors ran (1e6 on ARC/OBQA, 1e7 on WinoGrande-S and BoolQ, 1e8 on
#:   WinoGrande-M), far above the number of training examples, as in all of them: with hess_init 1e-3 the initial
#:   posterior std σ0 = 1/sqrt(ess·h0) = 0.01 (their range: 6e-3 to 3e-2), small against LoRA's A weights
#:   (Kaiming-uniform, ~1/sqrt(hidden size) ≈ 0.05 for 384-wide MiniLM) so the sampled adapters still fit;
#: - hess_init 1e-3: the upper end of their 3e-4-1e-3, as FINETUNE_PRESET (the smaller σ0 of the two);
#: - prior precision 0: theirs; their β2 0.99999 is kept for runs of 10k steps or more (`default_beta2`): in a 189-step
#:   run here it moved h by -0.1 %, so shorter runs take the run-length rule;
#: - eval_mc_samples 10: their posterior samples at test time (softmax-averaged).
LORA_PRESET: dict[str, float | bool] = {
    "learning_rate": 1.0, "ess": 1e7, "hess_init": 1e-3, "prior_precision": 0.0, "long_run_beta2": 0.99999,
    "rescale_lr": False, "clip_radius": 1e-3, "eval_mc_samples": 10, "new_weight_lr_scale": 1.0,
}

#: `ivon_preset` name -> the settings it fills on top of SCRATCH_PRESET
IVON_PRESETS: dict[str, dict[str, float | bool]] = {"scratch": {}, "finetune": FINETUNE_PRESET, "lora": LORA_PRESET}

#: the share of h0 a preset's β2 must forget within the run, 1 − β2^T, for `default_beta2` to keep it; below it the
#: Hessian cannot move 10 % from h0 (the trainer's "hardly moved" warning uses the same 10 %)
HESSIAN_MOVE_THRESHOLD = 0.1
#: the fraction c of the run the Hessian averages over by default (benchmarks/training_length.py selected it on noisy
#: MNIST validation; benchmarks/default_posterior.py compares it with the presets' fixed β2 on the examples)
DEFAULT_HESSIAN_WINDOW = 0.1

#: clip_radius used with a run-relative Hessian window when the user sets none (bounds the per-coordinate step of
#: the mean to lr·(h0 + δ)·clip_radius; 0.05 was set a priori from the size of
#: the preconditioned updates in a 100-epoch MNIST run, before any result with it).
HESSIAN_WINDOW_CLIP_RADIUS = 0.05
#: the smallest per-weight step bound lr·clip_radius IVON accepts (`IVONMethod.check_step_bound`): below it a rate was
#: given in AdamW's units (2e-5 → 2e-8 under clip_radius 1e-3, a fine-tune at chance); the presets' bounds are 2e-5 and
#: larger
MIN_STEP_BOUND = 1e-6
#: the shortest Hessian EMA window (in optimizer steps) the run-relative rule uses
MIN_HESSIAN_WINDOW_STEPS = 300


def total_optimizer_steps(num_examples: int, batch_size: int, epochs: float, gradient_accumulation_steps: int = 1,
                          world_size: int = 1) -> int:
    """T: optimizer steps of a run over `num_examples` for `epochs` epochs at `batch_size` per device per
    micro-batch."""
    if num_examples <= 0 or batch_size <= 0 or epochs <= 0 or gradient_accumulation_steps <= 0 or world_size <= 0:
        raise ValueError(
            f"Need positive num_examples, batch_size, epochs, gradient_accumulation_steps and world_size; got "
            f"{num_examples}, {batch_size}, {epochs}, {gradient_accumulation_steps}, {world_size}."
        )
    micro_batches = math.ceil(num_examples / (batch_size * world_size))
    steps_per_epoch = max(1, math.ceil(micro_batches / gradient_accumulation_steps))  # as transformers.Trainer counts
    return max(1, math.ceil(epochs * steps_per_epoch))


def beta2_for_window(total_steps: int, window_fraction: float,
                     min_window_steps: float = MIN_HESSIAN_WINDOW_STEPS) -> float:
    """β2 = 1 − 1/max(c·T, W_min): the Hessian EMA averages over the last fraction `window_fraction` (c) of
    `total_steps` (T), but over at least `min_window_steps` (W_min) steps, and never fewer than one (β2 ≥ 0)."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}.")
    if not window_fraction > 0:
        raise ValueError(f"window_fraction must be > 0, got {window_fraction}.")
    return 1.0 - 1.0 / max(1.0, min_window_steps, window_fraction * total_steps)


def default_beta2(long_run_beta2: float, total_steps: int, window_fraction: float) -> float:
    """β2 of a run of `total_steps` steps when the user gives none: the preset's `long_run_beta2` if over the run it
    forgets at least `HESSIAN_MOVE_THRESHOLD` of h0 (1 − β2^T ≥ 0.1: the Hessian can learn), else the run-length rule
    `beta2_for_window(total_steps, window_fraction)`."""
    if 1.0 - long_run_beta2 ** total_steps >= HESSIAN_MOVE_THRESHOLD:
        return long_run_beta2
    return beta2_for_window(total_steps, window_fraction)


def hessian_window_of(beta2: float, total_steps: int) -> float:
    """The inverse: which fraction of a run of `total_steps` the EMA with rate `beta2` averages over (inf for
    β2 = 1)."""
    if beta2 >= 1.0:
        return math.inf
    return 1.0 / ((1.0 - beta2) * total_steps)


def _checkpoint_name(model: Any) -> str | None:
    """Where the weights of `model` or of one of its modules were loaded from, as its config names it
    (`PreTrainedModel.from_pretrained` sets `config.name_or_path`); None where no config names one."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    for module in modules:
        name = getattr(getattr(module, "config", None), "name_or_path", None)
        if name:
            return str(name)
    return None


def newly_initialized_modules(model: Any) -> list[str] | None:
    """The modules whose trainable weights `from_pretrained` initialised instead of loading (a new classification
    head: the MISSING and MISMATCHED rows of transformers' load report), found by the mark transformers leaves on every
    weight it loaded (`_is_hf_initialized`); None where no trainable weight carries it (a model transformers did not
    load, e.g. `timm.create_model(pretrained=True)`), since then nothing tells a loaded weight from a new one."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    loaded = [bool(getattr(p, "_is_hf_initialized", False)) for _, p in named]
    if not any(loaded):
        return None
    return sorted({name.rpartition(".")[0] for (name, _), was_loaded in zip(named, loaded) if not was_loaded})


def choose_preset(model: Any) -> tuple[str, str]:
    """The IVON preset for `model` when the user names none, and why: `lora` for a peft model (or a transformers model
    with peft adapters added), `finetune` for weights loaded from a checkpoint (a config, the model's or a
    submodule's, that names where it came from), else `scratch`. A model built from a checkpoint's config
    (`from_config(AutoConfig.from_pretrained(...))`) names it too: pass `ivon_preset="scratch"` for one."""
    if is_peft_model(model) or getattr(model, "peft_config", None):
        return "lora", "the model carries peft adapters"
    source = _checkpoint_name(model)
    if source is not None:
        if os.path.isabs(source):  # where it sat on this machine means nothing to a reader of the card
            source = "…/" + "/".join(source.replace(os.sep, "/").rstrip("/").split("/")[-2:])
        return "finetune", f"its weights were loaded from {source!r} (the config's name_or_path)"
    return "scratch", ("no config names a checkpoint its weights came from; pass ivon_preset='finetune' if they are "
                       "pretrained")
