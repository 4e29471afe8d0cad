"""The GPU check's steps as bounded subprocesses: the time budget, running one command in its own process
group with a timeout that takes its children down too, and the helpers that cut a step's output into its
report cell (``training.gpu.check``)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout (training/ is a top-level folder)


@dataclasses.dataclass
class Step:
    """One step's outcome: status is passed | failed | timed out | skipped."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    output: str = ""


class Budget:
    """The check's total time; each step gets what is left after reserving the later steps' minimum.

    ``sized_for``: the total the caps and reserves were chosen for; another budget scales the reserves in
    proportion, and a larger one the caps too (a CPU rehearsal given ``--budget 880`` gives every step twice
    the time; a smaller budget never cuts a step's cap).
    """

    def __init__(self, seconds: float, sized_for: float | None = None) -> None:
        self.deadline = time.monotonic() + seconds
        self.total = seconds
        self.scale = 1.0 if sized_for is None else seconds / sized_for

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def for_step(self, cap: float, reserve: float = 0.0) -> float:
        return max(0.0, min(cap * max(1.0, self.scale), self.left() - reserve * self.scale))


def run(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
        cwd: Path = REPO) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group; (return code or None on timeout, output, seconds).

    Output goes through a file (not a pipe a stuck grandchild could hold open); on timeout the
    whole group is terminated, then killed.
    """
    t0 = time.monotonic()
    if timeout < 1:
        return None, "no time left in the budget", 0.0
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
        except OSError as err:
            return 127, f"cannot start {cmd[0]}: {err}", 0.0
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        out.seek(0)
        text = out.read()
    seconds = time.monotonic() - t0
    with log.open("a", encoding="utf-8") as f:
        f.write(f"\n===== $ {' '.join(cmd)}  (rc={rc}, {seconds:.1f} s)\n{text}\n")
    return rc, text, seconds


def status_of(rc: int | None) -> str:
    return "timed out" if rc is None else ("passed" if rc == 0 else "failed")


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def table_rows(text: str) -> str:
    """The Markdown table rows a benchmark printed."""
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


def pytest_summary(text: str) -> str:
    """pytest's closing line and its short summary (-rfEs: failures, errors, skip reasons)."""
    lines = text.rstrip().splitlines()
    keep = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    closing = [ln for ln in lines if re.search(r"\d+ (passed|failed|skipped|error|deselected)", ln)
               and ln.startswith("=")]
    return "\n".join(keep + closing[-1:]) or tail(text, 15)


def last_lines(text: str, starts: tuple[str, ...], n: int = 6) -> str:
    """The last ``n`` lines of ``text`` that start with one of ``starts`` (progress bars left out)."""
    return "\n".join([ln.strip() for ln in text.splitlines() if ln.strip().startswith(starts)][-n:])


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)
