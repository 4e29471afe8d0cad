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
``permute_probs`` lays the routing probs out as the rows (the experts weight each row by its prob
inside their activation, ``moe.activation``, as Megatron-Core 0.16.1 does), so ``unpermute`` is the
combine's plain sum of each token's returned copies: nothing of the rows is kept for backward (its
backward gathers the token gradients), where weighting in the combine kept the rows [N, H] for the
probs' gradient.

An fp32 island of the bf16 path (``combine_dtype``): a token's copies are summed in fp32, and ``unpermute``
returns that fp32 sum for bf16/fp16 rows (the MoE layer rounds once, after adding the shared experts; the
allgather dispatcher reduce-scatters it in fp32 first). Megatron-Core 0.16.1's fused unpermute (TE's
``moe_unpermute``, ``--moe-permute-fusion``) accumulates a token's copies in fp32 as well, and it
reduce-scatters the combine's partial sums in the probs' fp32 (``token_dispatcher.py``:
``hidden_states.to(self.probs.dtype)``). The gradients of a token's copies in the permute's backward are
summed in fp32 too. fp32 rows take one ``embedding_bag`` pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.dense.workspace import workspace


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
    out = workspace(x_TH.device).empty((token_N.shape[0], *x_TH.shape[1:]), x_TH.dtype)   # reused on a CPU
    return torch.index_select(x_TH, 0, token_N, out=out)


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


def combine_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a token's copies are weighted and summed in: fp32 for bf16/fp16 rows (the fp32 island of the
    combine, see the module docstring), the rows' own dtype when that is fp32 or wider."""
    return torch.promote_types(dtype, torch.float32)


# Low-precision rows are upcast a block at a time, through workspaces allocated once per call and reused by every
# block, so no fp32 copy of all N rows is made. On a CPU the reuse is what matters: a fresh buffer above glibc's mmap
# threshold is a fresh mapping, page-faulted on every call (bf16, T 4096, K 8, H 512, one thread: the combine's
# forward 56 ms in one 2**24-element block, 9 ms in reused 2**20-element workspaces; with its backward and the
# permute's, 202 ms profiled with a fresh fp32 tensor per block, 81 ms reused; 2**16-2**19 element blocks were no
# faster). On a GPU a block only costs kernel launches (128 blocks of five kernels each at Qwen3-30B-A3B's shape kept
# the H200 waiting on the host: 25 ms a layer against 14.5 in one block): 2**24 elements (the forward, 64 MiB fp32)
# there. Blocks and workspaces never change a bit of the result.
# The call's large outputs (the permuted rows, the row gradients, the fp32 sums) come from ``dense.workspace``'s pool,
# reused by the next call on a CPU (a fresh [N, H] output above glibc's 32 MiB mmap ceiling is page-faulted on every
# call: bf16 layer at E64/E256 k8 ~10% faster). The block workspaces do not: they live for one call only, and at
# 2-4 MiB glibc's heap already reuses them; pooled, they would stay held as free buffers through the rest of the
# backward, raising the process's real peak (the pool's free buffers count: ``training.observe.memory``).
_COMBINE_BLOCK_ELEMS_CPU = 2**20
_COMBINE_BLOCK_ELEMS_GPU = 2**24


def combine_block_elems(device: torch.device) -> int:
    """Elements per block of ``_sum_copies`` for low-precision rows on ``device``. Blocks never change the result:
    every token is computed on its own."""
    return _COMBINE_BLOCK_ELEMS_CPU if device.type == "cpu" else _COMBINE_BLOCK_ELEMS_GPU


def _sum_copies(rows_NH: Tensor, slot_N: Tensor, num_tokens: int, topk: int, padded: bool) -> Tensor:
    """y[t] = sum_k rows[row of slot (t, k)], a slot without a row adding zero, in ``combine_dtype(rows.dtype)``.
    Deterministic.

    Rows in that dtype already: one ``embedding_bag`` pass gathers and sums each token's K rows (slots without a
    row masked by a zero ``per_sample_weights``; no scatter-add, no [T*K, H] intermediate). Lower-precision rows:
    each block of tokens' K rows is gathered, upcast and reduced by one batched ``[1, K] x [K, H]`` product with
    the fp32 mask (ones where every slot has a row).
    """
    T, K, N = num_tokens, topk, rows_NH.shape[0]
    rest = rows_NH.shape[1:]
    acc = combine_dtype(rows_NH.dtype)
    if T * K == 0 or N == 0:
        return rows_NH.new_zeros((T, *rest), dtype=acc)
    rows_2d = rows_NH.reshape(N, -1)
    row_of_slot, valid = _row_of_slot(slot_N, N, T, K, padded)
    w = None if valid is None else valid.to(acc)
    if rows_2d.dtype == acc:
        y = F.embedding_bag(row_of_slot.view(T, K), rows_2d, mode="sum",
                            per_sample_weights=None if w is None else w.view(T, K))
        return y.view(T, *rest)
    D = rows_2d.shape[1]
    rows_of_token = row_of_slot.view(T, K)
    w_TK = torch.ones(T, K, dtype=acc, device=rows_2d.device) if w is None else w.view(T, K)
    y = workspace(rows_2d.device).empty((T, D), acc)
    step = min(T, max(1, combine_block_elems(rows_2d.device) // max(1, K * D)))
    picked = rows_2d.new_empty((step * K, D))                                    # one block's copies, reused
    wide = torch.empty((step * K, D), dtype=acc, device=rows_2d.device)          # ... and upcast
    for t in range(0, T, step):
        n = min(step, T - t)
        torch.index_select(rows_2d, 0, rows_of_token[t:t + n].reshape(-1), out=picked[:n * K])
        copies = wide[:n * K].copy_(picked[:n * K]).view(n, K, D)
        torch.bmm(w_TK[t:t + n].unsqueeze(1), copies, out=y[t:t + n].unsqueeze(1))
    return y.view(T, *rest)


class _Permute(torch.autograd.Function):
    """Forward: rows = x[token_of_row]. Backward: sum each token's copies of the row gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, token_N: Tensor, slot_N: Tensor, topk: int, padded: bool) -> Tensor:
        ctx.save_for_backward(slot_N)
        ctx.num_tokens, ctx.topk, ctx.padded, ctx.x_dtype = x.shape[0], topk, padded, x.dtype
        return _gather_rows(x, token_N, padded)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (slot_N,) = ctx.saved_tensors
        # the K copies' gradients add up in fp32 (combine_dtype), rounded once to the token's dtype
        grad_x = _sum_copies(grad.contiguous(), slot_N, ctx.num_tokens, ctx.topk, ctx.padded).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class _Unpermute(torch.autograd.Function):
    """Forward: y[t] = sum over t's dispatched copies of their rows (in ``combine_dtype``). Backward: gather rows."""

    @staticmethod
    def forward(ctx, rows: Tensor, token_N: Tensor, slot_N: Tensor, num_tokens: int, topk: int,
                padded: bool) -> Tensor:
        ctx.save_for_backward(token_N)
        ctx.padded, ctx.rows_dtype = padded, rows.dtype
        return _sum_copies(rows.contiguous(), slot_N, num_tokens, topk, padded)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (token_N,) = ctx.saved_tensors
        # rounded to the rows' dtype before the gather (the same values): no [N, H] copy in the sum's fp32
        return _gather_rows(grad.to(ctx.rows_dtype).contiguous(), token_N, ctx.padded), None, None, None, None, None


def permute(x_TH: Tensor, row_map: RowMap) -> Tensor:
    """[T, H] tokens -> [N, H] expert-major rows (zero rows for padding). Local, no communication."""
    if x_TH.shape[0] != row_map.num_tokens:
        raise ValueError(f"permute: x has {x_TH.shape[0]} tokens but the row map was built for {row_map.num_tokens}")
    return _Permute.apply(x_TH, row_map.token_of_row_N, row_map.slot_of_row_N, row_map.topk, row_map.padded)


def unpermute(rows_NH: Tensor, row_map: RowMap) -> Tensor:
    """[N, H] rows -> [T, H] in ``combine_dtype(rows.dtype)`` (fp32 for bf16 rows): each token's copies summed.

    The rows come back weighted already (the experts apply the routing probs inside their activation,
    ``moe.activation``); copies not dispatched (dropped, or padding rows) add zero.
    """
    if rows_NH.shape[0] != row_map.num_rows:
        raise ValueError(f"unpermute: got {rows_NH.shape[0]} rows but the row map has {row_map.num_rows}")
    return _Unpermute.apply(rows_NH, row_map.token_of_row_N, row_map.slot_of_row_N, row_map.num_tokens,
                            row_map.topk, row_map.padded)


def permute_probs(probs_TK: Tensor, row_map: RowMap) -> Tensor:
    """[T, K] routing probs -> [N] prob of each dispatched row (0 for padding rows), in the probs' dtype, with
    autograd (backward: each row's gradient back to its copy slot; padding rows' to a dropped sink). Local."""
    if tuple(probs_TK.shape) != (row_map.num_tokens, row_map.topk):
        raise ValueError(f"permute_probs: probs have shape {tuple(probs_TK.shape)}, the row map is for "
                         f"[{row_map.num_tokens}, {row_map.topk}] copies")
    return _probs_of_rows(probs_TK, row_map.slot_of_row_N, row_map.padded)


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
