"""Host memory is flat over a long run: the trainer keeps no per-step history beyond what it logs (``fit`` used to
keep every ``StepResult`` of the call, each with float64 tensors of its expert loads and router sums: ~10 KB per
step per rank at DeepSeek-V3's size). Measured inside ONE ``fit`` of 500 steps of a tiny MoE model with a metrics
logger, from ``on_step`` (where a history kept by ``fit`` would be alive): the live tensors at step 500 are those
at step 50; the Python allocations (tracemalloc) of steps 280-500 add no more than a few bytes a step (caches
still warming: the growth halves every 200 steps; a kept history adds ~1 KB a step); the resident set grows by
less than the allocator's noise."""

from __future__ import annotations

import gc
import tracemalloc
import warnings

import pytest
import torch

from moefold.parallel.dims import ParallelDims
from moefold.training.observe.metrics import MetricsLogger
from moefold.training.trainer import StepResult, Trainer
from tests.training.trainer_common import tiny_config, tiny_data

pytestmark = pytest.mark.usefixtures("one_thread")


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():   # isinstance() on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_host_memory_is_flat_from_50_to_500_steps(tmp_path):
    config = tiny_config(steps=500, recipe="qwen3_moe_tiny", model={"hidden_size": 32, "num_experts": 4,
                                                                    "moe_ffn_hidden_size": 16, "ffn_hidden_size": 32},
                         global_batch_size=1, log_interval=10, lr_warmup_iters=1)
    trainer = Trainer(config, ParallelDims.single(), log=lambda _m: None)
    logger = MetricsLogger(tmp_path, total_steps=500, tensorboard=False, progress=False, print_fn=lambda _l: None)
    seen: dict[int, tuple[int, ...]] = {}

    def measure(r: StepResult) -> None:   # inside fit: what fit holds on to is alive here
        if r.step == 50:
            seen[50] = (_live_tensors(), _rss())
            tracemalloc.start()
        elif r.step == 280:   # the same point of a logging interval as step 500 (log_interval 10)
            gc.collect()
            seen[280] = (tracemalloc.get_traced_memory()[0],)
        elif r.step == 500:
            gc.collect()
            seen[500] = (_live_tensors(), _rss(), tracemalloc.get_traced_memory()[0])
            tracemalloc.stop()

    try:
        summary = trainer.fit(tiny_data(500), logger=logger, on_step=measure)
    finally:
        tracemalloc.stop()
        logger.close()
    assert summary.steps == 500 and summary.last.step == 500
    (tensors, rss), (before,), (tensors_500, rss_500, traced_500) = seen[50], seen[280], seen[500]
    assert tensors_500 - tensors <= 8, (tensors, tensors_500)   # a kept StepResult list: +1350 tensors
    assert traced_500 - before < 32 * 1024, traced_500 - before   # steps 280-500 (a kept history: ~220 KB)
    assert rss_500 - rss < 16 * 2**20, (rss, rss_500)
