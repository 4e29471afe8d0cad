"""``--compile`` on CUDA (inductor's Triton kernels): 5 steps of a tiny Qwen3-MoE equal eager (see
tests/execution/test_compile.py for what is compared). Skipped without CUDA (tests/gpu/conftest.py); in a
rehearsal (tests/gpu/rehearsal.py) inductor generates C++ for the CPU instead."""

import pytest

from moefold.execution.compile import compile_unavailable
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.execution.test_compile import _compare, _steps


def test_compile_equals_eager_cuda(device):
    reason = compile_unavailable(device)
    if reason is not None:
        pytest.skip(reason)
    dims = ParallelDims.single(device)
    eager = _steps(False, ParallelConfig(), dims, device=device)
    compiled = _steps(True, ParallelConfig(), dims, device=device)
    failures = _compare(eager, compiled, f"{device} world 1")
    assert not failures, "\n".join(failures)
