"""Every ``moefold`` command's flags explain themselves (issue 27, item 3).

- no prefix matching (``allow_abbrev=False``) in any parser of the tree;
- an unknown flag is reported under the subcommand's own usage line with what it was probably meant to be;
  a bad choice names the closest valid values;
- every option of every subcommand has help text that shows its default and choices, ``--help`` opens with a
  short usage line and the description, and no group carries an internal label;
- layout errors list the valid sizes for the model and name ``--nproc`` and the defaults they assume.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from moefold.training import cli
from moefold.training.cli import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[3]


def _subparser(name: str) -> argparse.ArgumentParser:
    return build_parser(name)._subparsers._group_actions[0].choices[name]


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_no_parser_matches_prefixes():
    sources = [p for p in ROOT.rglob("*.py") if not {"build", "tests", ".git"} & set(p.relative_to(ROOT).parts)]
    calls = [(p, m.group(0)) for p in sources for m in re.finditer(r"ArgumentParser\([^)]*", p.read_text())]
    assert calls, "no parser found"
    assert [f"{p}: {c}" for p, c in calls if "allow_abbrev=False" not in c] == []
    for name in SUBCOMMANDS:
        assert _subparser(name).allow_abbrev is False, name


def test_a_prefix_is_not_a_flag(capsys):
    err = _error(capsys, ["train", "--recipe", "qwen3_moe_tiny", "--train", "3"])
    assert "unrecognized arguments: --train 3" in err and "did you mean --train-iters?" in err


def test_unknown_flag_gets_the_subcommands_usage_and_a_guess(capsys):
    err = _error(capsys, ["train", "--recipe", "qwen3_moe_tiny", "--tens", "2"])
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: moefold train ") and len(lines) <= 3, err
    assert "--tens: did you mean --tensor-model-parallel-size?" in lines[-1]
    err = _error(capsys, ["train", "--tensor-model-paralel-size", "2"])   # a typo: the closest spelling
    assert "did you mean --tensor-model-parallel-size" in err
    err = _error(capsys, ["prepare-data", "--input", "x", "--output-prefix", "y", "--vocab-size", "300", "--jsonkey",
                          "t"])
    assert err.startswith("usage: moefold prepare-data") and "did you mean --json-key" in err


def test_bad_choice_names_the_closest(capsys):
    err = _error(capsys, ["train", "--recipe", "qwen3_tiny"])
    assert len(err.strip().splitlines()) <= 3, err
    assert "invalid choice: 'qwen3_tiny' (did you mean qwen3_moe_tiny" in err and "valid: deepseek_v3," in err


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_option_has_help_with_its_default_and_choices(name):
    parser = _subparser(name)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._expand_help(action) if action.help else ""
        label = "/".join(action.option_strings) or action.dest
        assert shown.strip(), f"{name} {label}: no help text"
        default = action.default
        if action.option_strings and action.nargs != 0 and default not in (None, False, [], ()):
            assert "default" in shown, f"{name} {label}: help does not show its default {default!r}: {shown}"
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            invocation = formatter._format_action_invocation(action)
            missing = [c for c in action.choices if str(c) not in shown + invocation]
            assert not missing, f"{name} {label}: choices {missing} not shown"


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_help_opens_with_usage_and_description_and_has_no_internal_labels(name):
    text = _subparser(name).format_help()
    lines = text.splitlines()
    blank = lines.index("")
    assert blank <= 3, f"{name}: the usage takes {blank} lines:\n" + "\n".join(lines[:blank])
    assert lines[blank + 1].strip(), name   # the description follows
    assert not re.search(r"\(issue \d+\)|issue \d+", text), name


def test_tensor_parallel_size_the_model_cannot_take_lists_the_valid_ones(capsys):
    code = cli.main(["train", "--recipe", "qwen3_moe_tiny", "--tensor-model-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--tensor-model-parallel-size=3 does not split qwen3_moe_tiny" in err
    assert "num_heads=4 is not divisible by tp=3" in err and err.rstrip().endswith(": 1, 2 or 4")
    assert "sequence parallelism, on by default" in err and "--no-sequence-parallel" in err
    # without sequence parallelism only the heads decide
    cli.main(["train", "--recipe", "qwen3_moe_tiny", "--tensor-model-parallel-size", "8", "--no-sequence-parallel"])
    err = capsys.readouterr().err
    assert "sequence" not in err and err.rstrip().endswith(": 1, 2 or 4")


def test_a_size_the_world_cannot_take_names_nproc_and_its_default(capsys):
    assert cli.main(["train", "--recipe", "qwen3_moe_tiny", "--tensor-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "the world has 1 rank (--nproc 1, the default): use --nproc 2" in err, err
    assert cli.main(["train", "--recipe", "qwen3_moe_tiny", "--nproc", "6", "--expert-model-parallel-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "(--nproc 6): use --nproc 8" in err and "on 6: --expert-model-parallel-size 1 or 2" in err, err
    assert cli.main(["train", "--recipe", "qwen3_moe_tiny", "--nproc", "4", "--expert-model-parallel-size", "3"]) == 2
    assert "num_experts=8 is not divisible by ep=3; valid for this model" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1e-3"], "--lr=-0.001 must be a finite number >= 0"),
    (["--adam-eps", "-1E-8"], "--adam-eps=-1e-08 must be a finite number >= 0"),
    (["--clip-grad", "-inf"], "--clip-grad=-inf must be a finite number >= 0"),
    (["--tensor-model-parallel-size", "-2"], "--tensor-model-parallel-size=-2"),
    (["--moe-router-topk", "-1"], "moe_topk=-1 must be in [1, num_experts=8]"),
])
def test_a_negative_number_is_a_value_and_its_config_says_what_is_valid(capsys, argv, message):
    """Issue 48 item 5: argparse alone reads ``-1e-3`` as an unknown option ("expected one argument")."""
    assert cli.main(["train", "--recipe", "qwen3_moe_tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "expected one argument" not in err and "\n" not in err, err
    # a negative number given to a list flag, or after a switch, stays what argparse makes of it
    assert _subparser("train").parse_args(["--lr", "-1e-3", "--seed", "-0"]).lr == -1e-3
