"""How a failed run reaches its user: one line naming the rank and what went wrong, and the full tracebacks in
``RUN_DIR/error.log`` (appended to, one section per failure) whose path the line ends with.

A spawned rank that fails writes a ``Failure`` (JSON) to the file its launcher gave it and exits 1; the
launcher picks the first failure (``training.launch.ranks``), ends the other ranks and raises ``JobFailed``.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ERROR_LOG = "error.log"


@dataclass(frozen=True)
class Failure:
    """One rank's failure: ``message`` is one line; ``traceback`` the full text (may be empty)."""

    rank: int | None
    message: str
    traceback: str
    time: float

    def line(self) -> str:
        return self.message if self.rank is None else f"rank {self.rank}: {self.message}"


class JobFailed(RuntimeError):
    """A run failed; ``str()`` is the one line to print, ``log`` the file holding the tracebacks."""

    def __init__(self, failure: Failure, log: Path | None) -> None:
        super().__init__(failure.line())
        self.failure, self.log = failure, log


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message; prefixed by its type unless it is a ValueError or a moefold error
    (whose messages are written to be read alone). torch.distributed.checkpoint's CheckpointException (which
    wraps each failing rank's exception) gives the first wrapped one."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda kv: kv[0])
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return f"{one_line(wrapped[0])} (in torch.distributed.checkpoint on rank {rank})"
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if not text:
        return type(exc).__name__
    if isinstance(exc, ValueError) or type(exc).__module__.startswith("moefold."):
        return text
    return f"{type(exc).__name__}: {text}"


def failure_of(exc: BaseException, rank: int | None) -> Failure:
    return Failure(rank, one_line(exc), "".join(traceback.format_exception(exc)), time.time())


def write_failure(path: str | os.PathLike, failure: Failure) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(failure)))
    os.replace(tmp, path)


def read_failure(path: str | os.PathLike) -> Failure | None:
    try:
        return Failure(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def append_error_log(run_dir: str | os.PathLike | None, failures: list[Failure], notes: list[str] = (),
                     name: str = ERROR_LOG) -> Path | None:
    """Append ``failures`` (the first one first) and ``notes`` to ``run_dir/name``; its path, or None if it
    could not be written (the one-line message is then all there is)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / name
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    text = [f"===== moefold train failed at {stamp}: {failures[0].line()}"]
    text += [f"  {n}" for n in notes]
    for f in failures:
        text.append(f"----- {'process' if f.rank is None else f'rank {f.rank}'}: {f.message}")
        text.append(f.traceback.rstrip() or "(no traceback: the process did not raise)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write("\n".join(text) + "\n\n")
    except OSError:
        return None
    return path
