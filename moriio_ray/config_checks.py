"""The field checks every config Struct uses: each raises ConfigError naming the field."""

from __future__ import annotations

from typing import Any

import msgspec

from moriio_ray.errors import ConfigError

STRUCT = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}


def choice(obj: Any, name: str, allowed: tuple[str, ...], *, upper: bool = False) -> None:
    """Normalise a case-insensitive enum field in place, or raise ConfigError."""
    value = getattr(obj, name)
    norm = str(value).upper() if upper else str(value).lower()
    if norm not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")
    msgspec.structs.force_setattr(obj, name, norm)


def at_least(obj: Any, name: str, low: float, *, allow: tuple[float, ...] = ()) -> None:
    value = getattr(obj, name)
    if value in allow:
        return
    if value < low:
        extra = "".join(f" or exactly {a}" for a in allow)
        raise ConfigError(f"{name}: {value!r} must be >= {low}{extra}")


def positive(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not value > 0:
        raise ConfigError(f"{name}: {value!r} must be > 0")


def fraction(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{name}: {value!r} must be in (0, 1]")
