"""The planner's DeepEP terms follow V2: buffer bytes, the sync-free receive rows, the exchange bytes and links.

The planner restates DeepEP V2's buffer arithmetic (``planner.deepep``); the CPU stand-in restates it too,
independently (tests/dispatch/deepep_elastic_layout.py, which the stand-in enforces on every call): the two must
agree, and equal what moefold's dispatcher allocates through ``get_buffer_size_hint``.
"""

from __future__ import annotations

import dataclasses

import pytest

from moefold.dispatch.deepep_elastic import ElasticLayout
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.planner import comm
from moefold.planner.activations import ActivationShape
from moefold.planner.activations_ffn import moe_rows
from moefold.planner.deepep import (
    V2_WORKSPACE,
    deepep_buffer_bytes,
    legacy_buffer_bytes,
    v2_buffer_bytes,
    v2_receive_rows,
)
from moefold.training.config import RunConfig, TrainConfig
from tests.dispatch import deepep_elastic_layout, deepep_elastic_standin


class _Group:
    """A group of ``n`` ranks whose NCCL communicator is formed (it has run a collective), as DeepEP V2 needs it
    (tests/dispatch/deepep_elastic_comm.py)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n

    def _get_sequence_number_for_group(self) -> int:
        return 1


@pytest.mark.parametrize("ranks, nvl", [(2, 8), (8, 8), (16, 8), (64, 8), (4, 2), (72, 72)])
def test_v2_buffer_bytes_agree_with_the_standin_and_the_dispatcher(ranks, nvl):
    assert V2_WORKSPACE == 16 * 2**20   # WorkspaceLayout::get_num_bytes() (15.2 MiB), 2 MiB-aligned
    for hybrid in (True, False):
        for tokens, hidden, topk in ((4096, 7168, 8), (8192, 4096, 16), (512, 2048, 1), (64, 32, 32)):
            planned = v2_buffer_bytes(hidden, tokens, topk, ranks, nvl, hybrid) - V2_WORKSPACE
            standin = deepep_elastic_layout.calculate_buffer_size(ranks, nvl, tokens, hidden, topk, False, hybrid,
                                                                  True)
            assert planned == standin, (ranks, nvl, hybrid, tokens, hidden, topk)
            deepep_elastic_standin.NUM_NVL_RANKS = nvl
            try:   # what ElasticBuffers asks DeepEP for (bf16: the backward's gradient dispatch needs it)
                layout = ElasticLayout(tokens, hidden, 8 * ranks, topk, hybrid=hybrid, fp8=True)
                assert layout.buffer_bytes(deepep_elastic_standin.ElasticBuffer, _Group(ranks)) == planned
            finally:
                deepep_elastic_standin.NUM_NVL_RANKS = 8


def _config(dispatcher: str = "flex", **options) -> RunConfig:
    base = RunConfig(model=get_recipe("deepseek_v3_tiny"), parallel=ParallelConfig(ep=4, etp=2),
                     train=TrainConfig(micro_batch_size=2, global_batch_size=16, seq_length=64))
    return dataclasses.replace(base, options=dataclasses.replace(base.options, dispatcher=dispatcher, dtype="bf16",
                                                                 **options))


def test_buffer_bytes_follow_the_backend_and_mode():
    config = _config()
    sizes, _ = config.resolve(8)
    m = config.model
    tokens = 2 * 64
    assert deepep_buffer_bytes(config, sizes) == v2_buffer_bytes(m.hidden_size, tokens, m.moe_topk * 2, 8, 8)
    # across two nodes of 4: hybrid and direct mode's layouts (they differ: test above)
    hybrid = deepep_buffer_bytes(config, sizes, gpus_per_node=4)
    direct = deepep_buffer_bytes(_config(moe_deepep_mode="direct"), sizes, gpus_per_node=4)
    assert hybrid == v2_buffer_bytes(m.hidden_size, tokens, m.moe_topk * 2, 8, 4, True)
    assert direct == v2_buffer_bytes(m.hidden_size, tokens, m.moe_topk * 2, 8, 4, False)
    assert v2_buffer_bytes(7168, 4096, 8, 16, 8, True) != v2_buffer_bytes(7168, 4096, 8, 16, 8, False)
    legacy = _config(moe_flex_dispatcher_backend="deepep-legacy")
    assert deepep_buffer_bytes(legacy, sizes) == legacy_buffer_bytes(m.hidden_size, 8, 20)


def test_sync_free_rows_are_the_worst_case():
    config = _config()
    m = config.model
    shape = ActivationShape(model=m, options=config.options, tp=1, cp=1, ep=4, etp=2, micro_batch=2, seq_length=64)
    home, rows = moe_rows(shape, "flex")
    T, e = 128, m.num_experts // 4
    assert home == T * m.moe_topk and rows == v2_receive_rows(T, m.moe_topk * 2, 8, e) == 8 * T * min(2 * 4, e)
    synced = dataclasses.replace(shape, options=dataclasses.replace(config.options, moe_deepep_cpu_sync=True))
    assert moe_rows(synced, "flex") == (home, 2 * home)
    assert moe_rows(shape, "alltoall") == (home, 2 * home)


def test_v2_exchange_bytes_and_the_hybrid_network_share():
    config = _config()
    sizes, _ = config.resolve(8)
    flex = [c for c in comm.block_collectives(config, sizes, True) if c.region == "dispatch"]
    assert [c.what for c in flex] == ["DeepEP V2 dispatch", "DeepEP V2 combine", "DeepEP V2 combine of the gradients",
                                      "DeepEP V2 cached dispatch of the gradients"]
    assert all(c.hybrid is not None for c in flex) and flex[0].overlaps == "shared_experts"
    fp8 = _config(fp8=dataclasses.replace(config.options.fp8, dispatch=True))
    fp8_fwd = next(c for c in comm.block_collectives(fp8, sizes, True) if c.region == "dispatch")
    assert fp8_fwd.bytes < flex[0].bytes   # e4m3 rows forward
    d = flex[0].hybrid
    # once per node: fewer network bytes than a token to every remote destination rank
    assert 0 < d.network_bytes(2) < flex[0].bytes / 2 and d.network_bytes(1) == 0
    direct = [c for c in comm.block_collectives(_config(moe_deepep_mode="direct"), sizes, True)
              if c.region == "dispatch"]
    assert all(c.hybrid is None for c in direct) and [c.bytes for c in direct] == [c.bytes for c in flex]
