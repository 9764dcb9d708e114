"""The buffers each posterior draw predicts with: its own BatchNorm statistics.

Every forward pass of IVON's training runs at a sampled weight θ ~ N(m, τ²σ²) and normalises with the statistics of
its own batch, so the sampled networks that training fitted are networks with statistics of their own. Predicting with
a draw but the *mean's* statistics gives a far worse network (the image example's default run: 24 % against 66 %
accuracy per draw, BMA 48 % against 93 %, and a mutual information lower on noise images than on digits). SWAG
(Maddox et al. 2019, "A Simple Baseline for Bayesian Uncertainty in Deep Learning") recomputes BatchNorm statistics
for each sampled model for the same reason. The draws of a prediction are fixed by (seed, number of draws, τ)
(`prediction.draw_seeds`), so their statistics are computed once, from training data, when training ends
(`varsmooth.prediction.batchnorm.draw_batchnorm_statistics`) and saved with the posterior: a reloaded model has no
training data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DRAW_BUFFER_PREFIX", "DrawBuffers"]

#: the key prefix of the draws' buffers in `posterior.safetensors` (σ's keys are parameter names, which never start so)
DRAW_BUFFER_PREFIX = "draw_buffers/"


@dataclass
class DrawBuffers:
    """`buffers[s]`: buffer name -> value of draw s of `draw_seeds(seed, len(buffers))` at posterior temperature
    `temperature`. Serves every prediction with that seed and τ and at most `len(buffers)` draws (the first S draws of a
    seed are the same for every S)."""

    seed: int
    temperature: float
    buffers: list[dict[str, torch.Tensor]]

    def for_draws(self, seed: int, num_samples: int, temperature: float) -> list[dict[str, torch.Tensor]] | None:
        """The buffers of the first `num_samples` draws of `seed` at `temperature`, or None when these are other
        draws."""
        if seed != self.seed or float(temperature) != self.temperature or num_samples > len(self.buffers):
            return None
        return self.buffers[:num_samples]

    def describe(self) -> dict[str, Any]:
        """What the saved tensors are, for the posterior file's metadata."""
        return {"seed": self.seed, "temperature": self.temperature, "num_draws": len(self.buffers)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers as flat safetensors entries `draw_buffers/<s>/<buffer name>`, on the CPU."""
        return {f"{DRAW_BUFFER_PREFIX}{s}/{name}": value.detach().to("cpu").contiguous()
                for s, named in enumerate(self.buffers) for name, value in named.items()}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], description: Mapping[str, Any],
                     path: str) -> "DrawBuffers":
        """Read back what `tensors()` wrote, described by `describe()`; refuses (naming `path`) entries that do not
        make the number of draws it records, each with the same buffers."""
        num_draws = int(description["num_draws"])
        buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_draws)]
        for key, value in tensors.items():
            draw, _, name = key[len(DRAW_BUFFER_PREFIX):].partition("/")
            if not draw.isdigit() or int(draw) >= num_draws or not name:
                raise ValueError(f"{path} holds the entry {key!r}, which is not the buffer of one of its {num_draws} "
                                 "posterior draws: the file was edited. Save the model again (trainer.save_model()).")
            buffers[int(draw)][name] = value
        if any(set(named) != set(buffers[0]) for named in buffers) or not buffers[0]:
            raise ValueError(f"{path} does not hold the same buffers for each of its {num_draws} posterior draws: the "
                             "file was edited. Save the model again (trainer.save_model()).")
        return cls(int(description["seed"]), float(description["temperature"]), buffers)
