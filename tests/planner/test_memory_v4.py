"""``moefold plan``'s activation model for DeepSeek-V4 (``planner.activations_v4``) against the trainer's measured
peak at world 1 (``tests/planner/test_memory.py``'s measurement: the tensor tracker over one forward + backward).

The compressed attention keeps no scores (each block of queries recomputes its band and entries' scores in the
backward): the model counts its transient block scores, the indexer's picks, and the mHC streams' tensors."""

from __future__ import annotations

import pytest

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import RunConfig, TrainConfig
from tests.planner.test_memory import ACTIVATION_RTOL, measured_activations, predicted_activations


@pytest.mark.parametrize("bf16", [False, True])
def test_v4_activation_peak_world1(bf16: bool) -> None:
    model = get_recipe("deepseek_v4_tiny")
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, seq_length=512, train_iters=1, lr_warmup_iters=0,
                        bf16=bf16)
    config = RunConfig(model=model, parallel=ParallelConfig(), options=ModelOptions(), train=train,
                       recipe="deepseek_v4_tiny")
    measured = measured_activations(config, ParallelDims.single())
    predicted = predicted_activations(config, 1, 0)
    assert predicted == pytest.approx(measured, rel=ACTIVATION_RTOL), f"{predicted / measured - 1:+.1%}"


def test_the_planner_blocks_queries_as_the_attention_does() -> None:
    from moefold.dense.compressed_attention import V4AttentionConfig
    from moefold.planner.activations_v4 import V4_QUERY_CHUNK

    assert V4AttentionConfig.__dataclass_fields__["query_chunk"].default == V4_QUERY_CHUNK
