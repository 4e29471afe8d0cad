"""CPU-only shortcuts, and the switch that turns them off so that a CPU run executes the code a GPU runs.

Some host work is free on a CPU and a host synchronisation on a GPU. The one moefold takes: the routed experts
read their row counts on the host to lay their rows out for the CPU's GEMMs (``moe.cpu.rows_gemm.choose_layout``);
on CUDA they never read them (``grouped_mm`` takes the counts on the device). Code that takes such a shortcut
asks ``takes_cpu_shortcut(t)`` first.

``training.observe.host_sync.HostSyncCounter`` counts, on a CPU, what would synchronise if every tensor lived
on a GPU. It runs its block under ``gpu_code_paths()``, so what it counts is the GPU's code path, not the CPU
shortcut's (a CPU shortcut would otherwise count as a sync the GPU never makes, and the GPU path would go
uncounted). Nothing crosses ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

_gpu_paths_depth = 0   # one process, one counting block at a time (the counter's own rule)


@contextmanager
def gpu_code_paths() -> Iterator[None]:
    """Inside the block, ``takes_cpu_shortcut`` is False on every device: CPU tensors take the GPU's code."""
    global _gpu_paths_depth
    _gpu_paths_depth += 1
    try:
        yield
    finally:
        _gpu_paths_depth -= 1


def takes_cpu_shortcut(t: Tensor) -> bool:
    """True when ``t`` lives on the CPU and no ``gpu_code_paths()`` block is active."""
    return t.device.type == "cpu" and _gpu_paths_depth == 0


__all__ = ["gpu_code_paths", "takes_cpu_shortcut"]
