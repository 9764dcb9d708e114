"""Counter-based randomness for IVON's weight noise: seeds derived from counters, and a Gaussian computed from them.

`derive_seed` turns counters (base seed, rank, step, draw, parameter index) into a seed for a torch generator. On
the CPU, torch's generator (mt19937 and Box-Muller) is the largest single cost of an IVON step: about 2.5 ns a
weight, drawn before the fused sample loop can read it. `counter_normal` computes the Gaussian instead, from the
element's index and a key, with integer and float operations that torch.compile vectorises *inside* that loop, where
the arithmetic overlaps the loop's memory traffic: a sample with its draw then costs about what the draw alone did.

The generator: for counter c and key (k0, k1), x = lowbias32(c ^ k0) ^ c ^ k1 with Wellons' `lowbias32` integer
mixer, then two words lowbias32(x) and lowbias32(x ^ golden ratio), whose top 24 bits are two uniforms for the
Box-Muller transform. It passes the statistical checks of tests/test_noise.py (moments, tails, Kolmogorov-Smirnov,
serial and cross-key correlation, keys one bit apart); it is no cryptographic generator. Counters are int32 words:
one key numbers 2^30 elements.
"""

from __future__ import annotations

import math

import torch

__all__ = ["COUNTER_LIMIT", "counter_key", "counter_normal", "derive_seed"]

_MASK = (1 << 63) - 1

#: the most elements one key numbers
COUNTER_LIMIT = 1 << 30

#: told apart from the first uniform's word by this constant (the golden ratio's bits, as a signed word), the second
#: uniform's word is an independent hash input
_SECOND_UNIFORM = -0x61C88647


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that depends on every key (SplitMix64 mixing), for counter-based noise draws."""
    state = 0x9E3779B97F4A7C15
    for key in keys:
        state = (state ^ (int(key) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state & _MASK


def counter_key(seed: int, start: int = 0) -> torch.Tensor:
    """The int32 key (two words of the 63-bit `seed`, then the first counter `start`) that `counter_normal` takes."""
    if not 0 <= start < COUNTER_LIMIT:
        raise ValueError(f"start={start} lies outside the counters of one key, [0, {COUNTER_LIMIT}).")
    words = [(seed >> shift) & 0xFFFFFFFF for shift in (0, 32)] + [start]
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def counter_normal(shape: torch.Size, key: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Standard normals (float32) of the given shape, element i (in row-major order) from counter key[2] + i.

    Plain tensor operations: eager, it is the reference; inside a compiled loop it fuses into that loop.
    """
    count = math.prod(shape)
    if count > COUNTER_LIMIT:
        raise ValueError(f"{count} elements exceed the {COUNTER_LIMIT} counters of one key.")
    counter = key[2] + torch.arange(count, dtype=torch.int32, device=device).view(shape)
    # the counter enters both rounds: with it in the first only, keys that differ by d in their first word would
    # give one stream, permuted (counter c of one key is counter c ^ d of the other)
    second = _lowbias32(counter ^ key[0]) ^ counter ^ key[1]
    radius = torch.sqrt(-2.0 * torch.log(_uniform(_lowbias32(second), 1)))
    return radius * torch.cos((2.0 * math.pi) * _uniform(_lowbias32(second ^ _SECOND_UNIFORM), 0))


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 on int32 words: products wrap, and the masks make the right shifts logical."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975  # 0x846CA68B as a signed word
    return x ^ ((x >> 16) & 0xFFFF)


def _uniform(bits: torch.Tensor, low: int) -> torch.Tensor:
    """The top 24 bits as a float32 in [0, 1) (low = 0) or (0, 1] (low = 1, for the logarithm)."""
    return (((bits >> 8) & 0xFFFFFF) + low).to(torch.float32) * 2.0**-24
