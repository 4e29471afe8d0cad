"""A pipeline rank's memory over a step does not grow with the number of micro-batches.

What the schedule keeps for the backward is the same at 4 and at 16 micro-batches (the steady-state in-flight
count), so the step's peak tensor memory (``measure_peak``, the trainer's method) must be too: the executor
must release every point-to-point tensor (sent outputs and input gradients, receive buffers) once its transfer
completed and nobody needs it, not at the step's end. One 2-rank gloo world; messages of 64 KiB dominate.
"""

from __future__ import annotations

import pytest
import torch

from moefold.parallel import ParallelConfig, ParallelDims
from moefold.pipeline.executor import SequentialStage, run_schedule
from moefold.pipeline.p2p import TensorSpec
from moefold.pipeline.schedules import build_schedule
from moefold.training.observe.memory import measure_peak
from tests.distributed import run_distributed

SPEC = TensorSpec((128, 128))
MESSAGE = 128 * 128 * 4
SCHEDULES = {"1f1b": 1, "interleaved": 2}   # name -> vpp
FEW, MANY = 4, 16


def _stage(pp_rank: int, vpp: int) -> tuple[SequentialStage, list[torch.nn.Parameter]]:
    """Chunk c of rank r is model chunk c * 2 + r: an element-wise scale and tanh (tiny weights, whole messages)."""
    weights = [torch.nn.Parameter(torch.full((SPEC.shape[1],), 0.5 + 0.1 * (c * 2 + pp_rank))) for c in range(vpp)]
    return SequentialStage([lambda h, w=w: torch.tanh(h * w) for w in weights]), weights


def _peaks() -> dict[tuple[str, int], int]:
    dims = ParallelDims.build(ParallelConfig(pp=2))
    out = {}
    for name, vpp in SCHEDULES.items():
        for m in (FEW, MANY):
            stage, weights = _stage(dims.pp_rank, vpp)
            inputs = [torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(i)) for i in range(m)]
            schedule = build_schedule(name, 2, m, vpp)
            step = lambda: run_schedule(stage, schedule, inputs, lambda out, _mb: out.pow(2).mean(), dims.pp_group,
                                        SPEC)
            result, peak = measure_peak(step)
            assert peak.method == "tensor_tracker" and all(w.grad is not None for w in weights)
            out[(name, m)] = (peak.bytes, result.peak_in_flight)
    return out


@pytest.fixture(scope="module")
def peaks() -> list[dict]:
    return run_distributed(_peaks, 2, timeout=120)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_peak_memory_does_not_grow_with_microbatches(peaks, name):
    for rank, per_rank in enumerate(peaks):
        (few, held_few), (many, held_many) = per_rank[(name, FEW)], per_rank[(name, MANY)]
        assert held_few == held_many, (rank, held_few, held_many)   # the same activations kept for the backward
        assert many - few <= MESSAGE, (f"rank {rank}: {many / MESSAGE:.1f} messages at {MANY} micro-batches, "
                                       f"{few / MESSAGE:.1f} at {FEW}")

