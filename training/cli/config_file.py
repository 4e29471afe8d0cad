"""``moefold train --config FILE``: flags from a YAML file, and ``RUN_DIR/config.yaml``, the flags a run ran with.

The file is a mapping whose keys are the flags' names (``tensor-model-parallel-size: 2``; ``--`` and ``_`` for
``-`` are accepted too, so Megatron-Bridge-style ``tensor_model_parallel_size`` works) and whose values are what
the flag takes: a number or a string, a list for the flags that take several values (``data-path: [0.3, a, 0.7,
b]``), ``true``/``false`` for switches (``bf16: true``, ``sequence-parallel: false``), ``null`` for unset. Flags
may be grouped in sections of any name (``parallel: {tensor-model-parallel-size: 2, expert-model-parallel-size:
4}``), and ``model:`` holds the model's fields (``ModelConfig``, nested: ``mla: {kv_lora_rank: 512}``), which replace
the recipe's (``--model-json``). It is turned into command-line arguments placed before the ones typed, so every
value is checked exactly like a typed flag and a flag on the command line overrides the file.

Every run writes ``RUN_DIR/config.yaml``: every flag of ``moefold train`` with the value it ran with (defaults
included, so a later change of a default cannot change a repeat), except where the run writes (``--run-dir``,
``--save``: a repeat writes its own) and the terminal's ``--no-progress``; and, for a recipe's model, the model's
every field as ``model:`` (so a later change of the recipe cannot change a repeat either; a ``--load-hf`` or
``--load-megatron`` model is its directory's). ``moefold train --config
RUN_DIR/config.yaml --run-dir NEW`` repeats the run, bit for bit where the run itself is deterministic (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moefold.training.cli.parser import did_you_mean, suggest

if TYPE_CHECKING:
    from moefold.models.config import ModelConfig

CONFIG_FILE = "config.yaml"
NOT_SAVED = frozenset({"config", "run_dir", "save", "no_progress", "help", "model_json"})   # dests
MODEL_SECTION, MODEL_FLAG = "model", "--model-json"   # the model's every field, nested (train's --model-json)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _flag(key: Any) -> str:
    return "--" + str(key).lstrip("-").replace("_", "-")


def _as_args(action: argparse.Action, flag: str, value: Any, where: str) -> list[str]:
    """``value`` of ``flag`` (read from YAML) as command-line arguments."""
    def bad(expected: str) -> ValueError:
        return ValueError(f"{where}: {flag[2:]}: {value!r} is not {expected}")

    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise bad("true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = not flag.startswith("--no-")
            return [flag if value else (f"--no-{flag[2:]}" if positive else "--" + flag[5:])]
        if not value:
            return []
        return [flag]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list)) for v in values):
            raise bad("a list of plain values")
        return [flag, *(str(v) for v in values)] if values or action.nargs == "*" else []
    if isinstance(value, (dict, list, bool)):
        raise bad("a single value")
    return [flag, str(value)]


def config_args(parser: argparse.ArgumentParser, path: str | os.PathLike) -> list[str]:
    """The command-line arguments the YAML file ``path`` stands for (ValueError naming the file and key)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not YAML ({' '.join(str(exc).split())})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got a "
                         f"{type(data).__name__}")
    return _mapping_args(_options(parser), data, f"--config {path}", parser.prog)


def _mapping_args(options: dict[str, argparse.Action], data: dict, where: str, prog: str) -> list[str]:
    """The arguments of one mapping: flag names to values, a ``model:`` mapping of the model's fields, and sections
    (any other key whose value is a mapping: its flags, e.g. ``parallel: {tensor-model-parallel-size: 2}``)."""
    args: list[str] = []
    for key, value in data.items():
        flag = _flag(key)
        action = options.get(flag)
        if key == MODEL_SECTION and isinstance(value, dict) and MODEL_FLAG in options:
            args += [MODEL_FLAG, json.dumps(value)]
            continue
        if isinstance(value, dict):   # a section (no flag takes a mapping; ``optimizer`` is a section and a flag)
            args += _mapping_args(options, value, f"{where}: {key}", prog)
            continue
        if action is None or action.dest in ("config", "help"):
            guess = did_you_mean([s[2:] for s in suggest(flag, options)])
            raise ValueError(f"{where}: {key!r} is not a flag of {prog}" + (f" ({guess})" if guess else ""))
        args += _as_args(action, flag, value, where)
    return args


def effective_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every flag of ``parser`` with its value in ``args``, by flag name (without ``--``), in the parser's order;
    unset flags (None) and ``NOT_SAVED`` left out."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_SAVED or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value is None:
            continue
        name = next(s for s in action.option_strings if s.startswith("--"))[2:]
        if isinstance(value, (list, tuple)):   # one value of list syntax (--moe-layer-freq [0, 1, 1]) or several
            value = str(list(value)) if action.nargs is None else list(value)
        out[name] = value
    return out


def write_effective_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                           run_dir: str | os.PathLike, model: ModelConfig | None = None) -> Path:
    """Write ``RUN_DIR/config.yaml`` atomically: the flags, then ``model`` (every field, as ``model:``) when given;
    returns its path."""
    import importlib.metadata

    import yaml

    try:
        version = importlib.metadata.version("moefold")
    except importlib.metadata.PackageNotFoundError:   # a checkout on sys.path, not installed
        version = "not installed"
    path = Path(run_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# the flags of this run ({parser.prog}, moefold {version}); repeat it with",
              f"#   {parser.prog} --config {path} --run-dir NEW_DIR"]
    values = effective_config(parser, args)
    if model is not None:
        values[MODEL_SECTION] = model.to_dict()
    body = yaml.safe_dump(values, sort_keys=False, default_flow_style=None, width=120)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(header) + "\n" + body)
    os.replace(tmp, path)
    return path
