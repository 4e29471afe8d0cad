"""The model flags of ``moefold train``, with Megatron-LM's names, made from ``ModelConfig``'s fields: any model of
the families without code.

    moefold train --recipe qwen3_moe_tiny --hidden-size 512 --num-layers 8 --num-attention-heads 8 \\
        --num-query-groups 4 --kv-channels 64 --num-experts 16 --moe-ffn-hidden-size 256 --moe-router-topk 4 \\
        --moe-layer-freq "([0]*1+[1]*7)" --vocab-size 32000

A field declared with ``models.flag_field.model_flag`` is a flag (``MODEL_FLAGS``, walked from ``ModelConfig`` and
its sections in field order): its name, help, choices, the attention kinds it applies to and the fields it sets are
the field's metadata. The recipe gives the family and every value not set; each flag given replaces its field
(``apply_model_flags``: the model definition; ``apply_router_flags``: the router and run-time choices). Flags that
do not exist in a family fail naming it (``--q-lora-rank`` on GQA, ``--kv-channels`` on MLA). ``--moe-layer-freq``
takes Megatron's int (layer i is MoE when i % N == 0) or its pattern syntax (``"([0]*3+[1]*58)"``: one 0/1 per
layer), and then alone decides which layers are MoE (``first_k_dense_replace`` becomes 0). ``--window-size`` takes
the HF sliding window N (a query sees N keys, itself included) or Megatron's ``"L,0"`` (L keys to the left: N = L +
1); ``--window-attn-skip-freq N`` makes every N-th layer (1-based, Megatron's count) full attention and the others
windowed (GPT-OSS: 2).

With ``--load-hf DIR`` the architecture is DIR's ``config.json``: the flags that define the model are refused
(the ``override`` ones, training-side choices such as loss weights and capacity, apply), except with
``--moe-use-upcycling``, where ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size`` and
``--moe-layer-freq`` choose the MoE the dense model becomes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moefold.models.composed import flat_name
from moefold.models.config import ModelConfig
from moefold.models.flag_values import layer_pattern, window

GQA, MLA = "gqa", "mla"
Current = Callable[[str], Any]   # a field's value with the changes made so far


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError becomes the parser's one-line error, its message kept."""
    @functools.wraps(parse)
    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return read


parse_layer_pattern = _argparse_type(layer_pattern)
parse_window = _argparse_type(window)
_TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class ModelFlag:
    """One model flag, as its field declares it (``models.flag_field.model_flag``)."""

    flag: str                                    # --moe-router-topk
    field: str                                   # the flat name of the field it sets (moe_topk)
    help: str
    kinds: tuple[str, ...]                       # the attention kinds it applies to
    group: str                                   # model | router | megatron: its --help group
    override: bool                               # may change a --load-hf / --load-megatron model
    type: Callable[[str], Any] | None            # argparse's type; None: a --x / --no-x switch
    choices: tuple[Any, ...] | None
    apply: Callable[[Current, Any], dict[str, Any]]

    @property
    def dest(self) -> str:
        return dest(self.flag)


def _entry(f: dataclasses.Field, flat: str, owner: str | None) -> ModelFlag:
    meta = f.metadata
    kind = str(f.type).replace(" | None", "")
    parse = meta.get("parse")
    if parse is not None:
        typ = parse if parse in (int, float, str) else _argparse_type(parse)
    else:
        typ = None if kind == "bool" else _TYPES.get(kind, str)
    return ModelFlag(meta["flag"], flat if owner is None else f"{owner}.{f.name}", meta["help"],
                     meta.get("kinds", (GQA, MLA)), meta["group"], meta.get("override", False), typ,
                     meta.get("choices"), meta.get("apply") or (lambda _c, v, name=flat: {name: v}))


def _walk(kind: type, owner: str | None = None) -> list[ModelFlag]:
    sections = getattr(kind, "SECTIONS", {})
    out: list[ModelFlag] = []
    for f in dataclasses.fields(kind):
        if f.name in sections:
            out += _walk(sections[f.name])
        elif "flags_of" in f.metadata:   # a value dataclass whose fields are flags (mla: MLADims)
            out += _walk(f.metadata["flags_of"], owner=flat_name(f))
        elif "group" in f.metadata:
            out.append(_entry(f, flat_name(f), owner))
    return out


def model_flags() -> tuple[ModelFlag, ...]:
    """Every model flag, from ``ModelConfig``'s fields and its sections' in field order."""
    return tuple(_walk(ModelConfig))


MODEL_FLAGS = model_flags()
# what --moe-use-upcycling lets a user choose about the MoE the dense model becomes
UPCYCLING_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq")
GROUPS = {"model": "model definition (Megatron-LM names; change the --recipe's model)",
          "router": "router and run-time choices (overrides of the recipe / --load-hf model)"}


def dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def model_json(text: str) -> dict[str, Any]:
    """``--model-json``: a JSON mapping of ``ModelConfig`` fields (checked when the model is built from it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping of model fields, got a {type(value).__name__}")
    return value


def add_flags(group: argparse.ArgumentParser | Any, which: str) -> None:
    """The model flags of ``which`` group (``ModelFlag.group``) on ``group``; unset (None) keeps the model's value."""
    for entry in MODEL_FLAGS:
        if entry.group != which:
            continue
        only = "" if len(entry.kinds) > 1 else " (MLA only)" if entry.kinds == (MLA,) else " (GQA only)"
        default = {"model": "; default: the recipe's", "router": "; default: the model's (--recipe or --load-hf)"}
        text = f"{entry.help}{only}{default.get(which, '')}"
        if entry.type is None:
            group.add_argument(entry.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(entry.flag, type=entry.type, default=None, help=text,
                               **({"choices": entry.choices} if entry.choices else {}))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The architecture flags, as their own argument group."""
    g = parser.add_argument_group(GROUPS["model"])
    g.add_argument("--model-json", type=model_json, default=None, metavar="JSON",
                   help="the whole model, every field of the recipe's replaced (a --config file's model: section, "
                        "which each run's config.yaml records); the flags below change it")
    add_flags(g, "model")


def given_model_flags(args: argparse.Namespace, *, model: bool = True) -> list[str]:
    """The flags set on the command line that define the model: the model definition's (``model``) or the router's
    that are not training-side overrides (``model=False``)."""
    return [e.flag for e in MODEL_FLAGS if (e.group == "model") == model and not e.override
            and getattr(args, e.dest, None) is not None]


def _apply(config: ModelConfig, args: argparse.Namespace, entries: list[ModelFlag]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for entry in entries:
        value = getattr(args, entry.dest, None)
        if value is None:
            continue
        if config.attention not in entry.kinds:
            kind = "multi-latent attention (DeepSeek-V3)" if config.attention == MLA else "GQA attention"
            raise ValueError(f"{entry.flag} does not apply to {config.name} ({config.family}, {kind})")
        changes.update(entry.apply(lambda name: changes.get(name, getattr(config, name)), value))
    return changes


def apply_model_flags(config: ModelConfig, args: argparse.Namespace, only: tuple[str, ...] | None = None,
                      ) -> ModelConfig:
    """``config`` with every given model-definition flag (of ``only``, when given) applied; ValueError naming the
    flag when it does not apply to the family or the result is not a valid model."""
    entries = [e for e in MODEL_FLAGS if e.group == "model" and (only is None or e.flag in only)]
    changes = _apply(config, args, entries)
    if not changes:
        return config
    try:
        return config.with_(**changes)
    except ValueError as exc:
        flags = " ".join(f for f in given_model_flags(args) if only is None or f in only)
        raise ValueError(f"{exc} (model flags: {flags})") from exc


def apply_router_flags(config: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """``config`` with every given router and run-time flag applied (those of any model: the recipe's, ``--load-hf``'s,
    ``--load-megatron``'s; the ones that define the model were refused for the last two before)."""
    changes = _apply(config, args, [e for e in MODEL_FLAGS if e.group != "model"])
    return config.with_(**changes) if changes else config


__all__ = ["MODEL_FLAGS", "ModelFlag", "UPCYCLING_FLAGS", "add_flags", "add_model_arguments", "apply_model_flags",
           "apply_router_flags", "given_model_flags", "model_flags", "parse_layer_pattern", "parse_window"]
