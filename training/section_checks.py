"""The value checks the run config's sections share (``training.sections``, ``training.run_sections``): one-line
ValueErrors naming the field or flag and what would be valid."""

from __future__ import annotations

import math


def positive_ints(owner: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(owner, name), int) or getattr(owner, name) < 1:
            raise ValueError(f"{name}={getattr(owner, name)!r} must be a positive integer")


def finite_non_negative(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a finite number >= 0")


def positive_int_or_none(flag: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag}={value!r} must be a positive integer")


__all__ = ["finite_non_negative", "positive_int_or_none", "positive_ints"]
