"""Starting the ranks of a run: under torchrun (env://), as ``nproc`` local spawned ranks, or alone; and
ending it cleanly when something goes wrong.

- torchrun / SLURM+torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set): join the launcher's world
  (NCCL on CUDA, gloo on CPU); ``LOCAL_RANK`` picks the GPU.
- NCCL is bound to the rank's GPU (``parallel.init.init_process_group_on``: ``device_id``), so torch forms the
  communicators when the groups are made, not at their first collective: DeepEP V2 reuses them
  (``dispatch.deepep_nccl``).
- ``nproc > 1`` without a launcher: spawn ``nproc`` processes on this machine joined through a
  FileStore in a fresh temporary directory (gloo, CPU, or NCCL with one GPU each when available).
  This process supervises them: a rank that fails ends the job (the others are killed) with one
  ``rank R: <message>`` line; a rank whose heartbeat stops (``training.launch.watchdog``) ends it naming that
  rank and its last completed step; the ranks die with this process (``die_with_parent``).
- ``nproc == 1``: run in this process without torch.distributed (world 1, every group None).

Every failure is raised as ``JobFailed`` (its ``str`` the one line), the full tracebacks appended to
``RUN_DIR/error.log``. Collectives time out after ``timeout_s`` (``--distributed-timeout-minutes``).

Each rank's DeepEP buffers (the flex dispatcher's, both backends: ``dispatch.flex_backend.destroy_deepep_buffers``)
are destroyed when ``fn`` returns, before the process group goes (DeepEP's destroy barriers the group); when ``fn``
raises they are dropped without that collective, which a failed peer would never join.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moefold.parallel.init import init_process_group_on, launched_by_torchrun
from moefold.training.errors import Failure, JobFailed, append_error_log, failure_of, read_failure, write_failure
from moefold.training.launch.watchdog import Heartbeat, die_with_parent, last_steps, stalled_rank


def pick_device(device: str, local_rank: int) -> torch.device:
    """``auto``: the local GPU when CUDA is available, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ValueError(f"--device={device!r}; valid: auto, cpu, cuda")
    return torch.device("cpu")


def run_rank(fn: Callable[..., Any], device: torch.device, args: tuple, heartbeat: Heartbeat | None) -> Any:
    """``fn(device, *args, heartbeat=...)`` (its result), then this process's DeepEP buffers released (module
    docstring)."""
    from moefold.dispatch.flex_backend import destroy_deepep_buffers, forget_deepep_buffers

    try:
        result = fn(device, *args, heartbeat=heartbeat)
    except BaseException:
        forget_deepep_buffers()
        raise
    destroy_deepep_buffers()
    return result


def heartbeat_interval(timeout_s: float) -> float:
    return min(5.0, max(0.1, timeout_s / 5))


def _spawned(local_rank: int, fn: Callable[..., Any], nproc: int, workdir: str, device: str, timeout_s: float,
             heartbeat_timeout_s: float, parent_pid: int, args: tuple) -> None:
    die_with_parent(parent_pid)
    work = Path(workdir)
    heartbeat = Heartbeat(work / f"heartbeat.{local_rank}", heartbeat_interval(heartbeat_timeout_s))
    # Lazy gloo connections: connecting every subgroup's full mesh eagerly, many ranks on few cores,
    # fails now and then with "connectFullMesh ... closed by peer" (see tests/distributed.py).
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank),
                      TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore, which a rank killed by the launcher would leak
    # (and the resource tracker would warn about it): a thread lock is all one process needs.
    tqdm.set_lock(threading.RLock())
    try:
        dev = pick_device(device, local_rank)
        store = dist.FileStore(str(work / "store"), nproc)
        init_process_group_on(dev, store=store, rank=local_rank, world_size=nproc,
                              timeout=timedelta(seconds=timeout_s))
        result = run_rank(fn, dev, args, heartbeat)
        if local_rank == 0:   # the launcher returns rank 0's result (JSON)
            tmp = work / "result.0.tmp"
            tmp.write_text(json.dumps(result))
            os.replace(tmp, work / "result.0")
    except BaseException as exc:  # reported to the launcher, which prints one line for the job
        write_failure(work / f"error.{local_rank}", failure_of(exc, local_rank))
        sys.exit(1)
    finally:
        heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _first_failure(work: Path, procs: list, failed: list[int]) -> tuple[Failure, list[Failure]]:
    """The failure that started it (a rank killed by a signal, else the earliest report) and all of them."""
    time.sleep(0.3)   # a failure that happened at the same moment has time to write its report
    failed = sorted(set(failed) | {r for r, p in enumerate(procs) if p.exitcode not in (None, 0)})
    reports, killed = [], []
    for rank in failed:
        report = read_failure(work / f"error.{rank}")
        if report is None:
            code = procs[rank].exitcode
            how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
            report = Failure(rank, f"the process {how} without reporting an error (out of memory?)", "", time.time())
            killed.append(report)
        reports.append(report)
    first = killed[0] if killed else min(reports, key=lambda f: f.time)
    return first, [first, *[f for f in reports if f is not first]]


def _behind(message: str, steps: list[int | None]) -> str:
    """For a collective that timed out: which rank fell behind the others, if one did."""
    known = [s for s in steps if s is not None]
    if not re.search(r"time[ds]? ?out", message, re.IGNORECASE) or not known or min(known) == max(known):
        return ""
    lag = min(known)
    ranks = [r for r, s in enumerate(steps) if s == lag]
    return f" (rank {', '.join(map(str, ranks))} fell behind: last completed step {lag}, the others {max(known)})"


def _supervise(work: Path, procs: list, heartbeat_timeout_s: float, poll_s: float) -> tuple[Failure, list[Failure],
                                                                                            list[str]] | None:
    """Wait for the ranks; None when all succeed, else (first failure, all failures, notes)."""
    nproc = len(procs)
    beats = [work / f"heartbeat.{r}" for r in range(nproc)]
    launched = time.monotonic()
    while True:
        codes = [p.exitcode for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            first, failures = _first_failure(work, procs, failed)
            steps = last_steps(beats)
            if lag := _behind(first.message, steps):
                first = Failure(first.rank, first.message + lag, first.traceback, first.time)
                failures[0] = first
            return first, failures, [f"last completed step per rank: {steps}"]
        if all(c == 0 for c in codes):
            return None
        stalled = stalled_rank(beats, [c is None for c in codes], heartbeat_timeout_s, time.monotonic() - launched)
        if stalled is not None:
            rank, age, step = stalled
            steps = last_steps(beats)
            failure = Failure(rank, f"no heartbeat for {age:.0f}s (--heartbeat-timeout {heartbeat_timeout_s:g}): the "
                                    f"process is stopped or stuck; its last completed step was {step}; ended the job",
                              "", time.time())
            return failure, [failure], [f"last completed step per rank: {steps}"]
        time.sleep(poll_s)


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()   # SIGKILL: also ends a stopped process
    for p in procs:
        p.join(timeout=10)


LAUNCH_PREFIX = "moefold-launch-"
OWNER = "launcher.pid"


def remove_stale_launch_dirs(root: str | None = None) -> list[Path]:
    """Remove the temporary directories of launchers that are gone (a kill -9 leaves its directory: no handler
    runs): those whose ``launcher.pid`` names no running process. A directory without that file (being
    created, or another moefold's) is left alone. Returns what it removed."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{LAUNCH_PREFIX}*"):
        try:
            pid = int((d / OWNER).read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue   # its launcher runs
        except ProcessLookupError:
            pass
        except OSError:
            continue   # another user's process
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


class _Forward:
    """The launcher's handlers while its ranks run: the first ``stop_signals`` signal is passed on to the ranks
    (which stop after their current step and save, ``training.launch.signals``); a second Ctrl-C, and SIGHUP or a
    signal the run does not stop on, end the launcher at once (its ranks die with it, its directory is
    removed on the way out)."""

    def __init__(self, procs: list, stop_signals: tuple[int, ...]) -> None:
        self.procs, self.stop_signals, self.forwarded = procs, stop_signals, 0
        handled = set(stop_signals) | {signal.SIGTERM, signal.SIGHUP}
        self._previous = {s: signal.signal(s, self._handle) for s in handled}

    def _handle(self, signum: int, _frame: object) -> None:
        if signum in self.stop_signals and not self.forwarded:
            self.forwarded = signum
            for proc in self.procs:
                if proc.is_alive():
                    os.kill(proc.pid, signum)
            name = _signal_name(-signum)
            os.write(2, f"\nmoefold train: {name}: the ranks stop after their current step and save"
                        f"{'; Ctrl-C again to stop at once, without saving' if signum == signal.SIGINT else ''}\n"
                        .encode())
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum in self.stop_signals:   # a repeat: the ranks are already stopping
            return
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def run_ranks(fn: Callable[..., Any], nproc: int, device: str = "auto", timeout_s: float = 600.0,
              args: tuple = (), *, run_dir: str | os.PathLike | None = None, heartbeat_timeout_s: float = 300.0,
              say: Callable[[str], None] = print, stop_signals: tuple[int, ...] = ()) -> Any:
    """Run ``fn(device, *args, heartbeat=...)`` on every rank of the world chosen as the module docstring says
    (``heartbeat``: a ``training.launch.watchdog.Heartbeat`` whose ``beat(step)`` the rank calls after each step
    when spawned, else None) and return rank 0's result (under torchrun: this rank's). Spawned ranks return it
    as JSON.

    ``fn`` must be importable by name (spawned processes unpickle it). A failure raises ``JobFailed`` (its
    tracebacks appended to ``run_dir/error.log``); KeyboardInterrupt ends the spawned ranks and propagates.
    ``stop_signals`` (spawned ranks): the signals this launcher passes on to its ranks, which stop cleanly on
    them; its temporary directory is removed on every exit that runs a handler (and, after a kill -9, by the
    next launcher: ``remove_stale_launch_dirs``).
    """
    if launched_by_torchrun():
        rank = int(os.environ.get("RANK", "0"))
        try:
            dev = pick_device(device, int(os.environ.get("LOCAL_RANK", "0")))
            if not dist.is_initialized():
                init_process_group_on(dev, timeout=timedelta(seconds=timeout_s))
            return run_rank(fn, dev, args, None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:   # each rank reports its own (torchrun names the first one to fail)
            failure = failure_of(exc, rank)
            raise JobFailed(failure, append_error_log(run_dir, [failure], name=f"error.rank{rank}.log")) from exc
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if nproc <= 1:
        try:
            return run_rank(fn, pick_device(device, 0), args, None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:   # e.g. torch.distributed.checkpoint's CheckpointException
            failure = failure_of(exc, None)
            raise JobFailed(failure, append_error_log(run_dir, [failure])) from exc
    remove_stale_launch_dirs()
    with tempfile.TemporaryDirectory(prefix=LAUNCH_PREFIX) as tmp:
        Path(tmp, OWNER).write_text(str(os.getpid()))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_spawned, name=f"moefold-rank{r}", daemon=False,
                             args=(r, fn, nproc, tmp, device, timeout_s, heartbeat_timeout_s, os.getpid(), args))
                 for r in range(nproc)]
        forward = _Forward(procs, stop_signals)
        try:
            for p in procs:
                p.start()
            say(f"launched {nproc} ranks (pids {', '.join(str(p.pid) for p in procs)})")
            outcome = _supervise(Path(tmp), procs, heartbeat_timeout_s, poll_s=min(0.5, heartbeat_timeout_s / 10))
        finally:
            forward.restore()
            _kill_all(procs)
        if outcome is not None:
            first, failures, notes = outcome
            raise JobFailed(first, append_error_log(run_dir, failures, notes))
        result = Path(tmp, "result.0")
        return json.loads(result.read_text()) if result.is_file() else None
