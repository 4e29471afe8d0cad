"""One writer per save directory: an ``fcntl`` lock on ``SAVE/moefold.lock`` held for the whole run.

    with SaveLock.acquire("ckpt", run_id, say=print):   # SaveLockError naming the holder if another run has it
        ... train, save ...

The lock is a POSIX record lock (``fcntl.lockf``, which NFS supports through its lock manager), taken with
``LOCK_NB`` so a second run fails at once instead of waiting. The kernel drops it when the holding process
ends, however it ends (kill -9 included), so a stale lock never blocks a restart; the file's contents (host,
pid, start time, run id) only name the holder for the message, and a run that finds a previous holder's
record (its process ended without releasing) says that it took over. The holder is the process that stays
for the whole job: the ``moefold train`` launcher with ``--nproc``, the one process at world 1, rank 0 under
torchrun. A POSIX lock belongs to its process and is released when that process closes *any* descriptor of
the file, so the holder never opens the file a second time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK_FILE = "moefold.lock"


class SaveLockError(RuntimeError):
    """Another live run holds the save directory's lock (the message names it)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, another user's
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
    run = f", run {holder['run_id']}" if holder.get("run_id") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {since}{run}"


def _parse(text: str) -> dict[str, Any] | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


class SaveLock:
    """The held lock of one save directory; ``release()`` (or leaving the ``with``) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, save: str | os.PathLike, run_id: str | None = None,
                say: Callable[[str], None] = print) -> SaveLock:
        """Take ``save``'s lock (creating ``save``), or raise ``SaveLockError``: ``--save D is in use by pid P on
        host H since T``. A record left by a holder that ended without releasing is taken over with a note."""
        root = Path(save)
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise SaveLockError(f"--save {save}: cannot lock {path}: {exc.strerror or exc}") from None
            holder = _parse(path.read_text(errors="replace")) if path.is_file() else None
            who = _describe(holder) if holder else "another process (its record is unreadable)"
            raise SaveLockError(f"--save {save} is in use by {who}; wait for it to end, or choose another "
                                "--save") from None
        previous = _parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
        if previous:   # a holder that ended without releasing (kill -9, a lost node): the kernel dropped its lock
            here = previous.get("host") == socket.gethostname()
            state = ("no longer running" if not _pid_alive(int(previous.get("pid", 0))) else "no longer holding it"
                     ) if here else "no longer holding it"
            say(f"note: took over the lock of --save {save} from {_describe(previous)} ({state})")
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                             "run_id": run_id}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        """Empty the record (a clean end leaves nothing to take over) and unlock."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):   # a read-only or vanished file: the unlock below still happens
            os.ftruncate(self._fd, 0)
        os.close(self._fd)   # closing the descriptor drops the lock
        self._fd = -1

    def __enter__(self) -> SaveLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
