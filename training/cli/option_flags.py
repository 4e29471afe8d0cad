"""The run-time flags of ``moefold train`` (Megatron-LM's names), made from ``ModelOptions``' fields and the
dispatcher's (``dispatch.config.DispatchConfig`` and its ``FlexOptions``): how the model is computed, not what it
computes.

A field declared with ``models.flag_field.flag`` (``ModelOptions``) or with the same metadata (``DispatchConfig``,
``FlexOptions``) is a flag: its name, help, choices and default are the field's (an enum's choices its values), its
value lands in the field (``options_from_args``), and the dataclass that owns the field checks it, once.
``--moe-token-dispatcher-type`` goes straight to ``ModelOptions.dispatch.kind`` and ``--moe-deepep-num-sms`` to
``ModelOptions.dispatch.flex.num_sms``: ``ModelOptions.dispatch`` is the ``DispatchConfig`` every MoE layer's
dispatcher is built from. The metadata ``to_field`` turns a flag's text into the field's value where they differ
(``--moe-deepep-mode hybrid|direct`` -> ``FlexOptions.hybrid``). The options that are not one flag's come in as
keywords: ``dtype`` (``--bf16`` / ``--fp16``), ``fp8`` (``training.cli.fp8_flags``), ``offload_modules``
(``--fine-grained-activation-offloading`` with ``--offload-modules``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from moefold.dispatch.config import DispatchConfig, FlexOptions
from moefold.models.options import ModelOptions
from moefold.training.cli.field_flags import add_flag

# ModelOptions' values whose own fields are flags: where in ModelOptions -> (their dataclass, the prefix of their
# flags' short names: ``add_option_flags``' paths)
_SECTIONS: dict[str, tuple[type, str]] = {"dispatch": (DispatchConfig, "dispatch."),
                                          "dispatch.flex": (FlexOptions, "flex.")}
_SHORT = {"dispatch.kind": "dispatcher"}   # the earlier flat name, ModelOptions' alias for it


@dataclass(frozen=True)
class OptionFlag:
    """One run-time flag: the field it sets (``section`` None: ``ModelOptions``' own; else the dotted place of the
    dataclass that holds it in ``ModelOptions``) and where argparse puts it."""

    section: str | None
    field: dataclasses.Field

    @property
    def where(self) -> str:
        """The field's dotted place in ``ModelOptions`` (``dispatch.flex.num_sms``)."""
        return self.field.name if self.section is None else f"{self.section}.{self.field.name}"

    @property
    def path(self) -> str:
        """Its short name (``cp_comm``, ``dispatcher``, ``flex.num_sms``)."""
        if self.section is None:
            return self.field.name
        return _SHORT.get(self.where, _SECTIONS[self.section][1] + self.field.name)

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag", "--" + self.field.name.replace("_", "-"))

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def default(self) -> Any:
        value: Any = ModelOptions()
        for name in self.where.split("."):
            value = getattr(value, name)
        return value


def option_flags() -> tuple[OptionFlag, ...]:
    """Every run-time flag, in field order: ``ModelOptions``' own, then each section's."""
    own = [OptionFlag(None, f) for f in dataclasses.fields(ModelOptions) if "help" in f.metadata]
    return tuple(own + [OptionFlag(s, f) for s, (kind, _) in _SECTIONS.items()
                        for f in dataclasses.fields(kind) if "help" in f.metadata])


OPTION_FLAGS = option_flags()
_BY_PATH = {o.path: o for o in OPTION_FLAGS}


def add_option_flags(group: argparse.ArgumentParser | Any, paths: Iterable[str]) -> None:
    """The flags of the fields ``paths`` (``cp_comm``, ``flex.num_sms``), in that order, on ``group``."""
    for path in paths:
        o = _BY_PATH[path]
        add_flag(group, o.field, o.default, o.dest)


def options_from_args(args: argparse.Namespace, **rest: Any) -> ModelOptions:
    """The ``ModelOptions`` the parsed run-time flags give, with ``rest`` (the options no single flag sets);
    ValueError from the dataclass that owns a bad value, naming it."""
    values: dict[str, Any] = {}   # nested as the dataclasses are: {"dispatch": {"kind": ..., "flex": {...}}}
    for o in OPTION_FLAGS:
        value = getattr(args, o.dest)
        if "to_field" in o.field.metadata:
            value = o.field.metadata["to_field"](value)
        if isinstance(value, list):   # nargs: the field holds a tuple
            value = tuple(value)
        *parents, name = o.where.split(".")
        holder = values
        for parent in parents:
            holder = holder.setdefault(parent, {})
        holder[name] = value
    return ModelOptions(**values, **rest)


__all__ = ["OPTION_FLAGS", "OptionFlag", "add_option_flags", "option_flags", "options_from_args"]
