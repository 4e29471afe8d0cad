"""``ParallelDims.expert_token_group``: the ranks holding the same experts that split one micro-batch's tokens."""

from __future__ import annotations

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.groups import group_ranks


def _groups() -> dict[str, list[int] | None]:
    out = {}
    for label, config in (("tp2", ParallelConfig(tp=2)), ("tp2xep2", ParallelConfig(tp=2, ep=2)),
                          ("tp4xep2", ParallelConfig(tp=4, ep=2)), ("tp2xcp2", ParallelConfig(tp=2, cp=2)),
                          ("ep4", ParallelConfig(ep=4)), ("tp2xetp2", ParallelConfig(tp=2, etp=2))):
        group = ParallelDims.build(config).expert_token_group
        out[label] = None if group is None else group_ranks(group)
    return out


def test_expert_token_group_partitions_each_micro_batch_by_expert_coordinates():
    from tests.distributed import run_distributed

    got = run_distributed(_groups, 4)
    # tp2 (ep 1): every rank runs all experts on its sequence shard: the tp group
    assert [g["tp2"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # the dispatcher's ep (or etp) group spans the tp x cp block: each expert sees all its rows
    assert all(g[k] is None for g in got for k in ("tp2xep2", "ep4", "tp2xetp2"))
    # tp4 x ep2: ranks 0, 2 hold ep rank 0's experts, 1, 3 ep rank 1's
    assert [g["tp4xep2"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["tp2xcp2"] for g in got] == [[0, 1, 2, 3]] * 4
