"""Tests in tests/gpu/ need CUDA (and the optional GPU backends); they skip cleanly without.

Rehearsal (``MOEFOLD_GPU_REHEARSAL=1``, what ``gpu_check --rehearsal`` and
tests/tools/gpu/test_rehearsal.py set): every test runs its own code on the CPU wherever its
logic needs no CUDA-only kernel, on the device the ``device`` fixture names, so an API change that
breaks a GPU test fails on a machine without a GPU. Checks that need a CUDA-only kernel call
``tests.gpu.rehearsal.cuda_only(what)``, which skips them in rehearsal naming ``what``.
"""

import os

# Before the first CUDA query of this pytest process: torch.cuda.is_available() below then asks NVML, not the
# CUDA runtime, and does not "poison" forks; the multi-rank tests fork their ranks (tests/distributed.py), and
# on a machine with 2+ GPUs every forked rank would otherwise fail to initialise CUDA.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest
import torch

from tests.gpu.rehearsal import QUICK, QUICK_LEAVES_OUT, REHEARSAL, device_type


def _in_gpu_tests(item) -> bool:
    return "tests/gpu/" in str(item.fspath).replace("\\", "/")


def pytest_collection_modifyitems(config, items):
    if QUICK:  # each test function once (its first parameters), minus what the CPU suite already runs
        seen: set[tuple[str, str]] = set()
        kept, dropped = [], []
        for item in items:
            key = (str(item.fspath), item.originalname)
            if _in_gpu_tests(item) and key in seen:
                dropped.append(item)
                continue
            seen.add(key)
            kept.append(item)
            if _in_gpu_tests(item) and item.originalname in QUICK_LEAVES_OUT:
                item.add_marker(pytest.mark.skip(reason=f"rehearsal quick: {QUICK_LEAVES_OUT[item.originalname]}"))
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    if REHEARSAL or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (or MOEFOLD_GPU_REHEARSAL=1 to rehearse on the CPU)")
    for item in items:
        if _in_gpu_tests(item):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """The device the GPU tests run on: "cuda", or "cpu" in a rehearsal."""
    return device_type()
