"""The GPU tests' rehearsal on the CPU (``MOEFOLD_GPU_REHEARSAL=1``): which device, what to skip.

A rehearsal runs each GPU test's own code (the same calls, shapes and assertions) on the CPU, so
that a renamed function, a changed signature or a removed field fails there, before a GPU
machine's few minutes are spent on it. What only a CUDA kernel can show (its numerics, its speed,
CUDA's own sync detection) is skipped with ``cuda_only(what)``, naming the kernel.
"""

from __future__ import annotations

import os

import pytest

REHEARSAL = os.environ.get("MOEFOLD_GPU_REHEARSAL", "") not in ("", "0")
# "quick": the CI-sized rehearsal (tests/tools/gpu/test_rehearsal.py): each test function once, with its
# first parameters, except those in QUICK_LEAVES_OUT (their code runs in the full rehearsal)
QUICK = os.environ.get("MOEFOLD_GPU_REHEARSAL", "") == "quick"
QUICK_LEAVES_OUT = {
    "test_compile_equals_eager_cuda": "the same calls as tests/execution/test_compile.py's world-1 test, "
                                      "which the CPU suite runs",
}


def device_type() -> str:
    return "cpu" if REHEARSAL else "cuda"


def cuda_only(what: str) -> None:
    """Skip the calling test in a rehearsal: ``what`` (a CUDA-only kernel or library) cannot run on the CPU."""
    if REHEARSAL:
        pytest.skip(f"rehearsal on CPU: {what} is CUDA-only")


def capability() -> tuple[int, int]:
    """The GPU's compute capability; in a rehearsal, Hopper's (9, 0), the machine the check is sized for."""
    import torch

    return (9, 0) if REHEARSAL else torch.cuda.get_device_capability()


def gpu_library(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a rehearsal, put the CPU stand-in of ``name`` ("te": Transformer Engine, "deep_ep": DeepEP,
    "grouped_gemm") where the real library would be imported from, so a test exercises moefold's calls into
    it (the stand-ins have the real signatures and reject what the libraries reject; their arithmetic is
    plain). On a GPU: nothing (the real one)."""
    if not REHEARSAL:
        return
    if name == "te":
        from tests.moe import te_standin

        te_standin.install(monkeypatch)
    elif name == "grouped_gemm":
        from tests.moe import grouped_gemm_standin

        grouped_gemm_standin.install(monkeypatch)
    elif name == "deep_ep":   # DeepEP 2.x: ElasticBuffer and the legacy Buffer
        import sys

        from tests.dispatch import deepep_elastic_standin

        monkeypatch.setitem(sys.modules, "deep_ep", deepep_elastic_standin.module())
    else:
        raise ValueError(f"no CPU stand-in for {name!r}; there are stand-ins for 'te', 'grouped_gemm' and 'deep_ep'")
