"""The run-time flags of ``moefold train`` (Megatron-LM's names), made from ``ModelOptions``' fields and the flex
dispatcher's (``dispatch.config.FlexOptions``): how the model is computed, not what it computes.

A field declared with ``models.flag_field.flag`` (``ModelOptions``) or with the same metadata (``FlexOptions``) is a
flag: its name, help, choices and default are the field's (an enum's choices its values), its value lands in the
field (``options_from_args``), and the dataclass that owns the field checks it, once. ``--moe-deepep-num-sms`` goes
straight to ``FlexOptions.num_sms``, which the flex dispatcher reads; ``--moe-token-dispatcher-type`` to
``ModelOptions.dispatcher``. The metadata ``to_field`` turns a flag's text into the field's value where they differ
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

from moefold.dispatch.config import FlexOptions
from moefold.models.options import ModelOptions
from moefold.training.cli.field_flags import add_flag

_SECTIONS: dict[str, type] = {"flex": FlexOptions}   # ModelOptions' fields whose own fields are flags


@dataclass(frozen=True)
class OptionFlag:
    """One run-time flag: the field it sets (``section`` None: ``ModelOptions``' own) and where argparse puts it."""

    section: str | None
    field: dataclasses.Field

    @property
    def path(self) -> str:
        return self.field.name if self.section is None else f"{self.section}.{self.field.name}"

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag", "--" + self.field.name.replace("_", "-"))

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def default(self) -> Any:
        kind = ModelOptions if self.section is None else _SECTIONS[self.section]
        return getattr(kind(), self.field.name)


def option_flags() -> tuple[OptionFlag, ...]:
    """Every run-time flag, in field order: ``ModelOptions``' own, then each section's."""
    own = [OptionFlag(None, f) for f in dataclasses.fields(ModelOptions) if "help" in f.metadata]
    return tuple(own + [OptionFlag(s, f) for s, kind in _SECTIONS.items()
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
    own: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for o in OPTION_FLAGS:
        value = getattr(args, o.dest)
        if "to_field" in o.field.metadata:
            value = o.field.metadata["to_field"](value)
        if isinstance(value, list):   # nargs: the field holds a tuple
            value = tuple(value)
        (own if o.section is None else sections[o.section])[o.field.name] = value
    return ModelOptions(**own, **{s: _SECTIONS[s](**values) for s, values in sections.items()}, **rest)


__all__ = ["OPTION_FLAGS", "OptionFlag", "add_option_flags", "option_flags", "options_from_args"]
