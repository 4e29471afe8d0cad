"""``flag``: a dataclass field that is also a command-line flag, its help and choices kept with the field.

The one table from flag to field is the dataclasses' own: ``training.cli.field_flags`` turns ``TrainConfig``'s flag
fields into ``moefold train``'s flags, ``training.cli.model_flags`` ``ModelConfig``'s (Megatron-LM's names).
Torch-free and argparse-free: the metadata says what the parser should do, the CLI builds the parser.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def flag(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, action: str | None = None,
         nargs: str | None = None, metavar: str | None = None, name: str | None = None, flat: str | None = None,
         **model: Any) -> Any:
    """A field that is the flag ``--`` + its name with ``-`` (``name``: another flag name, e.g. Megatron's
    ``--moe-router-topk`` for ``topk``, or ``optimizer_type``'s ``--optimizer``): ``help`` and ``choices`` shown and
    checked by the parser; ``action``: ``store_true`` (a switch) or ``optional`` (``--x`` / ``--no-x``); ``flat``: the
    field's flat name on its composite (``models.composed``); ``default`` ``dataclasses.MISSING``: a required field.
    ``model``: what a model flag adds (``model_flag``)."""
    meta = {"help": help, "choices": choices, "action": action, "nargs": nargs, "metavar": metavar, "flag": name,
            "flat": flat, **model}
    return dataclasses.field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


GQA_ONLY, MLA_ONLY = ("gqa",), ("mla",)


def model_flag(default: Any, help: str, name: str, *, kinds: tuple[str, ...] | None = None, group: str = "model",
               override: bool = False, parse: Callable[[str], Any] | None = None,
               apply: Callable[[Callable[[str], Any], Any], dict[str, Any]] | None = None, **kw: Any) -> Any:
    """A ``ModelConfig`` field that is a model flag of ``moefold train`` (its default: the recipe's / model's value).

    kinds:    the attention kinds it applies to (None: both; ``GQA_ONLY``, ``MLA_ONLY``); elsewhere it fails naming
              the model
    group:    ``model`` (the model definition), ``router`` (router and run-time choices) or ``megatron`` (for
              Megatron-LM users): where ``--help`` lists it
    override: a training-side choice (a loss weight, capacity, jitter): it may change a ``--load-hf`` /
              ``--load-megatron`` model; the others define the model and are refused there
    parse:    the flag's text to a value (ValueError naming what is valid); default: the field's type
    apply:    ``(current, value) -> {flat name: value}``, the fields the flag sets (``current(name)``: a field's value
              with the changes so far); default: the field itself"""
    extra = {"kinds": kinds, "group": group, "override": override or None, "parse": parse, "apply": apply}
    return flag(default, help, name=name, **kw, **{k: v for k, v in extra.items() if v is not None})


__all__ = ["GQA_ONLY", "MLA_ONLY", "flag", "model_flag"]
