"""Every ``moefold <subcommand> ...`` written in a shell block of the README or ``docs/`` parses: the subcommand
exists and its parser accepts every flag and value (nothing runs, so this is fast); every ``train --recipe`` line
that reads no file also passes the layout checks ``moefold train`` makes before any rank starts, at its world
(``--nproc``, or torchrun's nodes x processes). The README's two commands themselves run elsewhere (the first:
tests/training/test_trainer.py's recipe runs; the second: CI)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from moefold.training.cli import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "2>", "2>&1", "<"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of every fenced block whose language is a shell."""
    blocks, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, start, body = fence.group(1) or "", n + 1, []
        elif fence:
            if lang in SHELL_FENCES:
                blocks.append((start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def commands(block: str) -> list[list[str]]:
    """The argument lists after ``moefold`` (or ``-m moefold.training.cli``) in a shell block: continuation
    lines joined, comments and prompts dropped, split at shell operators."""
    return [argv for argv, _ in launched(block)]


def torchrun_world(words: list[str]) -> int:
    """``--nnodes`` x ``--nproc-per-node`` of a torchrun line (0 where they are not numbers)."""
    sizes = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--nnodes", "--nproc-per-node")}
    nodes, per_node = sizes.get("--nnodes", "1"), sizes.get("--nproc-per-node", "1")
    return int(nodes) * int(per_node) if nodes.isdigit() and per_node.isdigit() else 0


def launched(block: str) -> list[tuple[list[str], int | None]]:
    """``commands``, each with the world torchrun gives it (None: run as ``moefold``; 0: torchrun's is unknown)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\s*\$ ", "", line)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, w in enumerate(words):
            is_cli = w == "moefold" or (w == "-m" and i + 1 < len(words) and words[i + 1] == "moefold.training.cli")
            if not is_cli:
                continue
            rest = words[i + (2 if w == "-m" else 1):]
            end = next((j for j, r in enumerate(rest) if r in OPERATORS or r.startswith(">")), len(rest))
            out.append((rest[:end], torchrun_world(words[:i]) if w == "-m" else None))
    return out


def documented() -> list[tuple[str, list[str]]]:
    found = []
    for path in doc_files():
        for start, block in shell_blocks(path.read_text()):
            for argv in commands(block):
                found.append((f"{path.relative_to(ROOT)}:{start}", argv))
    return found


DOCUMENTED = documented()


def test_the_docs_show_commands():
    assert len(DOCUMENTED) >= 10, DOCUMENTED   # the parser above finds them (a broken one finds none)


@pytest.mark.parametrize(("where", "argv"), DOCUMENTED, ids=[f"{w} {' '.join(a[:2])}" for w, a in DOCUMENTED])
def test_documented_command_parses(where, argv, capsys):
    assert argv, f"{where}: `moefold` without a subcommand"
    assert argv[0] in SUBCOMMANDS, f"{where}: no subcommand {argv[0]!r} (valid: {', '.join(SUBCOMMANDS)})"
    if "--help" in argv or "-h" in argv:
        return
    try:
        build_parser(argv[0]).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `moefold {' '.join(argv)}` does not parse (exit {exc.code}): "
                    f"{capsys.readouterr().err.strip()}")


def test_the_docs_pages_are_covered():
    """The commands come from docs/ too, not only from the README (a glob that missed docs/ would pass above)."""
    pages = {where.split(":")[0] for where, _ in DOCUMENTED if where.startswith("docs/")}
    assert len(pages) >= 10, sorted(pages)


# train lines whose model or flags come from a file (an HF or Megatron directory, a YAML config) are only parsed;
# corpora and checkpoints are not read before pre-flight, so those lines are checked too
READS_FILES = ("--config", "--load-hf", "--load-megatron", "--tokenizer-model", "--vocab-file",
               "--moe-routing-replay-file")
LAYOUTS = [(where, argv, world) for path in doc_files() for start, block in shell_blocks(path.read_text())
           for argv, world in launched(block)
           if (where := f"{path.relative_to(ROOT)}:{start}") and argv[:1] == ["train"] and "--recipe" in argv
           and not any(a in READS_FILES for a in argv) and world != 0]


def test_the_layout_check_sees_commands():
    assert len(LAYOUTS) >= 10, LAYOUTS


@pytest.mark.parametrize(("where", "argv", "world"), LAYOUTS, ids=[f"{w} {' '.join(a[1:3])}" for w, a, _ in LAYOUTS])
def test_documented_layout_is_valid(where, argv, world):
    """What ``moefold train`` checks before starting ranks (``validate_layout``: sizes, batch arithmetic, pipeline
    split, model divisibility) at the command's world; the installed-backend checks are left out (GPU lines)."""
    from moefold.training.cli.train import config_from_args, validate_layout

    args = build_parser("train").parse_args(argv)
    try:
        validate_layout(config_from_args(args), world or args.nproc)
    except ValueError as exc:
        pytest.fail(f"{where}: `moefold {' '.join(argv)}` (world {world or args.nproc}) is refused: {exc}")
