"""Tests in tests/gpu/ need CUDA (and the optional GPU backends); they skip cleanly without.

Rehearsal (``MOEFOLD_GPU_REHEARSAL=1``, what ``gpu_check --rehearsal`` and
tests/training/test_gpu_rehearsal.py set): every test runs its own code on the CPU wherever its
logic needs no CUDA-only kernel, on the device the ``device`` fixture names, so an API change that
breaks a GPU test fails on a machine without a GPU. Checks that need a CUDA-only kernel call
``tests.gpu.rehearsal.cuda_only(what)``, which skips them in rehearsal naming ``what``.
"""

import pytest
import torch

from tests.gpu.rehearsal import REHEARSAL, device_type


def pytest_collection_modifyitems(config, items):
    if REHEARSAL or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (or MOEFOLD_GPU_REHEARSAL=1 to rehearse on the CPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """The device the GPU tests run on: "cuda", or "cpu" in a rehearsal."""
    return device_type()
