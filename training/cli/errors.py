"""One-line errors for the model subcommands (``convert``, ``inspect``, ``generate``, ``upcycle``).

    @one_line_errors("convert")
    def main(args) -> int: ...

A failure prints ``moefold convert: error: <message>`` on one line to stderr and returns 2; ``--debug``
(``add_debug_argument``) re-raises, so the full traceback is one flag away.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

# errors whose message is meant for the user as it is; anything else also names its type
_USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError)


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")


def one_line(exc: BaseException) -> str:
    # imported here, on the error path only: parsing a command must not import torch.distributed
    from moefold.training.checkpoint.files import CheckpointError  # a damaged checkpoint: the message says all

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (*_USER_ERRORS, CheckpointError)):
        return text
    return f"{type(exc).__name__}: {text} (--debug for the traceback)"


def one_line_errors(command: str) -> Callable[[Callable[[argparse.Namespace], int]],
                                               Callable[[argparse.Namespace], int]]:
    def wrap(main: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(main)
        def run(args: argparse.Namespace) -> int:
            try:
                return main(args)
            except Exception as exc:
                if getattr(args, "debug", False):
                    raise
                print(f"moefold {command}: error: {one_line(exc)}", file=sys.stderr)
                return 2
        return run
    return wrap
