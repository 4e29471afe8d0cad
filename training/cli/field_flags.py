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
from typing import Any

from moefold.training.config import TrainConfig

_TYPES = {"int": int, "float": float, "str": None}


def train_field(name: str) -> dataclasses.Field:
    """``TrainConfig``'s field ``name``, in whichever section holds it."""
    for kind in (TrainConfig, *TrainConfig.SECTIONS.values()):
        for f in dataclasses.fields(kind):
            if f.name == name and "help" in f.metadata:
                return f
    raise KeyError(f"TrainConfig has no flag field {name!r}")


def add_field_flags(group: argparse.ArgumentParser | Any, names: Iterable[str]) -> None:
    """Add the flags of ``TrainConfig``'s fields ``names`` (in that order) to ``group`` (module docstring)."""
    for name in names:
        f = train_field(name)
        meta, default = f.metadata, getattr(TrainConfig, name)
        flag = meta.get("flag", "--" + name.replace("_", "-"))
        kw: dict[str, Any] = {"dest": name, "help": meta["help"]}
        action = meta.get("action")
        if action == "store_true":
            group.add_argument(flag, action="store_true", **kw)
            continue
        if action == "optional":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
            continue
        if "nargs" in meta:
            kw.update(nargs=meta["nargs"], default=list(default))
        else:
            kw["default"] = default
            kind = _TYPES[str(f.type).replace(" | None", "")]
            if kind is not None:
                kw["type"] = kind
        kw.update({k: meta[k] for k in ("choices", "metavar") if k in meta})
        group.add_argument(flag, **kw)


__all__ = ["add_field_flags", "train_field"]
