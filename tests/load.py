"""Wall-clock bounds that stretch with the machine's load, so that no verdict depends on it (issue 48).

A test that must catch a hang (a rank that never finishes, a watchdog that never fires, a command that never
answers) needs a wall-clock bound, but the same work takes longer on a loaded machine: on 2 cores at load 20,
ten times longer. ``scaled(seconds)`` is the bound for an idle machine times the load per core, read when it
is called; ``within(seconds)`` re-reads it until the time is up, so a bound stretches when the load rises
while it runs. Assertions about the work itself (no rank started, one line printed) stay exact.
"""

from __future__ import annotations

import os
import subprocess
import time


def load_factor() -> float:
    """max(1, the highest of the 1-, 5- and 15-minute load averages per CPU): how many runnable processes share
    each core (1 where the platform has no load average)."""
    try:
        load = max(os.getloadavg())
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """``seconds`` (the bound on an idle machine) stretched by ``load_factor()`` now."""
    return seconds * load_factor()


class within:
    """A deadline of ``seconds`` on an idle machine that stretches with the load seen while it runs."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.factor = seconds, time.monotonic(), load_factor()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds left (<= 0: the time is up), the bound scaled by the highest load factor seen so far."""
        self.factor = max(self.factor, load_factor())
        return self.seconds * self.factor - self.elapsed()

    def __str__(self) -> str:
        return f"{self.seconds:g} s (x{self.factor:.1f} for the load: {self.seconds * self.factor:.0f} s)"


def communicate(proc: subprocess.Popen, seconds: float) -> tuple:
    """``proc.communicate()`` within ``within(seconds)``; TimeoutExpired (the process left running) after it.
    Waits in slices: communicate may be called again after a TimeoutExpired without losing output."""
    limit = within(seconds)
    while True:
        try:
            return proc.communicate(timeout=max(1.0, min(limit.left(), 10.0)))
        except subprocess.TimeoutExpired:
            if limit.left() <= 0:
                raise
