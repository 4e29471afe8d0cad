"""Fused context-parallel attention: a flash kernel per block, blocks merged by log-sum-exp, hidden blocks skipped.

Layout (``dense.context_parallel``): the sequence is cut into ``2*cp`` chunks of ``c`` tokens and CP
rank r holds chunks r and ``2cp-1-r`` (its local rows ``[0, c)`` and ``[c, 2c)``). The causal mask
and the sliding window depend only on chunk indices, so which (query chunk, key chunk) pairs are
visible is known on the host from (rank, cp, c, window): no mask tensor, no position comparison, no
host synchronisation. ``chunk_pair`` classifies one pair:

- fully hidden (key chunk after the query chunk, or every key beyond the window): skipped;
- fully visible: a full block, no mask;
- the diagonal (same chunk): causal (``is_causal``), banded too when the window is shorter than a chunk;
- crossing the window boundary: a band, trimmed to the rows and columns that see a key.

p2p ring (the scheme of Megatron / Transformer Engine's ``AttnFuncWithCPAndKVP2P``): under a plain
causal mask every ring step is one kernel call. Step 0 (own K/V): one causal call over ``[2c, 2c]``
(local order is sequence order). K/V from a rank j < r: all 2c queries against the block's first
chunk (chunk j; its second chunk is in the future). From j > r: the second query chunk against the
whole block (the first query chunk sees neither). Full pairs are merged into one call; window pairs
get their own. all_gather mode: the gathered K/V are put in sequence order, so each query chunk needs
one call for its full key chunks (contiguous), one for its diagonal and, with a window, at most two
for the chunks that cross the window boundary. Masks exist only for those boundary blocks, and only
on kernels without window arguments (the CPU kernel and CUDA's memory-efficient one).

Backward is fused per block: each call's flash backward runs with the merged output and log-sum-exp
of its rows and returns exactly its share of dq, dk, dv. In p2p mode the dK/dV accumulators travel
round the ring with their K/V block, and one last shift brings each home (as in the math path).

The fused path derives visibility from the layout, not from ``q_pos``: the token positions must be the
load-balanced ones (``context_parallel_positions``, what the model uses; RoPE reads position_ids).
Head dims are zero-padded once, before anything crosses ranks, to what the kernel computes with (MLA's
narrower v to the q/k head dim where the kernel needs one head dim), and the output sliced back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from moefold.dense.attention_kernels import (
    CAUSAL,
    FULL,
    AttentionKernel,
    Window,
    attention_kernel,
    merge_block,
    merge_sinks,
    pad_head_dims,
    sinks_grad,
)
from moefold.dense.cp_exchange import PendingShift, rank_order_to_global, ring_shift
from moefold.parallel.comm import all_gather_sequence
from moefold.parallel.groups import Group, group_rank, group_size


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` of the K/V in hand, in every batch row
    or (``batch``) in that one only (documents differ between samples: ``dense.document_attention``)."""

    q0: int
    q1: int
    k0: int
    k1: int
    window: Window
    batch: int | None = None

    @property
    def rows(self) -> slice:
        """The batch rows of the call."""
        return slice(None) if self.batch is None else slice(self.batch, self.batch + 1)

    def shifted(self, rows: int, cols: int) -> BlockCall:
        return replace(self, q0=self.q0 + rows, q1=self.q1 + rows, k0=self.k0 + cols, k1=self.k1 + cols)


def chunk_pair(a: int, b: int, c: int, window: int | None) -> BlockCall | None:
    """How query chunk ``a`` sees key chunk ``b`` (chunks of ``c`` tokens in sequence order) under the
    causal mask and the sliding ``window`` (``0 <= q_pos - k_pos < window``); coordinates within the
    two chunks. None when no query of the chunk sees any key of the other."""
    offset = (a - b) * c
    lo, hi = offset - (c - 1), offset + (c - 1)  # the range of q_pos - k_pos over the pair
    if hi < 0 or (window is not None and lo >= window):
        return None
    if lo >= 0 and (window is None or hi < window):
        return BlockCall(0, c, 0, c, FULL)
    if a == b:
        return BlockCall(0, c, 0, c, CAUSAL if window is None or window >= c else Window(window - 1, 0))
    # a > b and the window boundary crosses the pair: query i sees key j iff j >= i + m
    m = offset - window + 1
    if m <= 0:
        return BlockCall(0, c, 0, c, Window(-m, None))
    # rows i >= c - m see nothing; keys j < m are seen by no row: trim both
    return BlockCall(0, c - m, m, c, Window(0, None))


@functools.lru_cache(maxsize=4096)
def ring_step_calls(rank: int, src: int, cp: int, c: int, window: int | None) -> tuple[BlockCall, ...]:
    """The kernel calls of CP rank ``rank`` for the K/V block of rank ``src`` (p2p ring step
    ``(rank - src) % cp``). Rows index the local queries ``[2c]``, columns the block ``[2c]``."""
    q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    pairs = {(qi, ki): chunk_pair(q_chunks[qi], k_chunks[ki], c, window) for qi in (0, 1) for ki in (0, 1)}
    if _is_causal_square(pairs):
        return (BlockCall(0, 2 * c, 0, 2 * c, CAUSAL),)
    visible = {key: p for key, p in pairs.items() if p is not None}
    full = sorted(key for key, p in visible.items() if p.window.is_full)
    calls = []
    rows, cols = sorted({qi for qi, _ in full}), sorted({ki for _, ki in full})
    if full and len(full) == len(rows) * len(cols):  # the full pairs form a rectangle: one call
        calls.append(BlockCall(rows[0] * c, (rows[-1] + 1) * c, cols[0] * c, (cols[-1] + 1) * c, FULL))
        visible = {key: p for key, p in visible.items() if key not in full}
    calls += [p.shifted(qi * c, ki * c) for (qi, ki), p in sorted(visible.items())]
    return tuple(calls)


def _is_causal_square(pairs: dict[tuple[int, int], BlockCall | None]) -> bool:
    """Own block under a plain causal mask (diagonal pairs causal, the first query chunk blind to the second
    key chunk, the second query chunk seeing all of the first): local order is sequence order, so one causal
    call over both chunks computes exactly these pairs."""
    diagonal = [pairs[(0, 0)], pairs[(1, 1)]]
    return (all(p is not None and p.window == CAUSAL for p in diagonal) and pairs[(0, 1)] is None
            and pairs[(1, 0)] is not None and pairs[(1, 0)].window.is_full)


@functools.lru_cache(maxsize=4096)
def all_gather_calls(rank: int, cp: int, c: int, window: int | None) -> tuple[BlockCall, ...]:
    """The kernel calls of CP rank ``rank`` against the all-gathered K/V in sequence order ``[2*cp*c]``."""
    calls = []
    for qi, a in enumerate((rank, 2 * cp - 1 - rank)):
        pairs = [(b, chunk_pair(a, b, c, window)) for b in range(a + 1)]
        full = [b for b, p in pairs if p is not None and p.window.is_full]
        if full:
            # q_pos - k_pos grows with the distance, so the full chunks are consecutive
            assert full == list(range(full[0], full[-1] + 1)), full
            calls.append(BlockCall(qi * c, (qi + 1) * c, full[0] * c, (full[-1] + 1) * c, FULL))
        calls += [p.shifted(qi * c, b * c) for b, p in pairs if p is not None and not p.window.is_full]
    return tuple(calls)


# --------------------------------------------------------------------------------------------
# running the calls
# --------------------------------------------------------------------------------------------
def _accumulation_dtype(q: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (the kernels' own log-sum-exp dtype), float64 for float64 ones (the exact
    references tests compare fp32 runs with)."""
    return torch.promote_types(q.dtype, torch.float32)


def _accumulators(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Output ``[B, h, Sq, Dv]`` (zeros) and log-sum-exp ``[B, h, Sq]`` (-inf), in the accumulation dtype."""
    B, h, Sq = q.shape[:3]
    acc = _accumulation_dtype(q)
    out = torch.zeros(B, h, Sq, v.shape[-1], dtype=acc, device=q.device)
    return out, torch.full((B, h, Sq), float("-inf"), dtype=acc, device=q.device)


def _attend(q: Tensor, k: Tensor, v: Tensor, calls: tuple[BlockCall, ...], kernel: AttentionKernel, scale: float,
            out: Tensor, lse: Tensor) -> None:
    for call in calls:
        b, rows, cols = call.rows, slice(call.q0, call.q1), slice(call.k0, call.k1)
        block_out, block_lse = kernel.forward(q[b, :, rows], k[b, :, cols], v[b, :, cols], call.window, scale)
        merge_block(out, lse, rows, block_out, block_lse, batch=b)


def _attend_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     calls: tuple[BlockCall, ...], kernel: AttentionKernel, scale: float,
                     dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Add every call's share of the gradients to the fp32 accumulators ``dq``, ``dk``, ``dv``."""
    for call in calls:
        b, rows, cols = call.rows, slice(call.q0, call.q1), slice(call.k0, call.k1)
        gq, gk, gv = kernel.backward(grad_out[b, :, rows], q[b, :, rows], k[b, :, cols], v[b, :, cols],
                                     out[b, :, rows], lse[b, :, rows], call.window, scale)
        dq[b, :, rows] += gq
        dk[b, :, cols] += gk
        dv[b, :, cols] += gv


class _FusedRing(torch.autograd.Function):
    """p2p ring, fused per block. Saves q, k, v, the output (q's dtype) and the fp32 log-sum-exp.
    ``step_calls[s]``: the calls of ring step s (the K/V block of rank ``(me - s) % cp``).
    ``sinks [h]`` (or None): attention sinks, merged once after the last block (``merge_sinks``)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: Group, scale: float,
                step_calls: tuple[tuple[BlockCall, ...], ...], kernel: AttentionKernel,
                sinks: Tensor | None = None) -> Tensor:
        n = group_size(group)
        out, lse = _accumulators(q, v)
        kv = (k, v)
        for step in range(n):
            pending = PendingShift()
            nxt = ring_shift(kv, group, pending) if step + 1 < n else None  # in flight while this block computes
            _attend(q, *kv, step_calls[step], kernel, scale, out, lse)
            pending.wait()
            kv = nxt
        if sinks is not None:
            merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.step_calls, ctx.kernel = group, scale, step_calls, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, scale, step_calls, kernel = ctx.group, ctx.scale, ctx.step_calls, ctx.kernel
        n = group_size(group)
        acc = _accumulation_dtype(q)
        dq = torch.zeros_like(q, dtype=acc)
        kv = (k, v)
        dkv = (torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
        for step in range(n):
            kv_pending = PendingShift()
            nxt = ring_shift(kv, group, kv_pending) if step + 1 < n else None
            _attend_backward(grad_out, q, *kv, out, lse, step_calls[step], kernel, scale, dq, *dkv)
            # the accumulator follows its block to the next rank; after the last step, to its owner
            acc_pending = PendingShift()
            dkv = tuple(ring_shift(dkv, group, acc_pending, first_tag=2))
            acc_pending.wait()
            kv_pending.wait()
            kv = nxt
        d_sinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, d_sinks


class _FusedBlocks(torch.autograd.Function):
    """Local queries against K/V in hand (all_gather mode), as a fixed list of fused calls."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, calls: tuple[BlockCall, ...], scale: float,
                kernel: AttentionKernel, sinks: Tensor | None = None) -> Tensor:
        out, lse = _accumulators(q, v)
        _attend(q, k, v, calls, kernel, scale, out, lse)
        if sinks is not None:
            merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.calls, ctx.scale, ctx.kernel = calls, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = [torch.zeros_like(t, dtype=_accumulation_dtype(q)) for t in (q, k, v)]
        _attend_backward(grad_out, q, k, v, out, lse, ctx.calls, ctx.kernel, ctx.scale, *grads)
        d_sinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks).to(sinks.dtype)
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), None, None, None, d_sinks


def _prepare(q: Tensor, k: Tensor, v: Tensor) -> tuple[AttentionKernel, Tensor, Tensor, Tensor]:
    if q.shape[2] % 2 != 0 or k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"context-parallel attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must hold the same two sequence chunks (an even local length)")
    kernel = attention_kernel(q.device.type, q.dtype, max(q.shape[-1], v.shape[-1]))
    return (kernel, *pad_head_dims(q, k, v, kernel))


def fused_ring_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, scale: float,
                         sliding_window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """p2p ring CP attention with fused kernels. q ``[B, h, 2c, d]``, k ``[B, g, 2c, d]``, v ``[B, g, 2c, dv]``
    (this rank's chunks r and 2cp-1-r) -> ``[B, h, 2c, dv]``. ``q_pos`` is not read (see the module docstring).
    ``sinks [h]``: attention sinks (a partial gradient over cp, like every weight's).
    Crosses ranks: K/V blocks point-to-point (forward; backward with their gradient accumulators)."""
    d_v = v.shape[-1]
    kernel, q, k, v = _prepare(q, k, v)
    n, me, c = group_size(cp_group), group_rank(cp_group), q.shape[2] // 2
    step_calls = tuple(ring_step_calls(me, (me - step) % n, n, c, sliding_window) for step in range(n))
    return ring_attention_blocks(q, k, v, cp_group, step_calls, kernel, scale, sinks)[..., :d_v]


def ring_attention_blocks(q: Tensor, k: Tensor, v: Tensor, cp_group: Group,
                          step_calls: tuple[tuple[BlockCall, ...], ...], kernel: AttentionKernel, scale: float,
                          sinks: Tensor | None = None) -> Tensor:
    """The p2p ring over given calls (``step_calls[s]``: those of ring step s), head dims already padded for
    ``kernel``. Shapes and what crosses ranks as ``fused_ring_attention``."""
    return _FusedRing.apply(q, k, v, cp_group, scale, step_calls, kernel, sinks)


def blocks_attention(q: Tensor, k: Tensor, v: Tensor, calls: tuple[BlockCall, ...], kernel: AttentionKernel,
                     scale: float, sinks: Tensor | None = None) -> Tensor:
    """Local queries against the K/V in hand as the given calls, head dims already padded for ``kernel``.
    Nothing crosses ranks."""
    return _FusedBlocks.apply(q, k, v, calls, scale, kernel, sinks)


def fused_all_gather_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, scale: float,
                               sliding_window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """all_gather CP attention with fused kernels; shapes as ``fused_ring_attention``. Crosses ranks: K/V
    (all-gather; backward reduce-scatter of their gradients)."""
    d_v = v.shape[-1]
    kernel, q, k, v = _prepare(q, k, v)
    cp = group_size(cp_group)
    k_all, v_all = (rank_order_to_global(all_gather_sequence(t, cp_group, dim=2), cp, 2) for t in (k, v))
    calls = all_gather_calls(group_rank(cp_group), cp, q.shape[2] // 2, sliding_window)
    return _FusedBlocks.apply(q, k_all, v_all, calls, scale, kernel, sinks)[..., :d_v]


def fused_local_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, sliding_window: int | None = None,
                          sinks: Tensor | None = None) -> Tensor:
    """Causal (optionally windowed) attention over this rank's whole sequence as one fused kernel call with its
    log-sum-exp, so that ``sinks [h]`` merge into it (what SDPA cannot: it returns no log-sum-exp). Shapes as
    ``core_attention.local_attention``. Nothing crosses ranks."""
    S, d_v = q.shape[2], v.shape[-1]
    kernel = attention_kernel(q.device.type, q.dtype, max(q.shape[-1], d_v))
    q, k, v = pad_head_dims(q, k, v, kernel)
    window = CAUSAL if sliding_window is None or sliding_window >= S else Window(sliding_window - 1, 0)
    return _FusedBlocks.apply(q, k, v, (BlockCall(0, S, 0, S, window),), scale, kernel, sinks)[..., :d_v]
