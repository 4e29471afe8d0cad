"""How K/V move between context-parallel ranks: the ring shift of the p2p mode, and the chunk order
of an all-gather along the sequence (shared by the fused and the math CP attention)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group, group_rank, group_ranks, group_size


class PendingShift:
    """Receive buffers of a ring step in flight; ``wait()`` before reading them."""

    def __init__(self) -> None:
        self.works: list = []
        self.sent: list[Tensor] = []  # the send buffers, kept alive until the transfer is done

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], []


def ring_shift(tensors: tuple[Tensor, ...], group: Group, pending: PendingShift, first_tag: int = 0) -> list[Tensor]:
    """Send each tensor to the next rank of ``group`` and receive the previous rank's.
    Returns the receive buffers; ``pending`` gets the works.
    Tensors get tags ``first_tag, first_tag + 1, ..``: exchanges in flight together need distinct tags."""
    ranks, me, n = group_ranks(group), group_rank(group), group_size(group)
    dst, src = ranks[(me + 1) % n], ranks[(me - 1) % n]
    ops, outs = [], []
    for tag, t in enumerate(tensors, start=first_tag):
        t = t.contiguous()
        pending.sent.append(t)
        out = torch.empty_like(t)
        # distinct tags: with cp=2 both messages go to the same peer
        ops.append(dist.P2POp(dist.isend, t, dst, group, tag))
        ops.append(dist.P2POp(dist.irecv, out, src, group, tag))
        outs.append(out)
    pending.works = dist.batch_isend_irecv(ops)
    return outs


def rank_order_to_global(x: Tensor, cp: int, dim: int) -> Tensor:
    """An all-gather of the CP parts holds the chunks in rank order ``[c0, c_{2cp-1}, c1, c_{2cp-2}, ..]``;
    return them in sequence order ``[c0, c1, .., c_{2cp-1}]`` (a copy; autograd-tracked)."""
    parts = x.chunk(2 * cp, dim=dim)
    order = [parts[0]] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = parts[2 * r], parts[2 * r + 1]
    return torch.cat(order, dim=dim)
