"""The multi-rank harness itself: results come back in rank order, failures and hangs surface."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailure, own_groups, run_distributed
from tests.load import scaled


def _rank_times(x: int) -> int:
    return dist.get_rank() * x


def _rank_two_fails() -> None:
    if dist.get_rank() == 2:
        raise ValueError("rank two is broken on purpose")
    dist.barrier()  # the other ranks wait for a rank that never arrives


def _rank_one_hangs() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


def test_results_in_rank_order():
    assert run_distributed(_rank_times, 4, 10) == [0, 10, 20, 30]


def _groups_inside_and_after() -> tuple[int, int, int, float]:
    live = dist.distributed_c10d._world.pg_map
    before = len(live)
    with own_groups():
        group, t = dist.new_group([0, 1]), torch.ones(1)
        dist.all_reduce(t, group=group)
        inside = len(live)
    return before, inside, len(live), float(t)


def test_own_groups_destroys_the_groups_made_inside():
    for before, inside, after, total in run_distributed(_groups_inside_and_after, 2):
        assert (inside, after, total) == (before + 1, before, 2.0)


def test_failing_rank_reraises_its_traceback():
    with pytest.raises(RankFailure) as err:
        run_distributed(_rank_two_fails, 4, timeout=60)
    assert "rank 2 of 4 failed" in str(err.value)
    assert "ValueError: rank two is broken on purpose" in str(err.value)
    assert "_rank_two_fails" in str(err.value)  # the traceback, not just the message


def test_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within 3s"):
        run_distributed(_rank_one_hangs, 2, timeout=3)
    assert time.monotonic() - start < scaled(30)


# ---------------------------------------------------------------------------------------------------------
# CUDA and fork: a forked rank cannot use CUDA once its parent asked the CUDA runtime about devices
# ---------------------------------------------------------------------------------------------------------
_MARK = "fresh"   # a forked rank sees the parent's value, a spawned one this module's default


def _mark() -> str:
    return _MARK


def test_gpu_conftest_asks_nvml_so_forked_ranks_can_use_cuda(monkeypatch):
    """tests/gpu/conftest.py asks ``torch.cuda.is_available()`` in the pytest parent; through the CUDA runtime
    (``torch._C._cuda_getDeviceCount``) that marks every later fork as unable to initialise CUDA. With
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (set by the conftest before its first query) torch asks NVML instead.
    Simulated on this CPU build: CUDA "compiled in", two GPUs seen by NVML, the runtime query recorded."""
    import importlib

    import torch

    from tests.gpu import rehearsal

    if rehearsal.REHEARSAL:
        pytest.skip("a rehearsal never asks CUDA")
    runtime_queries = []
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: runtime_queries.append("poisons fork") or 2,
                        raising=False)
    import tests.gpu.conftest as conftest

    importlib.reload(conftest)   # its import-time setting, as pytest's first import of it
    conftest.pytest_collection_modifyitems(None, [])
    assert runtime_queries == [], "the GPU tests' availability check asked the CUDA runtime: forks are poisoned"


def test_ranks_are_spawned_when_the_parent_initialised_cuda(monkeypatch):
    """A parent that initialised CUDA (an earlier GPU test in the same pytest process) spawns its ranks."""
    import torch

    import tests.test_distributed_harness as this

    monkeypatch.setattr(this, "_MARK", "parent")
    assert run_distributed(_mark, 2) == ["parent", "parent"]   # fork: the parent's module state
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert run_distributed(_mark, 2) == ["fresh", "fresh"]     # spawn: a fresh interpreter


def test_wall_clock_bounds_stretch_with_the_load(monkeypatch):
    """tests/load.py: the bounds of hang detectors grow with the load per core, read again while they run."""
    import os

    from tests.load import load_factor, within

    cpus = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert load_factor() == 1.0 and scaled(30) == 30   # idle: the bound as written
    limit = within(30)
    monkeypatch.setattr(os, "getloadavg", lambda: (10.0 * cpus, 4.0 * cpus, 1.0))
    assert scaled(30) == 300 and limit.left() > 290   # the load rose while it ran: the deadline moved
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert limit.left() > 290   # and stays moved: the work done under load took that long
