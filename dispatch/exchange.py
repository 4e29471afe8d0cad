"""A chunked uneven all-to-all that lands rows directly in expert-major order (no sort pass).

The plain exchange receives [source rank x local expert] chunks and must then regroup them
(``sort_chunks``: a full copy of the rows, and another one on the way back). Instead, the sender
orders its rows [local expert index j x destination rank], and one all-to-all per j moves block
j: it arrives ordered by source rank, i.e. exactly as local expert j's rows in expert-major
order, written straight into their slice of the output. e collectives instead of one, no copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group


def _launch(out: Tensor, x: Tensor, out_splits: list[list[int]], in_splits: list[list[int]],
            group: Group) -> list[dist.Work]:
    works, o, i = [], 0, 0
    for oc, ic in zip(out_splits, in_splits):
        no, ni = sum(oc), sum(ic)
        works.append(dist.all_to_all_single(out[o:o + no], x[i:i + ni], oc, ic, group=group, async_op=True))
        o, i = o + no, i + ni
    return works


class PendingExchange:
    """Chunked all-to-all in flight; ``wait()`` returns the received rows (autograd-connected)."""

    def __init__(self, output: Tensor):
        self.output, self.works = output, []

    def wait(self) -> Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        return self.output


class _ChunkedAllToAll(torch.autograd.Function):
    """Forward: for each chunk c, all-to-all of the next sum(in_splits[c]) rows (rank r's share
    ``in_splits[c][r]``), received rows appended in chunk order (``out_splits[c][r]`` from rank r).
    Backward: the same exchange with the splits swapped. Launched asynchronously; the caller
    waits through the ``PendingExchange``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[list[int]], in_splits: list[list[int]], group: Group,
                pending: PendingExchange) -> Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(map(sum, out_splits)), *x.shape[1:]))
        pending.works = _launch(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_in = grad.new_empty((sum(map(sum, ctx.in_splits)), *grad.shape[1:]))
        for w in _launch(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group):
            w.wait()
        return grad_in, None, None, None, None


def chunked_all_to_all_async(x: Tensor, out_splits: list[list[int]], in_splits: list[list[int]],
                             group: Group) -> PendingExchange:
    """Start the chunked exchange of ``x`` over ``group`` (see ``_ChunkedAllToAll``); ``.wait()`` for the rows."""
    if sum(map(sum, in_splits)) != x.shape[0]:
        raise ValueError(f"chunked all-to-all: splits {in_splits} cover {sum(map(sum, in_splits))} rows, "
                         f"the input has {x.shape[0]}")
    pending = PendingExchange(x)
    pending.output = _ChunkedAllToAll.apply(x, out_splits, in_splits, group, pending)
    return pending


def chunked_all_to_all(x: Tensor, out_splits: list[list[int]], in_splits: list[list[int]], group: Group) -> Tensor:
    """Synchronous ``chunked_all_to_all_async``."""
    return chunked_all_to_all_async(x, out_splits, in_splits, group).wait()
