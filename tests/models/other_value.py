"""Another value of a config field, for the tests that check each field is read, inert or refused."""

from __future__ import annotations

from typing import Any


def other_value(value: Any) -> Any:
    """bool: its negation; int: + 1; float: half (0.5 for 0); None: 2; anything else: the string "other"."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 if value else 0.5
    if value is None:
        return 2
    return "other"
