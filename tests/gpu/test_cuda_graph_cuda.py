"""CUDA graphs on CUDA (``--cuda-graph-impl local`` and ``full_iteration``): a captured training step equals eager,
and replays faster. Skipped without CUDA (tests/gpu/conftest.py); in a rehearsal (tests/gpu/rehearsal.py) the same
trainer runs the capture-equivalent path on the CPU, and the timing check is skipped.

The model is ``tools.gpu.graph_rows``' (qwen3_moe_tiny in bf16, dropless local dispatch, which is sync-free in bf16)
at its tiny size: 2 micro-batches of 32 tokens, so each step is a few hundred small kernels. Every row runs the
same data from the same initialisation, 2 eager warm-up steps (the capture happens after them) and 3 more; the
losses of all 5 steps must equal eager's to bf16 rounding (the replayed kernels are the captured ones, the same
as eager's, so equal is expected; the tolerance allows a differently ordered reduction).
"""

import pytest
import torch

from moefold.tools.gpu.graph_rows import LOSS_RTOL, ROWS, run_row
from tests.gpu.rehearsal import cuda_only, device_type

WARMUP, STEPS = 2, 3


@pytest.fixture(scope="module")
def eager():
    """The eager row, once for the module (the ``device`` fixture's device)."""
    return run_row(*ROWS["eager"], "tiny", device_type(), WARMUP, STEPS)


@pytest.mark.parametrize("row", [r for r in ROWS if r != "eager"])
def test_captured_steps_equal_eager(device, eager, row):
    losses, _ = run_row(*ROWS[row], "tiny", device, WARMUP, STEPS)
    base, _ = eager
    assert len(losses) == len(base) == WARMUP + STEPS
    for step, (got, want) in enumerate(zip(losses, base)):
        assert got == pytest.approx(want, rel=LOSS_RTOL), f"{row} step {step + 1}: loss {got} vs eager {want}"


def test_full_iteration_replays_faster(device, eager):
    cuda_only("timing CUDA graph replay against eager launches")
    _, seconds = run_row(*ROWS["full_iteration"], "tiny", device, WARMUP, STEPS)
    graphed, plain = sorted(seconds)[len(seconds) // 2], sorted(eager[1])[len(eager[1]) // 2]
    assert graphed < plain, f"full_iteration step {1e3 * graphed:.2f} ms, eager {1e3 * plain:.2f} ms"
    assert torch.cuda.is_available()
