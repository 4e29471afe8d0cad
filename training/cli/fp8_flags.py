"""The FP8/FP4 flags of ``moefold train`` (Megatron-LM's names where it has them) and the ``FP8Config`` they give.

Each flag is a field of ``precision.fp8.FP8Config`` (its name, help, default and choices are the field's metadata,
made into the flag by ``training.cli.field_flags.add_flag``, as the other flags), so a new backend or recipe added
there shows up here. One flag has no field of its own: ``--fp4-recipe`` gives ``FP8Config.recipe`` when
``--fp4-format`` is set (``--fp8-recipe`` gives it otherwise); its one choice is ``FP4_RECIPES``'.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from moefold.precision.fp8 import FP4_RECIPES, FP8Config
from moefold.training.cli.field_flags import add_flag

FP4_RECIPE = "fp4_recipe"   # the flag that is not a field (module docstring)
# the flags in --help order: FP8Config's fields by name, and --fp4-recipe
FLAG_ORDER = ("format", "recipe", "fp4", FP4_RECIPE, "param_gather", "router_padding", "backend", "exclude_modules",
              "dispatch")
_FIELDS = {f.name: f for f in dataclasses.fields(FP8Config)}
_DEFAULTS = FP8Config()


def _dest(f: dataclasses.Field) -> str:
    return f.metadata["flag"][2:].replace("-", "_")   # --fp8-format -> args.fp8_format


def add_fp8_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The FP8 flags (Megatron-LM's names where it has them) on ``parser`` (a parser or an argument group)."""
    for name in FLAG_ORDER:
        if name == FP4_RECIPE:
            parser.add_argument("--fp4-recipe", default=FP4_RECIPES[0].value, choices=FP4_RECIPES,
                                help="FP4 scaling recipe (nvfp4: TE NVFP4BlockScaling / moefold's torchao-numerics "
                                     "NVFP4)")
            continue
        f = _FIELDS[name]
        add_flag(parser, f, getattr(_DEFAULTS, name), _dest(f))


def fp8_config_from_args(args: argparse.Namespace) -> FP8Config:
    """The ``FP8Config`` of the parsed flags (a flag not on the parser: the field's default); ValueError from
    ``FP8Config`` naming a bad combination."""
    values = {name: getattr(args, _dest(f), getattr(_DEFAULTS, name)) for name, f in _FIELDS.items()}
    values["exclude_modules"] = tuple(values["exclude_modules"])
    if values["fp4"]:
        values["recipe"] = getattr(args, FP4_RECIPE, FP4_RECIPES[0])
    return FP8Config(**values)


__all__ = ["FLAG_ORDER", "add_fp8_arguments", "fp8_config_from_args"]
