"""The names and ranges of IVON's settings, stated once: `VariationalIVON` checks its param groups against them and
`IVONConfig` its fields."""

from __future__ import annotations

import math

__all__ = ["SETTING_RANGES", "USER_NAMES", "check_ivon_setting"]

#: the settings users name otherwise (`IVONConfig`, `VariationalTrainingArguments`) than ivon-opt's optimizer and this
#: one do: keyword here -> user's name; the one place the two names meet
USER_NAMES = {"lr": "learning_rate", "weight_decay": "prior_precision"}

#: the range of each IVON setting (its keyword here): (lowest, highest, lowest allowed, highest allowed); the one
#: statement of them, which `IVONConfig` checks its fields against too
SETTING_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "lr": (0.0, math.inf, True, False),
    "ess": (0.0, math.inf, False, False),
    "hess_init": (0.0, math.inf, False, False),
    "weight_decay": (0.0, math.inf, True, False),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, True),
    "clip_radius": (0.0, math.inf, False, True),
}


def check_ivon_setting(name: str, value: float, called: str | None = None) -> None:
    """Refuse `value` of the IVON setting `name` (a key of `SETTING_RANGES`) outside its range; `called`: the name the
    user gave it (`IVONConfig`'s field), if another."""
    low, high, low_ok, high_ok = SETTING_RANGES[name]
    if (low <= value if low_ok else low < value) and (value <= high if high_ok else value < high):
        return
    finite = "finite and " if high == math.inf and not high_ok else ""
    upper = "" if high == math.inf else f" and {'<=' if high_ok else '<'} {high:g}"
    raise ValueError(f"{called or name} must be {finite}{'>=' if low_ok else '>'} {low:g}{upper}, got {value}.")
