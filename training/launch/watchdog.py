"""Liveness of spawned ranks: each rank's ``Heartbeat`` thread rewrites a small file every ``interval``
seconds with the rank's last completed step; the launcher's ``stalled_rank`` reads them.

The thread runs whatever the rank's main thread does, including waiting in a collective (torch.distributed
releases the interpreter lock while it waits), so a heartbeat older than the timeout means the process is
not running at all: stopped (SIGSTOP, a debugger), or stuck in native code that holds the interpreter lock.
The ranks waiting for it keep beating, which is how the launcher tells the stalled rank from its victims.
A rank that is alive but never reaches the next collective is caught by the collectives' own timeout
(``--distributed-timeout-minutes``).

Also here: ``die_with_parent``, so that ranks never outlive the launcher that spawned them, and ``watch_parent``
for the workers of a launcher that is not moefold's (torchrun's agent): a ``kill -9`` of the agent leaves its
workers running (reparented), training and holding the save lock; the thread notices the new parent within a
second and hands over to its callback (say one line, release the lock, exit).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1   # linux/prctl.h
STARTUP_GRACE_S = 120.0   # a rank's first beat comes after its interpreter has imported torch


class Heartbeat:
    """Rank side. ``beat(step)`` records the last completed step (written at once, by the thread); a daemon
    thread writes ``"<step> <pid>"`` to ``path`` every ``interval`` seconds (the file's mtime is the heartbeat)."""

    def __init__(self, path: str | os.PathLike, interval: float) -> None:
        self.path, self.interval, self.step = Path(path), interval, 0
        self._stop, self._wake = threading.Event(), threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, name="moefold-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step = step
        self._wake.set()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(f"{self.step} {os.getpid()}")
            os.replace(tmp, self.path)
        except OSError:   # the launcher's directory is gone: the launcher is gone, and so are we shortly
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            self._write()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.interval + 1)


def read_heartbeat(path: str | os.PathLike) -> tuple[float, int] | None:
    """(seconds since the last beat, last completed step), or None before the first beat."""
    try:
        mtime = os.stat(path).st_mtime
        step = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - mtime, step


def stalled_rank(paths: list[Path], running: list[bool], timeout: float, since_launch: float,
                 ) -> tuple[int, float, int] | None:
    """(rank, seconds without a beat, last completed step) of the running rank with the oldest heartbeat
    when it is older than ``timeout``; a rank yet to beat gets ``max(timeout, STARTUP_GRACE_S)`` from launch."""
    worst = None
    for rank, (path, alive) in enumerate(zip(paths, running)):
        if not alive:
            continue
        hb = read_heartbeat(path)
        age, step, limit = (since_launch, 0, max(timeout, STARTUP_GRACE_S)) if hb is None else (*hb, timeout)
        if age > limit and (worst is None or age > worst[1]):
            worst = (rank, age, step)
    return worst


def last_steps(paths: list[Path]) -> list[int | None]:
    """Each rank's last completed step from its heartbeat file (None before the first beat)."""
    return [None if (hb := read_heartbeat(p)) is None else hb[1] for p in paths]


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (the launcher) dies: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on
    Linux, a thread watching the parent pid elsewhere. Call first thing in a spawned rank."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent_pid:   # the launcher died before prctl took effect
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="moefold-parent-watch", daemon=True).start()


def watch_parent(on_gone: Callable[[int], None], interval: float = 1.0) -> threading.Thread:
    """Call ``on_gone(old_parent_pid)`` from a daemon thread once this process's parent has changed (the parent
    died and the process was reparented); polls ``os.getppid()`` every ``interval`` seconds. Returns the thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        on_gone(parent)

    thread = threading.Thread(target=watch, name="moefold-agent-watch", daemon=True)
    thread.start()
    return thread
