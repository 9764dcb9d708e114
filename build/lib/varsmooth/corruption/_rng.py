"""Position-indexed random numbers: the i-th value depends only on (seed, stream, i).

Each stream is a PCG64 bit generator keyed by ``SeedSequence([seed, *stream])``; value i is built from
its i-th raw 64-bit output. A prefix of a stream does not depend on how many values are drawn, so an
example's randomness is a function of its row index alone. Raw bit-generator outputs are covered by
NumPy's stream-stability policy (``Generator`` methods are not), which keeps noisy labels reproducible
across NumPy releases.
"""

from __future__ import annotations

import numpy as np
from scipy.special import ndtri

# Separate streams so that, e.g., the flip decision of an example does not depend on its target draw.
FLIP_STREAM = 0
TARGET_STREAM = 1
INSTANCE_RATE_STREAM = 2
INSTANCE_WEIGHT_STREAM = 3


def uniforms(seed: int, stream: tuple[int, ...] | int, n: int) -> np.ndarray:
    """``n`` uniforms in the open interval (0, 1): value i is the i-th of stream (seed, stream)."""
    key = (stream,) if isinstance(stream, int) else tuple(stream)
    raw = np.random.PCG64(np.random.SeedSequence([seed, *key])).random_raw(n)
    # Top 53 bits, shifted by half a step so that 0 (and ndtri(0) = -inf) can never occur.
    return ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def normals(seed: int, stream: tuple[int, ...] | int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normals by inverse CDF of :func:`uniforms`, so they share its stability guarantee."""
    return ndtri(uniforms(seed, stream, int(np.prod(shape)))).reshape(shape)
