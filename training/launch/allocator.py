"""The host allocator setting that CPU training wants: freed large buffers kept for reuse, not returned to the OS.

glibc's defaults serve every allocation above the (dynamic, at most 32 MiB) mmap threshold with a fresh
``mmap`` and give it back on free, so each large activation or gradient buffer of every step is page-faulted
in again; on CPU that costs as much as a good part of the GEMMs (``benchmarks/RESULTS.md``: a 64 MB elementwise
op 2-3x slower). ``tune_cpu_allocator()`` applies the documented remedies, in this order:

1. jemalloc or tcmalloc already preloaded (``LD_PRELOAD``, PyTorch's CPU tuning guide): nothing to do;
2. the user set glibc's ``MALLOC_*`` tunables: theirs are kept;
3. glibc: ``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)`` at their maximum in this process, and
   the same values as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment so every rank
   started from it (spawned or forked) runs with them from its first allocation.

The cost: freed memory stays in the process (its resident size is the step's peak, not its current use).
Another C library (musl, macOS) is left alone. ``training.observe.machine.describe_machine`` prints the result.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LIMIT = 2**31 - 1   # mallopt takes an int: the largest threshold it can set (2 GiB)
PRELOADED = ("jemalloc", "tcmalloc")


def tune_cpu_allocator() -> str:
    """Apply the module docstring's setting once; returns what was done (one phrase for the machine line)."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in PRELOADED:
        if name in preload:
            return f"{name} preloaded"
    user = sorted(k for k, v in os.environ.items() if k.startswith("MALLOC_") or (k == "GLIBC_TUNABLES"
                                                                                    and "malloc" in v))
    if user:
        return f"glibc tunables from the environment ({', '.join(user)})"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc: the C library's defaults"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(M_MMAP_THRESHOLD, LIMIT) and libc.mallopt(M_TRIM_THRESHOLD, LIMIT)):
        return "glibc refused mallopt: its defaults"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(LIMIT)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(LIMIT)
    return f"glibc mallopt: mmap and trim thresholds {LIMIT} (set by moefold)"


__all__ = ["tune_cpu_allocator"]
