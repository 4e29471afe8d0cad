"""Sharding metadata: gather back to full, and init identical across layouts."""

import torch
import torch.distributed as dist
from torch import nn

from moefold.parallel import Shard, full_shape, gather_full, init_parameters, mark_sharded, normal_init, set_init
from tests.distributed import run_distributed


def _module(group_a, group_b) -> nn.Module:
    m = nn.Module()
    shape = [4, 6, 5]
    a, b = Shard.over(group_a, 0), Shard.over(group_b, 1)
    shape[0] //= a.num
    shape[1] //= b.num
    m.w = nn.Parameter(torch.empty(shape))
    mark_sharded(m.w, a, b)
    set_init(m.w, normal_init(0.02))
    m.norm = nn.Parameter(torch.ones(5))
    return m


def _gathered_after_init() -> torch.Tensor:
    world = dist.group.WORLD
    pairs = dist.new_group([0, 1]), dist.new_group([2, 3])
    inner = pairs[dist.get_rank() // 2]
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])][dist.get_rank() % 2]
    out = []
    for a, b in ((world, None), (outer, inner), (None, inner)):
        m = _module(a, b)
        init_parameters(m, seed=7)
        assert full_shape(m.w) == (4, 6, 5)
        out.append(gather_full(m.w, m.w.moefold_shards))
    return torch.stack(out)


def test_init_and_gather_are_layout_independent():
    reference = _module(None, None)
    init_parameters(reference, seed=7)
    assert torch.equal(reference.norm, torch.ones(5))  # no init fn: constructor value kept
    for per_rank in run_distributed(_gathered_after_init, 4):
        for gathered in per_rank:
            torch.testing.assert_close(gathered, reference.w.detach(), rtol=0, atol=0)


def test_different_seeds_and_names_differ():
    a, b = _module(None, None), _module(None, None)
    init_parameters(a, seed=1)
    init_parameters(b, seed=2)
    assert not torch.equal(a.w, b.w)
    # same seed and shape, different names: different draws (each name seeds its own generator)
    m = nn.Module()
    m.first, m.second = nn.Parameter(torch.empty(4, 5)), nn.Parameter(torch.empty(4, 5))
    for p in (m.first, m.second):
        set_init(p, normal_init(0.02))
    init_parameters(m, seed=1)
    assert not torch.equal(m.first, m.second)
    # and the same name draws the same values in another module
    n = nn.Module()
    n.first = nn.Parameter(torch.empty(4, 5))
    set_init(n.first, normal_init(0.02))
    init_parameters(n, seed=1)
    assert torch.equal(n.first, m.first)


def test_a_rank_draws_only_the_rows_it_holds():
    calls = []

    def counting_init(t: torch.Tensor, gen: torch.Generator) -> None:
        calls.append(tuple(t.shape))
        t.normal_(0.0, 1.0, generator=gen)

    full = nn.Module()
    full.w = set_init(nn.Parameter(torch.empty(8, 6)), counting_init)
    init_parameters(full, seed=3)
    shard = nn.Module()  # rows 4-5 of 8 (dim 0 split in 4), columns 3-5 (dim 1 split in 2)
    shard.w = set_init(nn.Parameter(torch.empty(2, 3)), counting_init)
    mark_sharded(shard.w, Shard(dim=0, num=4, index=2, group=None), Shard(dim=1, num=2, index=1, group=None))
    calls.clear()
    init_parameters(shard, seed=3)
    assert calls == [(6,), (6,)]  # two rows drawn, never the full [8, 6]
    torch.testing.assert_close(shard.w.detach(), full.w.detach()[4:6, 3:6], rtol=0, atol=0)
