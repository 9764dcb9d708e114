"""Seeds derived from counters (base seed, rank, step, draw, ...), for reproducible noise that resumes exactly."""

__all__ = ["derive_seed"]


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that depends on every key (SplitMix64 mixing), for torch generators."""
    state = 0x9E3779B97F4A7C15
    for key in keys:
        state = (state ^ (int(key) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state & ((1 << 63) - 1)
