"""The argument checks every component shares: a wrong type or value is a ``ValueError`` at once."""

from __future__ import annotations

import math


def check_int(name: str, value, low: int, allow_none: bool = False) -> None:
    """``ValueError`` unless ``value`` is an integer (not a bool) >= ``low`` (or None, if allowed)."""
    if allow_none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' if allow_none else ''}, got {value!r}")


def check_float(name: str, value, low: float, high: float, *, open_low: bool = False) -> None:
    """``ValueError`` unless ``value`` is a finite number in ``[low, high]`` (``(low, high]`` if ``open_low``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > low if open_low else value >= low) or value > high:
        raise ValueError(f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {value!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    """``ValueError`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
