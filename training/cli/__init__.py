"""The ``moefold`` command. Each subcommand lives in its own module, imported only when used.

A subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``; one with
``TAKES_CONFIG_FILE = True`` also reads its flags from ``--config FILE`` (``training.cli.config_file``). A
subcommand whose module is heavy names a light one for its flags (``FLAG_MODULES``): ``moefold train --help`` and a
mistyped flag are answered before torch is imported (``tests/training/cli/test_parse_imports.py``).
This package holds the commands that need the trainer or its checkpoints (train, convert, inspect, generate,
upcycle, env), ``schedule`` (the pipeline schedules' timeline: its flags stay above the packages it prints) and the
model flags; the others live with their concept (``tools.bench_dispatch``, ``training.data.prepare``,
``training.observe.balance_report``, ``planner.cli``), routed by module name so that this package never imports
``moefold.planner`` or ``moefold.tools`` (which import it).
May import: everything in moefold except planner and tools.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moefold.training.cli.parser import Parser

# name -> (module, one-line help). Later subcommands register here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "env": ("moefold.training.cli.env", "print torch, devices, world size and the optional backends"),
    "bench-dispatch": ("moefold.tools.bench_dispatch",
                       "time a token dispatcher's dispatch+combine against a raw all-to-all"),
    "schedule": ("moefold.training.cli.schedule",
                 "print a pipeline schedule's timeline and bubble fraction (--plot PNG)"),
    "prepare-data": ("moefold.training.data.prepare", "tokenise text/JSONL files into an indexed .bin/.idx corpus"),
    "balance-report": ("moefold.training.observe.balance_report",
                       "plot and summarise expert load balance from a run's metrics"),
    "inspect": ("moefold.training.cli.inspect_model",
                "print a model's total/active parameters with a per-layer breakdown"),
    "convert": ("moefold.training.cli.convert",
                "convert checkpoints: HF <-> moefold, training checkpoint (any layout) -> HF / moefold"),
    "upcycle": ("moefold.training.cli.upcycle", "turn a dense checkpoint into an MoE with the same step-0 logits"),
    "generate": ("moefold.training.cli.generate", "generate text from a checkpoint (greedy / top-p, KV cache)"),
    "plan": ("moefold.planner.cli",
             "which parallel layout fits and runs fastest for a model on a cluster: memory by component, step "
             "time by term, the train command (--plot PNG)"),
    "train": ("moefold.training.cli.train",
              "train a recipe, a model defined by flags, or from an HF directory (--load-hf); Megatron-LM "
              "flags, --nproc N local ranks or torchrun"),
}

# subcommand -> the torch-free module that defines its flags, where that is not the subcommand's module
FLAG_MODULES: dict[str, str] = {"train": "moefold.training.cli.train_flags"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (for its arguments), so one slow or
    GPU-only subcommand never slows down or breaks another."""
    parser = Parser(prog="moefold", description="Mixture-of-experts training system.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module)
        if name == command:
            importlib.import_module(FLAG_MODULES.get(name, module)).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    if getattr(module, "TAKES_CONFIG_FILE", False) and args.config:   # the file's flags first: typed ones override
        from moefold.training.cli.config_file import config_args

        sub = parser.chosen_subcommand(args)
        try:
            from_file = config_args(sub, args.config)
        except ValueError as exc:
            sub.error(str(exc))
        at = argv.index(command) + 1
        args = parser.parse_args([*argv[:at], *from_file, *argv[at:]])
    return int(module.main(args) or 0)

