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


def test_a_pipeline_stage_sends_every_residual_stream() -> None:
    """What crosses a V4 pipeline boundary is the ``[S, B, hc_mult, H]`` streams (``dense.hyper_connections``), so
    the sent activation, the received one and the schedule's messages are ``hc_mult`` hidden states wide."""
    from moefold.planner.activations import activation_shape
    from moefold.planner.profile import chunk_parts

    model = get_recipe("deepseek_v4_tiny")
    train = TrainConfig(micro_batch_size=1, global_batch_size=2, seq_length=128, train_iters=1, lr_warmup_iters=0,
                        bf16=True)
    config = RunConfig(model=model, parallel=ParallelConfig(pp=2), options=ModelOptions(), train=train,
                       recipe=model.name)
    sizes, _ = config.resolve(2)
    shape = activation_shape(config, sizes)
    parts = chunk_parts(shape, [1, 2], False, False, "local", True, True)
    pipeline = {k: v for p in parts if p.name == "pipeline" for k, v in p.saved.items()}
    width = 2 * 128 * model.hidden_size * model.v4.hc_mult
    # the received streams are the tensor the first block's hyper-connection keeps for its mix-back ("mix streams",
    # as the first norm keeps a received [S, B, H]): counted there, once
    assert pipeline == {"received activation": 0, "sent activation": width}
    first = next(p for p in parts if any("mix streams" in k for k in p.saved))
    assert next(v for k, v in first.saved.items() if "mix streams" in k) == width
