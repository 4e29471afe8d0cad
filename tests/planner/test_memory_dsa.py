"""``moefold plan``'s activation model of DeepSeek sparse attention (``planner.activations_dsa``) against the trainer's
measured peak at world 1 (``tests/planner/test_memory.py``'s measurement). Counted as dense MLA (the CPU's math
kernel keeping ``[h, S, S]`` probabilities) the prediction was 2.7x the measured peak at 1024 tokens."""

from __future__ import annotations

import pytest

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import RunConfig, TrainConfig
from tests.planner.test_memory import ACTIVATION_RTOL, measured_activations, predicted_activations


@pytest.mark.parametrize("bf16", [False, True])
def test_dsa_activation_peak_world1(bf16: bool) -> None:
    model = get_recipe("deepseek_v32_tiny")
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, seq_length=1024, train_iters=1, lr_warmup_iters=0,
                        bf16=bf16)
    config = RunConfig(model=model, parallel=ParallelConfig(), options=ModelOptions(), train=train,
                       recipe=model.name)
    measured = measured_activations(config, ParallelDims.single())
    predicted = predicted_activations(config, 1, 0)
    assert predicted == pytest.approx(measured, rel=ACTIVATION_RTOL), f"{predicted / measured - 1:+.1%}"


def test_the_planner_blocks_queries_as_the_attention_does() -> None:
    from moefold.dense.dsa_indexer import DSAConfig
    from moefold.planner.activations_dsa import DSA_QUERY_CHUNK

    assert DSAConfig.__dataclass_fields__["query_chunk"].default == DSA_QUERY_CHUNK
