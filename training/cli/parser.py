"""The argument parser of every ``moefold`` command: exact flag names, errors that say what was meant, help that
shows each option's default and choices.

- No prefix matching (``allow_abbrev=False``, as Megatron-LM sets it): ``--train 3`` is an error, never
  ``--train-iters 3``.
- An unknown flag or a bad choice is reported under the subcommand's own usage line with the flags (or values)
  it was probably meant to be: the flags that start with it (what prefix matching would have picked) or the
  closest by spelling (``difflib``). ``moefold train --tens 2``::

      usage: moefold train [options]
      moefold train: error: unrecognized arguments: --tens 2 (--tens: did you mean --tensor-model-parallel-size?)

- A negative number is a value, never a flag: ``--lr -1e-3`` gives ``--lr`` the value -0.001 (argparse alone reads
  ``-1e-3`` as an unknown option and says ``expected one argument``), so the config that owns the value says what is
  valid.
- ``--help`` opens with a short usage line (the full one of a 100-flag command is pages long), then the
  description and the option groups; every option's help ends with its default and, where a metavar hides
  them, its choices.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn

# a negative decimal or float literal (argparse itself knows only -1 and -.5 / -1.5, not -1e-3 or -inf)
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$", re.IGNORECASE)
USAGE_LINES = 3          # a longer generated usage is replaced by the short form
MAX_SUGGESTIONS = 4


def _shown(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def _has_default(action: argparse.Action) -> bool:
    """The default is worth printing: not unset (None), not an off switch, not empty."""
    d = action.default
    return (d is not None and d is not argparse.SUPPRESS and d is not False and d != [] and d != ()
            and bool(action.option_strings) and action.nargs != 0)


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` and, when a metavar hides them, ``choices: a, b`` to each option's help;
    shortens a long usage to the command, its required arguments and ``[options]``."""

    def __init__(self, prog: str, **kw) -> None:
        super().__init__(prog, max_help_position=32, width=kw.pop("width", None) or 110, **kw)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if text is argparse.SUPPRESS:
            return text
        extra = []
        if action.choices is not None and action.metavar is not None:
            missing = [str(c) for c in action.choices if str(c) not in text]
            if missing:
                extra.append(f"choices: {', '.join(str(c) for c in action.choices)}")
        if _has_default(action) and "default" not in text.lower():
            extra.append(f"default: {_shown(action.default)}".replace("%", "%%"))
        return f"{text} ({'; '.join(extra)})" if extra else text

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        # flags stay whole (the default wrapping breaks --seq-length after "--seq-")
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return {int: "N", float: "X"}.get(action.type, action.dest.upper())

    def _format_usage(self, usage, actions: Iterable[argparse.Action], groups, prefix) -> str:
        full = super()._format_usage(usage, actions, groups, prefix)
        if usage is not None or full.strip().count("\n") < USAGE_LINES:
            return full
        return super()._format_usage(short_usage(self._prog, list(actions), groups), actions, groups, prefix)


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest.upper()
    if action.nargs == 0:
        return action.option_strings[0]
    metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices else
                                 action.dest.upper())
    return f"{action.option_strings[0]} {metavar}"


def short_usage(prog: str, actions: Sequence[argparse.Action], groups) -> str:
    """``prog`` with its required options (one of each required exclusive group) and positionals, then
    ``[options]``."""
    in_group = {a for g in groups for a in g._group_actions}
    parts = [prog]
    for g in groups:
        if g.required:
            parts.append("(" + " | ".join(_invocation(a) for a in g._group_actions) + ")")
    parts += [_invocation(a) for a in actions if a.option_strings and a.required and a not in in_group]
    parts.append("[options]")
    parts += [_invocation(a) for a in actions if not a.option_strings and a.help is not argparse.SUPPRESS]
    return " ".join(parts)


def suggest(word: str, candidates: Iterable[str]) -> list[str]:
    """What ``word`` was probably meant to be: the candidates it begins (what prefix matching would have
    taken), else the closest by spelling."""
    candidates = list(dict.fromkeys(candidates))
    starts = [c for c in candidates if c.startswith(word)]
    if starts:
        return starts[:MAX_SUGGESTIONS]
    return difflib.get_close_matches(word, candidates, n=MAX_SUGGESTIONS, cutoff=0.6)


def did_you_mean(options: Sequence[str]) -> str:
    return f"did you mean {' or '.join(options)}?" if options else ""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the behaviour of the module docstring (subparsers are Parsers too)."""

    def __init__(self, *args, **kw) -> None:
        kw.setdefault("allow_abbrev", False)
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def option_strings(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def unrecognized(self, extras: Sequence[str]) -> str:
        """The message for arguments this parser does not know, with a guess for each unknown flag."""
        notes = []
        for token in extras:
            if token.startswith("--"):
                flag = token.split("=", 1)[0]
                guess = did_you_mean(suggest(flag, self.option_strings()))
                if guess:
                    notes.append(f"{flag}: {guess}")
        return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(notes)})" if notes else "")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._negative_values_joined(args), namespace)

    def _negative_values_joined(self, args: list[str]) -> list[str]:
        """``--flag -1e-3`` as ``--flag=-1e-3`` for this parser's one-value options, so that argparse takes the
        number as the value instead of an unknown option."""
        one_value = {s for a in self._actions for s in a.option_strings if a.nargs is None}
        out: list[str] = []
        i = 0
        while i < len(args):
            if args[i] in one_value and i + 1 < len(args) and NEGATIVE_NUMBER.match(args[i + 1]):
                out.append(f"{args[i]}={args[i + 1]}")
                i += 2
            else:
                out.append(args[i])
                i += 1
        return out

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:   # reported by the subcommand they were given to, with its usage line
            where = self.chosen_subcommand(parsed) or self
            where.error(where.unrecognized(extras))
        return parsed

    def chosen_subcommand(self, parsed: argparse.Namespace) -> Parser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                return chosen if isinstance(chosen, Parser) else None
        return None

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            guess = did_you_mean(difflib.get_close_matches(str(value), choices, n=MAX_SUGGESTIONS, cutoff=0.5))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{' (' + guess + ')' if guess else ''}; "
                                                 f"valid: {', '.join(choices)}")

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")
