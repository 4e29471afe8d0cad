"""Index-based permutation of token copies into expert-major rows and back.

A rank holds T tokens, each routed to K experts: T*K *copies*, addressed by their flat slot
``t * K + k``. Dispatch lays the copies it keeps out as N rows grouped by a key (the expert,
or (expert, source rank)), stably, so the order is deterministic: inside a group, rows keep
their slot order. Everything here is gathers (``index_select``) and unique-index copies, so
the results are bitwise reproducible on every device; no dense [T, E] tensor is built.

Host synchronisation: none, except ``build_row_map`` without a capacity and without
``num_rows`` (one scalar read of the row count). Counts use ``scatter_add_`` (``torch.bincount``
reads its input's min and max back to the host on CUDA); ``sort_chunks`` passes the host-known
row count as ``repeat_interleave``'s ``output_size``. Proved by tests/dispatch/test_host_sync.py.

``RowMap`` records where each row came from; ``permute`` / ``unpermute`` are an adjoint pair
(each one's backward is the other), and ``sort_chunks`` regroups a buffer of [A x B] chunks
into [B x A] order (received [source rank x local expert] -> [local expert x source rank]).
``unpermute(rows, row_map, probs_TK)`` is the combine's weighted sum: each copy times its routing
prob, in the same ``embedding_bag`` pass (``per_sample_weights``); its backward returns the rows'
gradient (token gradient times prob) and the probs' (token gradient . row) from one gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RowMap:
    """Where each of the N dispatched rows comes from.

    token_of_row_N: [N] int64 source token in [0, T); T for a padding row
    slot_of_row_N:  [N] int64 flat copy slot t*K+k in [0, T*K); T*K for a padding row
    counts_G:       [G] int64 rows per group (padding included), on the tokens' device
    padded:         rows may be padding (each group padded to exactly ``capacity`` rows)
    """

    token_of_row_N: Tensor
    slot_of_row_N: Tensor
    counts_G: Tensor
    num_tokens: int
    topk: int
    padded: bool

    @property
    def num_rows(self) -> int:
        return self.slot_of_row_N.shape[0]


def mask_groups(group_TK: Tensor, num_groups: int, keep_TK: Tensor | None = None) -> Tensor:
    """Flatten [T, K] group ids to [T*K]; copies that are not dispatched get the sentinel ``num_groups``.

    A copy is not dispatched when ``keep_TK`` is False or its group lies outside [0, num_groups)
    (e.g. an expert held by another rank after subtracting the local offset).
    """
    key = group_TK.reshape(-1).long()
    invalid = (key < 0) | (key >= num_groups)
    if keep_TK is not None:
        invalid = invalid | ~keep_TK.reshape(-1).bool()
    return key.masked_fill(invalid, num_groups)


def count_keys(key_N: Tensor, num_keys: int) -> Tensor:
    """[num_keys] int64 occurrences of each value in ``key_N`` (values in [0, num_keys)), on device.

    ``scatter_add_`` rather than ``torch.bincount``: bincount reads min/max back to the host on CUDA.
    """
    counts = torch.zeros(num_keys, dtype=torch.int64, device=key_N.device)
    return counts.scatter_add_(0, key_N.long(), torch.ones_like(key_N, dtype=torch.int64))


def group_counts(key_N: Tensor, num_groups: int) -> Tensor:
    """[G] int64 number of dispatched copies per group (sentinel copies excluded), on device, no sync."""
    return count_keys(key_N, num_groups + 1)[:num_groups]


def build_row_map(key: Tensor, num_tokens: int, topk: int, num_groups: int, *,
                  capacity: int | None = None, num_rows: int | None = None) -> RowMap:
    """Sort the copies of ``key`` ([T*K] from ``mask_groups``) into group-major rows.

    Without ``capacity``: one row per dispatched copy, N = ``num_rows`` (the host-side count of
    dispatched copies; computed with one device->host sync when not given).
    With ``capacity``: every group is exactly ``capacity`` rows (N = G * capacity); missing rows
    are padding, and copies beyond a group's capacity are not dispatched (a correct router has
    already dropped them through its keep mask).
    """
    T, K, G = num_tokens, topk, num_groups
    if key.shape[0] != T * K:
        raise ValueError(f"key has {key.shape[0]} copies, expected num_tokens*topk={T}*{K}")
    order = torch.argsort(key, stable=True)
    if capacity is None:
        counts = group_counts(key, G)
        if num_rows is None:
            num_rows = int(counts.sum().item())
        slot = order[:num_rows]
        return RowMap(slot // K, slot, counts, T, K, padded=False)
    if capacity < 0:
        raise ValueError(f"capacity={capacity} must be >= 0")
    counts_all = count_keys(key, G + 1)
    starts = torch.cumsum(counts_all, 0) - counts_all
    sorted_key = key.index_select(0, order)
    pos = torch.arange(T * K, device=key.device) - starts.index_select(0, sorted_key)
    ok = (sorted_key < G) & (pos < capacity)
    n = G * capacity
    row = torch.where(ok, sorted_key * capacity + pos, n)  # row n is a sink for undispatched copies
    slot = torch.full((n + 1,), T * K, dtype=torch.long, device=key.device).scatter_(0, row, order)[:n]
    counts = torch.full((G,), capacity, dtype=torch.long, device=key.device)
    return RowMap(slot // K, slot, counts, T, K, padded=True)


def pad_counts(counts: list[int], multiple: int) -> list[int]:
    """Each count rounded up to a multiple of ``multiple`` (host ints)."""
    return [-(-c // multiple) * multiple for c in counts]


def build_padded_row_map(key: Tensor, num_tokens: int, topk: int, num_groups: int, counts_host: list[int],
                         multiple: int) -> RowMap:
    """Group-major rows as ``build_row_map`` without capacity, each group followed by zero (padding) rows up to
    a multiple of ``multiple`` (``counts_host``: the groups' copy counts; the padded row count is their rounded
    sum). The padding is part of the row map: ``permute`` writes the zero rows where they belong, ``unpermute``
    drops them, so no padded copy of the rows is made (``--moe-router-padding-for-quantization``)."""
    T, K, G = num_tokens, topk, num_groups
    padded = pad_counts(counts_host, multiple)
    n = sum(padded)
    order = torch.argsort(key, stable=True)
    counts_all = count_keys(key, G + 1)
    starts = torch.cumsum(counts_all, 0) - counts_all
    padded_t = torch.tensor([*padded, 0], dtype=torch.long, device=key.device)
    padded_starts = torch.cumsum(padded_t, 0) - padded_t
    sorted_key = key.index_select(0, order)
    pos = torch.arange(T * K, device=key.device) - starts.index_select(0, sorted_key)
    row = torch.where(sorted_key < G, padded_starts.index_select(0, sorted_key) + pos, n)
    slot = torch.full((n + 1,), T * K, dtype=torch.long, device=key.device).scatter_(0, row, order)[:n]
    return RowMap(slot // K, slot, padded_t[:G], T, K, padded=True)


# --------------------------------------------------------------------------------------------
# the adjoint pair
# --------------------------------------------------------------------------------------------
def _gather_rows(x_TH: Tensor, token_N: Tensor, padded: bool) -> Tensor:
    if padded:  # padding rows point at token T: an appended zero row
        x_TH = torch.cat([x_TH, x_TH.new_zeros((1, *x_TH.shape[1:]))])
    return x_TH.index_select(0, token_N)


def _row_of_slot(slot_N: Tensor, num_rows: int, num_tokens: int, topk: int,
                 padded: bool) -> tuple[Tensor, Tensor | None]:
    """Invert the row map: [T*K] row of each copy slot (0 where none) and the mask of slots that have one.

    Each real row owns a distinct slot; padding rows all hit the sink slot T*K, which is dropped.
    The mask is None when every slot has a row (dropless, nothing padded).
    """
    T, K, N = num_tokens, topk, num_rows
    arange_N = torch.arange(N, device=slot_N.device)
    if not padded and N == T * K:
        return torch.empty_like(slot_N).scatter_(0, slot_N, arange_N), None
    row_of_slot = torch.full((T * K + 1,), N, dtype=torch.long, device=slot_N.device)
    row_of_slot = row_of_slot.scatter_(0, slot_N, arange_N)[:T * K]
    valid = row_of_slot < N
    return row_of_slot.masked_fill(~valid, 0), valid


def _sum_copies(rows_NH: Tensor, slot_N: Tensor, num_tokens: int, topk: int, padded: bool,
                weights_TK: Tensor | None = None) -> Tensor:
    """y[t] = sum_k w[t, k] * rows[row of slot (t, k)] (w = 1 without weights), a slot without a row
    adding zero. Deterministic.

    ``embedding_bag`` gathers and sums each token's K rows in one pass, weighting each by its
    ``per_sample_weights`` (no scatter-add, no [T*K, H] intermediate).
    """
    T, K, N = num_tokens, topk, rows_NH.shape[0]
    rest = rows_NH.shape[1:]
    if T * K == 0 or N == 0:
        return rows_NH.new_zeros((T, *rest))
    rows_2d = rows_NH.reshape(N, -1)
    row_of_slot, valid = _row_of_slot(slot_N, N, T, K, padded)
    w = None if weights_TK is None else weights_TK.reshape(-1).to(rows_2d.dtype)
    if valid is not None:
        w = valid.to(rows_2d.dtype) if w is None else w.masked_fill(~valid, 0)
    y = F.embedding_bag(row_of_slot.view(T, K), rows_2d, mode="sum",
                        per_sample_weights=None if w is None else w.view(T, K))
    return y.view(T, *rest)


class _Permute(torch.autograd.Function):
    """Forward: rows = x[token_of_row]. Backward: sum each token's copies of the row gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, token_N: Tensor, slot_N: Tensor, topk: int, padded: bool) -> Tensor:
        ctx.save_for_backward(slot_N)
        ctx.num_tokens, ctx.topk, ctx.padded = x.shape[0], topk, padded
        return _gather_rows(x, token_N, padded)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (slot_N,) = ctx.saved_tensors
        return _sum_copies(grad.contiguous(), slot_N, ctx.num_tokens, ctx.topk, ctx.padded), None, None, None, None


class _Unpermute(torch.autograd.Function):
    """Forward: y[t] = sum over t's dispatched copies of their rows. Backward: gather rows."""

    @staticmethod
    def forward(ctx, rows: Tensor, token_N: Tensor, slot_N: Tensor, num_tokens: int, topk: int,
                padded: bool) -> Tensor:
        ctx.save_for_backward(token_N)
        ctx.padded = padded
        return _sum_copies(rows.contiguous(), slot_N, num_tokens, topk, padded)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (token_N,) = ctx.saved_tensors
        return _gather_rows(grad.contiguous(), token_N, ctx.padded), None, None, None, None, None


def _row_dots(a_NH: Tensor, b_NH: Tensor, block_elems: int = 2**20) -> Tensor:
    """[N] fp32 dot product of each row pair (products in the rows' dtype, sums in fp32).

    In blocks of about a million elements: the [N, H] product then never exists at once (on CPU a
    buffer that large is a fresh mmap, page-faulted on every call; the blocks reuse cached memory).
    """
    a, b = a_NH.flatten(1), b_NH.flatten(1)
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    rows = max(1, block_elems // max(1, a.shape[1]))
    for i in range(0, a.shape[0], rows):
        torch.sum(a[i:i + rows] * b[i:i + rows], -1, dtype=torch.float32, out=out[i:i + rows])
    return out


class _WeightedUnpermute(torch.autograd.Function):
    """Forward: y[t] = sum_k p[t, k] * (row of copy (t, k)), on the tokens' home rank.

    Backward: each row's gradient is its token's gradient times the row's prob, and each prob's
    gradient the dot product of its token's gradient with the row (the expert output that came
    back): both from one gather of the token gradients. Saves the rows (needed for the probs'
    gradient) and the probs.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, probs_TK: Tensor, token_N: Tensor, slot_N: Tensor, padded: bool) -> Tensor:
        ctx.save_for_backward(rows, probs_TK, token_N, slot_N)
        ctx.padded = padded
        T, K = probs_TK.shape
        return _sum_copies(rows.contiguous(), slot_N, T, K, padded, probs_TK)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, probs_TK, token_N, slot_N = ctx.saved_tensors
        T, K = probs_TK.shape
        g_rows = _gather_rows(grad.contiguous(), token_N, ctx.padded)  # [N, H]: each row's token gradient
        grad_probs = None
        if ctx.needs_input_grad[1]:
            dots_N = _row_dots(g_rows, rows)
            # padding rows all write the sink slot T*K, which is dropped
            grad_probs = dots_N.new_zeros(T * K + 1).scatter_(0, slot_N, dots_N)[:T * K]
            grad_probs = grad_probs.view(T, K).to(probs_TK.dtype)
        grad_rows = None
        if ctx.needs_input_grad[0]:
            p_N = _probs_of_rows(probs_TK, slot_N, ctx.padded)
            grad_rows = g_rows.mul_(p_N.to(g_rows.dtype).view(-1, *([1] * (g_rows.dim() - 1))))
        return grad_rows, grad_probs, None, None, None


def permute(x_TH: Tensor, row_map: RowMap) -> Tensor:
    """[T, H] tokens -> [N, H] expert-major rows (zero rows for padding). Local, no communication."""
    if x_TH.shape[0] != row_map.num_tokens:
        raise ValueError(f"permute: x has {x_TH.shape[0]} tokens but the row map was built for {row_map.num_tokens}")
    return _Permute.apply(x_TH, row_map.token_of_row_N, row_map.slot_of_row_N, row_map.topk, row_map.padded)


def unpermute(rows_NH: Tensor, row_map: RowMap, probs_TK: Tensor | None = None) -> Tensor:
    """[N, H] rows -> [T, H]: each token's copies summed, weighted by ``probs_TK`` [T, K] when given.

    Copies not dispatched (dropped, or padding rows) add zero. With ``probs_TK`` the weights are
    applied here, on the rank that holds them, and their gradient is computed from the rows.
    """
    if rows_NH.shape[0] != row_map.num_rows:
        raise ValueError(f"unpermute: got {rows_NH.shape[0]} rows but the row map has {row_map.num_rows}")
    if probs_TK is None:
        return _Unpermute.apply(rows_NH, row_map.token_of_row_N, row_map.slot_of_row_N, row_map.num_tokens,
                                row_map.topk, row_map.padded)
    if tuple(probs_TK.shape) != (row_map.num_tokens, row_map.topk):
        raise ValueError(f"unpermute: probs have shape {tuple(probs_TK.shape)}, the row map is for "
                         f"[{row_map.num_tokens}, {row_map.topk}] copies")
    return _WeightedUnpermute.apply(rows_NH, probs_TK, row_map.token_of_row_N, row_map.slot_of_row_N,
                                    row_map.padded)


def _probs_of_rows(probs_TK: Tensor, slot_N: Tensor, padded: bool) -> Tensor:
    """[T, K] probs -> [N] prob of each row given its copy slot (0 for padding rows)."""
    flat = probs_TK.reshape(-1)
    if padded:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat.index_select(0, slot_N)


# --------------------------------------------------------------------------------------------
# chunk regrouping
# --------------------------------------------------------------------------------------------
def chunk_sort_index(counts_AB: Tensor, num_rows: int) -> Tensor:
    """[num_rows] gather index taking rows stored as [A x B] chunks to [B x A] chunk order.

    ``counts_AB[a, b]`` is the size of chunk (a, b); ``num_rows`` its (host-known) total, so no
    device->host sync is needed.
    """
    A, B = counts_AB.shape
    counts_AB = counts_AB.long()
    flat = counts_AB.reshape(-1)
    starts_old = (torch.cumsum(flat, 0) - flat).view(A, B).t().reshape(-1)
    counts_BA = counts_AB.t().reshape(-1)
    starts_new = torch.cumsum(counts_BA, 0) - counts_BA
    offset = torch.repeat_interleave(starts_old - starts_new, counts_BA, output_size=num_rows)
    return torch.arange(num_rows, device=counts_AB.device) + offset


def sort_chunks(x_NH: Tensor, counts_AB: Tensor) -> Tensor:
    """Regroup rows stored as [A x B] chunks (chunk sizes ``counts_AB`` [A, B]) into [B x A] order.

    The inverse is ``sort_chunks(y, counts_AB.t())``. Empty chunks, and N = 0, are fine.
    Autograd: the backward is the inverse regrouping.
    """
    if counts_AB.dim() != 2:
        raise ValueError(f"sort_chunks: counts must be [A, B], got shape {tuple(counts_AB.shape)}")
    if counts_AB.shape[0] == 1 or counts_AB.shape[1] == 1:
        return x_NH
    return x_NH.index_select(0, chunk_sort_index(counts_AB.to(x_NH.device), x_NH.shape[0]))
