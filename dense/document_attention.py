"""Attention inside documents: the kernel calls of packed samples, planned on the host from where documents start.

Each query token sees the earlier tokens of its own document (and, with a sliding window, only the last
``window`` of them). No ``[S, S]`` mask exists: the visible keys of a run of queries are planned as kernel calls
(``cp_fused.BlockCall``, one batch row each) of three kinds, all from global positions:

- the diagonal: a tile of queries against the same tokens as keys, causal (``is_causal``: no mask), or banded when
  the window is shorter than the tile;
- the keys before the tile inside its document: one full block (no mask) where every query sees every key, or a
  band trimmed to the rows and columns that see a key, where the window's edge crosses it.

Without a window a document's queries are one tile; with one, tiles of ``max(window, TILE)`` tokens keep every
masked band at most ``tile x window``, so memory grows linearly with the sequence. The calls run through the fused
block kernels of ``dense.attention_kernels`` (flash forward and backward with the log-sum-exp, merged per row as
context parallelism merges its blocks; attention sinks merge after the last block), so MLA's head dims, GQA and
sinks work as on the other paths.

Context parallelism: this rank's queries are its two load-balanced chunks (``dense.context_parallel``); every rank
plans from the whole sample's document starts. ``all_gather`` puts the gathered K/V in sequence order and plans
against it; ``p2p`` plans each ring step against the two chunks of the K/V block in hand (``cp_fused``'s ring, its
backward and gradient shifts unchanged). Tensors in SDPA layout ``[B, heads, S, dim]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.dense.attention_kernels import CAUSAL, FULL, Window, attention_kernel, pad_head_dims
from moefold.dense.choices import CPComm
from moefold.dense.cp_exchange import rank_order_to_global
from moefold.dense.cp_fused import BlockCall, blocks_attention, ring_attention_blocks
from moefold.dense.documents import Documents
from moefold.parallel.comm import all_gather_sequence
from moefold.parallel.groups import Group, group_rank, group_size

TILE = 128   # the smallest query tile under a sliding window (fewer, larger calls; masks stay tile x window)


@dataclass(frozen=True)
class Span:
    """Tokens held contiguously: global positions ``[start, start + length)`` at local rows ``[row, row + length)``."""

    start: int
    row: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def layout_spans(rank: int, cp: int, seq_length: int) -> tuple[Span, ...]:
    """The spans CP rank ``rank`` holds: the whole sequence, or its chunks ``rank`` and ``2cp-1-rank``."""
    if cp == 1:
        return (Span(0, 0, seq_length),)
    c = seq_length // (2 * cp)
    return Span(rank * c, 0, c), Span((2 * cp - 1 - rank) * c, c, c)


def diagonal_call(a0: int, a1: int, hi: int | None, q_row: int, k_row: int, batch: int) -> BlockCall:
    """Queries ``[a0, a1)`` against the same tokens as keys: causal, banded when ``hi = window - 1`` is shorter."""
    window = CAUSAL if hi is None or hi >= a1 - a0 - 1 else Window(hi, 0)
    return BlockCall(q_row, q_row + a1 - a0, k_row, k_row + a1 - a0, window, batch)


def earlier_call(a0: int, a1: int, k0: int, k1: int, hi: int | None, q_row: int, k_row: int,
                 batch: int) -> BlockCall | None:
    """Queries ``[a0, a1)`` against earlier keys ``[k0, k1)`` (``k1 <= a0``), key k visible to query q iff
    ``q - k <= hi`` (None: always). None when no query sees any key; rows and columns that see nothing trimmed."""
    if hi is None or a1 - 1 - k0 <= hi:
        return BlockCall(q_row, q_row + a1 - a0, k_row, k_row + k1 - k0, FULL, batch)
    if a0 - (k1 - 1) > hi:
        return None
    m, width = a0 - k0 - hi, k1 - k0       # row i sees column j iff j >= i + m
    rows = min(a1 - a0, width - m)         # row i sees a key iff i + m <= width - 1
    if m <= 0:
        return BlockCall(q_row, q_row + rows, k_row, k_row + width, Window(-m, None), batch)
    return BlockCall(q_row, q_row + rows, k_row + m, k_row + width, Window(0, None), batch)


def row_calls(starts: tuple[int, ...], seq_length: int, q_spans: tuple[Span, ...], k_spans: tuple[Span, ...],
              window: int | None, batch: int, tile: int = TILE) -> list[BlockCall]:
    """The calls of batch row ``batch`` (documents starting at ``starts``): the queries of ``q_spans`` against
    the keys of ``k_spans`` (spans are CP chunks or the whole sequence, so a query tile's own tokens lie in one
    key span or in none)."""
    hi = None if window is None else window - 1
    calls = []
    for qs in q_spans:
        for ds, de in zip(starts, (*starts[1:], seq_length)):
            p0, p1 = max(ds, qs.start), min(de, qs.end)
            step = p1 - p0 if hi is None else max(hi + 1, tile)
            for a0 in range(p0, p1, max(step, 1)):
                a1 = min(a0 + step, p1)
                q_row, first = qs.row + a0 - qs.start, ds if hi is None else max(ds, a0 - hi)
                for ks in k_spans:
                    if ks.start <= a0 < ks.end:
                        calls.append(diagonal_call(a0, a1, hi, q_row, ks.row + a0 - ks.start, batch))
                    k0, k1 = max(first, ks.start), min(a0, ks.end)
                    if k0 < k1:
                        call = earlier_call(a0, a1, k0, k1, hi, q_row, ks.row + k0 - ks.start, batch)
                        calls += [] if call is None else [call]
    return calls


@functools.lru_cache(maxsize=1024)
def document_calls(starts: tuple[tuple[int, ...], ...], seq_length: int, rank: int, cp: int, src: int | None,
                   window: int | None) -> tuple[BlockCall, ...]:
    """Every batch row's calls for CP rank ``rank``'s queries against the K/V of rank ``src`` (p2p ring) or, with
    ``src`` None, against the whole sequence in order (this rank's own at cp 1, the all-gathered K/V otherwise)."""
    q_spans = layout_spans(rank, cp, seq_length)
    if src is not None:
        k_spans = layout_spans(src, cp, seq_length)
    else:
        k_spans = q_spans if cp == 1 else (Span(0, 0, seq_length),)
    return tuple(call for b, row in enumerate(starts) for call in row_calls(row, seq_length, q_spans, k_spans,
                                                                             window, b))


@torch.compiler.disable   # host planning from the starts: under --compile a graph break, not a guard per batch
def document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Documents, cp_group: Group = None, *,
                       cp_comm: str = "p2p", scale: float, sliding_window: int | None = None,
                       sinks: Tensor | None = None) -> Tensor:
    """Causal attention inside the documents of each sample. q ``[B, h, S_local, d]``, k ``[B, g, S_local, d]``,
    v ``[B, g, S_local, dv]`` (this rank's tokens: the whole sample, or its CP chunks) -> ``[B, h, S_local, dv]``.
    ``sinks [h]``: attention sinks. Crosses ranks under CP: K/V as ``cp_comm`` says (all-gather with a
    reduce-scatter of their gradients, or the p2p ring)."""
    cp, rank, S = group_size(cp_group), group_rank(cp_group), documents.seq_length
    if q.shape[0] != documents.batch or q.shape[2] * cp != S:
        raise ValueError(f"document_attention: q {tuple(q.shape)} does not hold this rank's share of "
                         f"{documents.batch} samples of {S} tokens over cp={cp}")
    d_v = v.shape[-1]
    kernel = attention_kernel(q.device.type, q.dtype, max(q.shape[-1], d_v))
    q, k, v = pad_head_dims(q, k, v, kernel)
    if cp > 1 and CPComm(cp_comm) is CPComm.P2P:   # a CPComm (the configs'), or its word
        step_calls = tuple(document_calls(documents.starts, S, rank, cp, (rank - step) % cp, sliding_window)
                           for step in range(cp))
        return ring_attention_blocks(q, k, v, cp_group, step_calls, kernel, scale, sinks)[..., :d_v]
    if cp > 1:
        k, v = (rank_order_to_global(all_gather_sequence(t, cp_group, dim=2), cp, 2) for t in (k, v))
    calls = document_calls(documents.starts, S, rank, cp, None, sliding_window)
    return blocks_attention(q, k, v, calls, kernel, scale, sinks)[..., :d_v]
