"""The next sample's e drawn on another thread while this sample's forward and backward run.

On the CPU, torch's generator fills e one value at a time on one core (~3.5 ns a weight: 29 ms for 8.4 M weights),
the largest part of what an IVON step costs beyond AdamW. The draw of a known seed can start as soon as the seed is
known, which for the next sample is at this one: the optimizer predicts the next draw's seed, this class draws it into
buffers of its own, and at the next sample hands them over if the seed and the parameters are the ones predicted
(else the optimizer draws as usual, the same numbers, only not hidden). The thread lives inside one
`sampled_params` body, so none runs while the process forks (DataLoader workers) or pickles the optimizer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .sharding import to_local

__all__ = ["NoisePrefetch"]


def _key(draw_seed: int, buckets: Sequence[Any]) -> tuple:
    """The draw and its parameters by identity: tensors have no usable ==, and ids cannot be reused while `_noise`
    holds the parameters (until `forget`, which drops the key)."""
    return draw_seed, tuple((b.seed_key, tuple(map(id, b.params))) for b in buckets)


class NoisePrefetch:
    """e for one predicted draw, in buffers laid out as the optimizer's (contiguous, one per parameter)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._key: tuple | None = None  # (draw seed, buckets) whose e `_noise` holds once the thread has ended
        self._noise: dict[torch.Tensor, torch.Tensor] = {}

    def start(self, draw_seed: int, buckets: Sequence[Any],
              draw: Callable[[Any, int, list[torch.Tensor]], Any]) -> None:
        """Draws e of `buckets` in the draw seeded by `draw_seed` with `draw` (the optimizer's `draw_noise`)."""
        self.wait()
        for p in (p for b in buckets for p in b.params if p not in self._noise):  # once: later draws reuse them
            self._noise[p] = torch.empty_like(to_local(p), memory_format=torch.contiguous_format)
        into = [[self._noise[p] for p in b.params] for b in buckets]
        key = _key(draw_seed, buckets)
        self._key = None

        def run() -> None:
            try:
                for bucket, noise in zip(buckets, into):
                    draw(bucket, draw_seed, noise)
            except BaseException:  # noqa: BLE001 -- the optimizer then draws on its own thread, and raises there
                return
            self._key = key

        self._thread = threading.Thread(target=run, name="ivon-noise-prefetch", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the draw started last has ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, draw_seed: int, buckets: Sequence[Any],
             spare: list[list[torch.Tensor]]) -> list[list[torch.Tensor]] | None:
        """The e drawn for `draw_seed` and `buckets`, or None if another draw was predicted. Its buffers leave this
        object; `spare` (the optimizer's buffers for e, free now) take their place for the next draw."""
        self.wait()
        if self._key != _key(draw_seed, buckets):
            return None
        self._key = None
        noise = [[self._noise[p] for p in b.params] for b in buckets]
        for bucket, free in zip(buckets, spare):
            self._noise.update(zip(bucket.params, free))
        return noise

    def forget(self, params: set[torch.Tensor]) -> None:
        """Drops the buffers of parameters no longer optimized."""
        self.wait()
        self._key = None
        for p in params:
            self._noise.pop(p, None)
