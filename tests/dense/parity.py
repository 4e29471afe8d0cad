"""Helpers for layout-parity tests: gather a module's parameters/gradients to full shape and compare.

Used inside ``run_distributed`` ranks. Every helper that gathers is a collective over the
parameters' shard groups (and the tp group for sequence-parallel gradients): call it on all ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import gather_full, is_sequence_parallel, shards_of


def full_params(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter gathered to its full shape."""
    return {name: gather_full(p, shards_of(p)) for name, p in module.named_parameters()}


def full_grads(module: nn.Module, tp_group: Group) -> dict[str, Tensor]:
    """Every parameter's gradient gathered to full shape; SP-replicated params' grads summed over tp first."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            raise AssertionError(f"parameter {name} got no gradient")
        g = p.grad.detach().clone()
        if is_sequence_parallel(p) and group_size(tp_group) > 1:
            dist.all_reduce(g, group=tp_group)
        out[name] = gather_full(g, shards_of(p))
    return out


def seq_shard(x: Tensor, tp_group: Group, sequence_parallel: bool, dim: int = 0) -> Tensor:
    """This rank's sequence shard of a full tensor (the whole tensor without SP)."""
    if not sequence_parallel or group_size(tp_group) == 1:
        return x
    return x.chunk(group_size(tp_group), dim=dim)[group_rank(tp_group)].contiguous()


def seq_gather(x: Tensor, tp_group: Group, sequence_parallel: bool, dim: int = 0) -> Tensor:
    """Inverse of ``seq_shard`` (no autograd)."""
    if not sequence_parallel or group_size(tp_group) == 1:
        return x.detach()
    parts = [torch.empty_like(x) for _ in range(group_size(tp_group))]
    dist.all_gather(parts, x.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


def assert_all_close(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str, atol: float = 1e-5,
                     rtol: float = 0.0) -> None:
    if actual.keys() != expected.keys():
        raise AssertionError(f"{what}: names differ: {sorted(actual)} vs {sorted(expected)}")
    for name in expected:
        try:
            torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=rtol)
        except AssertionError as e:
            raise AssertionError(f"{what}: {name}: {e}") from None
