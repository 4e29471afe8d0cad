"""Collectives with autograd (Megatron's f/g pairs), each a no-op on a group of size 1, and
``all_reduce_sum``, the one plain (no-autograd) reduction for counts and statistics.

Every function here takes its group explicitly. Tensors crossing ranks must have the same
shape on every rank except for the split dimension of the uneven all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group, group_rank, group_size


# --------------------------------------------------------------------------------------------
# plain (non-autograd) building blocks
# --------------------------------------------------------------------------------------------
def all_gather_single(out: Tensor, x: Tensor, group: Group, async_op: bool = False):
    """``dist.all_gather_single`` (torch >= 2.13), else its old name ``all_gather_into_tensor``, which warns
    (FutureWarning) on every call from 2.13 on. Looked up at call time so that a wrapper installed on
    ``torch.distributed`` (the tests' collective recorders) sees the call. Returns the Work when ``async_op``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: Tensor, x: Tensor, group: Group, async_op: bool = False):
    """``dist.reduce_scatter_single`` (torch >= 2.13; sum), else its old name ``reduce_scatter_tensor``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, x, group=group, async_op=async_op)


def _all_gather(x: Tensor, group: Group, dim: int) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0], *moved.shape[1:]))
    all_gather_single(out, moved, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, group: Group, dim: int) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"reduce-scatter: size {x.shape[dim]} of dim {dim} is not divisible by group size {n}")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    reduce_scatter_single(out, moved, group)
    return out.movedim(0, dim)


def _split(x: Tensor, group: Group, dim: int) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"scatter: size {x.shape[dim]} of dim {dim} is not divisible by group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_reduce_sum(x: Tensor, group: Group) -> Tensor:
    """Sum of ``x`` over ``group`` as a new tensor, outside autograd (``x`` itself when the group has
    size 1). For statistics and counts; differentiable sums use ``reduce_from_region``."""
    if group_size(group) == 1:
        return x
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


# --------------------------------------------------------------------------------------------
# autograd pairs
# --------------------------------------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient over the group."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _ScatterAlongDim(torch.autograd.Function):
    """Forward: keep this rank's chunk of ``dim``. Backward: all-gather the gradient along ``dim``."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherAlongDim(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: keep this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _split(grad, ctx.group, ctx.dim), None, None


class _AllGatherSequence(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: reduce-scatter (sum) along ``dim``.

    The sequence-parallel entry into a tensor-parallel region: every rank's gradient w.r.t.
    the full sequence is a partial sum that must be added up and re-sharded.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


@dataclass
class PendingAllToAll:
    """An all-to-all in flight. ``wait()`` returns the received tensor (autograd-connected)."""

    output: Tensor
    work: dist.Work | None

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output


class _AllToAll(torch.autograd.Function):
    """Forward: uneven all-to-all along dim 0, rank i sending ``input_splits[j]`` rows to rank j
    and receiving ``output_splits[j]`` rows from rank j. Backward: the same exchange with the
    splits swapped. With ``pending`` set, the forward is launched asynchronously and its
    ``work`` handle stored on ``pending``; the caller must ``wait()`` before reading the output.
    """

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group: Group,
                pending: PendingAllToAll | None) -> Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group,
                                      async_op=pending is not None)
        if pending is not None:
            pending.work = work
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_in = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return grad_in, None, None, None, None


# --------------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------------
def copy_to_region(x: Tensor, group: Group) -> Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce backward."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: Tensor, group: Group) -> Tensor:
    """Leave a tensor-parallel region: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_along_dim(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    """Keep this rank's 1/n chunk of ``dim`` forward; all-gather backward."""
    return x if group_size(group) == 1 else _ScatterAlongDim.apply(x, group, dim % x.dim())


def gather_along_dim(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    """All-gather along ``dim`` forward; keep this rank's chunk backward."""
    return x if group_size(group) == 1 else _GatherAlongDim.apply(x, group, dim % x.dim())


def all_gather_sequence(x: Tensor, group: Group, dim: int = 0) -> Tensor:
    """Sequence-parallel all-gather: [S/n, ...] -> [S, ...]; backward reduce-scatters."""
    return x if group_size(group) == 1 else _AllGatherSequence.apply(x, group, dim % x.dim())


def reduce_scatter_sequence(x: Tensor, group: Group, dim: int = 0) -> Tensor:
    """Sequence-parallel reduce-scatter: [S, ...] partial sums -> [S/n, ...]; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group, dim % x.dim())


def _check_splits(x: Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> None:
    n = group_size(group)
    if len(output_splits) != n or len(input_splits) != n:
        raise ValueError(f"all-to-all needs {n} splits per direction (group size), got "
                         f"input_splits={input_splits} output_splits={output_splits}")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"all-to-all input_splits={input_splits} sum to {sum(input_splits)} "
                         f"but the input has {x.shape[0]} rows")


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> Tensor:
    """Uneven all-to-all along dim 0 (see ``_AllToAll``); backward swaps the splits."""
    _check_splits(x, output_splits, input_splits, group)
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, None)


def all_to_all_async(x: Tensor, output_splits: list[int], input_splits: list[int],
                     group: Group) -> PendingAllToAll:
    """Launch ``all_to_all`` without waiting; call ``.wait()`` on the result to get the output.

    Work placed between the launch and ``wait()`` (e.g. shared experts) overlaps the exchange.
    """
    _check_splits(x, output_splits, input_splits, group)
    if group_size(group) == 1:
        return PendingAllToAll(output=x, work=None)
    pending = PendingAllToAll(output=x, work=None)
    pending.output = _AllToAll.apply(x, list(output_splits), list(input_splits), group, pending)
    return pending
