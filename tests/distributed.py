"""Run a function on N CPU ranks with gloo, the way every multi-rank test in moefold does.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` processes, joins them into one
gloo world through a FileStore in a fresh temporary directory (no port to race for, and no
store server thread in the parent that a fork could copy mid-lock),
calls ``fn(*args)`` on each rank and returns the per-rank results in rank order. A rank
that raises fails the test with that rank's traceback; ranks that do not finish within
``timeout`` (seconds on an idle machine, stretched by the load: tests/load.py) are killed and the test
fails naming them. It never hangs.

Fork (not spawn) keeps start-up cheap and lets tests pass local functions: the parent
must not have initialised torch.distributed itself. A forked child cannot use CUDA once the
parent has initialised it, or merely asked the CUDA runtime how many devices there are (torch
marks the fork "poisoned": ``torch.cuda.is_available()`` does so unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``, set below and in tests/gpu/conftest.py, makes it ask NVML).
Where the parent has initialised CUDA anyway (a GPU test earlier in the same pytest process), the
ranks are spawned instead: ``fn`` and its arguments must then be picklable (module-level).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

# before any CUDA query in this process: torch.cuda.is_available() through NVML does not poison a fork
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch
import torch.distributed as dist

from tests.load import scaled, within


class RankFailure(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _forget_inductor_thread_pool() -> None:
    """Drop the compile thread pool a forked rank inherited from the parent (e.g. after a world-1 ``--compile``
    test ran there): its threads did not survive the fork, so a C++ kernel compile submitted to it would wait
    forever. torch's own after-fork hook resets inductor's process pool, not this thread pool."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


def _worker(fn: Callable, rank: int, world_size: int, store_path: str, timeout: float,
            results: mp.Queue, args: tuple, kwargs: dict) -> None:
    # Lazy gloo connections: eagerly connecting the full mesh of every subgroup at once, 8
    # ranks on 2 cores, fails now and then with "connectFullMesh ... closed by peer".
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    _forget_inductor_thread_pool()
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=scaled(timeout)))
        value = fn(*args, **kwargs)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank."""
    if dist.is_initialized():
        raise RuntimeError("run_distributed must be called from a process without a process group")
    tmpdir = tempfile.TemporaryDirectory(prefix="moefold-dist-")
    store_path = os.path.join(tmpdir.name, "store")
    # a fork of a process that initialised CUDA cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess")
    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, rank, world_size, store_path, timeout, results, args, kwargs))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    limit = within(timeout)
    try:
        while len(done) < world_size:
            remaining = limit.left()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                                   f"(x{limit.factor:.1f} for the load; a hang: a collective some rank never "
                                   "reached?)")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
                if dead:
                    time.sleep(0.5)  # its report may still be in the pipe
                    if results.empty():
                        raise RankFailure(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                          "without reporting a result") from None
                continue
            if not ok:
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            done[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.1 if len(done) < world_size else 5)
            if p.is_alive():
                p.kill()
                p.join()
        tmpdir.cleanup()
    return [done[r] for r in range(world_size)]


@contextmanager
def own_groups() -> Iterator[None]:
    """Destroy, on leaving, every process group created inside: in a world that walks many layouts, around each.

    Collective: every rank enters and leaves together; a barrier over the world comes first, so no rank shuts a
    group down while a peer still uses it. Left on an exception without either: the failing rank reports at once
    and the world ends. Why: each gloo group keeps its own TCP event loop (woken every 10 ms) and worker threads;
    a 4-rank world walking 24 trainer layouts kept 260 live groups a rank, ``perf`` put 35% of the two cores'
    samples in gloo's loop threads, and shutting each layout's groups down when it is done took that world from
    80 s to 62 s (test_overlap_modes, on a 2-core AMD EPYC without AVX-512).
    """
    live = dist.distributed_c10d._world.pg_map   # torch has no public list of the live groups
    before = set(live)
    yield
    dist.barrier()
    for group in [g for g in live if g not in before]:
        dist.destroy_process_group(group)


class LayoutDims:
    """``ParallelDims.build`` of each layout once per spawned world: building one creates its process groups, which
    every rank must do in the same order, so a test walking many layouts (and revisiting some) asks here.
    ``dims(par)`` or ``dims(**par)``: the ``ParallelConfig`` fields."""

    def __init__(self) -> None:
        self._built: dict[tuple, Any] = {}

    def __call__(self, par: dict | None = None, **fields: int) -> Any:
        from moefold.parallel.dims import ParallelConfig, ParallelDims

        par = {**(par or {}), **fields}
        key = tuple(sorted(par.items()))
        if key not in self._built:
            self._built[key] = ParallelDims.build(ParallelConfig(**par))
        return self._built[key]
