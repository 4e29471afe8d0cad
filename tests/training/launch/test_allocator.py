"""The CPU allocator setting of ``moefold train`` (training.launch.allocator), each case in a fresh process (mallopt
changes the process for good): fresh large buffers stop page-faulting, and user choices are kept."""

import os
import subprocess
import sys

import pytest

from tests.load import communicate

CHILD = r"""
import resource, sys, torch
from moefold.training.launch.allocator import tune_cpu_allocator
said = tune_cpu_allocator() if sys.argv[1] == "tune" else "untouched"
x = torch.ones(4096, 4096)   # 64 MB
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        y = x * 2.0          # a fresh 64 MB buffer each time, freed at once
        del y
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(said, "|", faults(), "|", __import__("os").environ.get("MALLOC_MMAP_THRESHOLD_"))
"""


CASES = {"tuned": ("tune", {}), "plain": ("plain", {}), "arena": ("tune", {"MALLOC_ARENA_MAX": "2"}),
         "jemalloc": ("tune", {"LD_PRELOAD": "/nonexistent/libjemalloc.so.2"})}


@pytest.fixture(scope="module")
def children() -> dict[str, list[str]]:
    """Every case's child at once (each its own process: what one sets cannot leak into another), so that their
    torch imports overlap: ``said | faults | MALLOC_MMAP_THRESHOLD_`` per case."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    procs = {name: subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**clean, **env, "OMP_NUM_THREADS": "1"})
             for name, (mode, env) in CASES.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = communicate(proc, 300)
        assert proc.returncode == 0, (name, stderr)
        out[name] = [part.strip() for part in stdout.strip().splitlines()[-1].split("|")]
    return out


def test_tuned_allocator_reuses_freed_large_buffers(children):
    said, faults, env = children["tuned"]
    assert said.startswith("glibc mallopt") and env == str(2**31 - 1)   # ranks started from here inherit it
    _, default_faults, _ = children["plain"]
    pages = 64 * 2**20 // 4096
    assert int(default_faults) >= 5 * pages     # glibc's default: every fresh 64 MB buffer faulted in again
    assert int(faults) <= 2 * pages, (faults, default_faults)   # at most a heap growth or two over the 10


def test_user_allocator_choices_are_kept(children):
    said, _, env = children["arena"]
    assert "MALLOC_ARENA_MAX" in said and env == "None"
    said, _, _ = children["jemalloc"]
    assert said == "jemalloc preloaded"
