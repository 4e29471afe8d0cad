"""The flags of ``moefold train`` that are ``TrainConfig`` fields, made from the fields themselves.

A field declared with ``training.sections.flag(default, help, ...)`` is the flag ``--`` + its name with ``-`` for
``_`` (Megatron-LM's name): its default is the field's, its help and choices the field's metadata, its type the
field's annotation (``int``, ``float``, ``str``, optional or not; ``tuple[str, ...]`` with ``nargs``). The parsed
value lands in ``args.<name>``, which ``training.cli.train.config_from_args`` hands to ``TrainConfig`` by name: one
table, the dataclasses', from flag to field, and each value checked once, by the section that owns it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from enum import Enum
from typing import Any

from moefold.training.config import TrainConfig

_TYPES = {"int": int, "float": float}


def train_field(name: str) -> dataclasses.Field:
    """``TrainConfig``'s field ``name``, in whichever section holds it."""
    for kind in (TrainConfig, *TrainConfig.SECTIONS.values()):
        for f in dataclasses.fields(kind):
            if f.name == name and "help" in f.metadata:
                return f
    raise KeyError(f"TrainConfig has no flag field {name!r}")


def add_flag(group: argparse.ArgumentParser | Any, f: dataclasses.Field, default: Any, dest: str) -> None:
    """The flag of the flag field ``f`` (module docstring) on ``group``, its value landing in ``args.<dest>``;
    ``default`` is the field's (an enum shown as its value, a tuple as a list). Metadata ``from_field``: the field's
    value as the flag's text (the default's)."""
    meta = f.metadata
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    kw: dict[str, Any] = {"dest": dest, "help": meta["help"]}
    action = meta.get("action")
    if action == "store_true":
        group.add_argument(flag, action="store_true", **kw)
        return
    if action == "optional":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
        return
    if "from_field" in meta:
        default = meta["from_field"](default)
    if "nargs" in meta:
        kw.update(nargs=meta["nargs"], default=list(default))
    else:
        kw["default"] = default.value if isinstance(default, Enum) else default
        kind = _TYPES.get(str(f.type).replace(" | None", ""))
        if kind is not None:   # str and enums (their choices: the values): the text itself
            kw["type"] = kind
    kw.update({k: meta[k] for k in ("choices", "metavar") if k in meta})
    group.add_argument(flag, **kw)


def add_field_flags(group: argparse.ArgumentParser | Any, names: Iterable[str]) -> None:
    """Add the flags of ``TrainConfig``'s fields ``names`` (in that order) to ``group`` (module docstring)."""
    for name in names:
        add_flag(group, train_field(name), getattr(TrainConfig, name), name)


__all__ = ["add_field_flags", "add_flag", "train_field"]
