"""Context parallelism (CP): the sequence split over the cp group, and attention across the split.

Load-balanced split: the sequence is cut into ``2*cp`` equal chunks and CP rank ``r`` keeps
chunks ``r`` and ``2*cp-1-r``, so under a causal mask every rank does the same amount of work.
A rank therefore holds non-contiguous tokens; every attention mask here is built from the
tokens' true global positions (``position_ids``), never from local indices, which also makes
sliding windows work unchanged.

Two exchange modes (``cp_comm``):

- ``all_gather``: K/V of every CP rank all-gathered along the sequence (backward: the K/V
  gradients reduce-scattered back), then this rank's queries attend to all keys through SDPA
  with a position mask. Simple, one collective, O(S) K/V memory per rank.
- ``p2p``: a ring. K/V blocks travel around the cp group with isend/irecv (one
  ``batch_isend_irecv`` per step, launched before the current block is computed so the
  transfer overlaps the math); each block's partial attention (output and log-sum-exp) is
  merged with a log-sum-exp rescale. One autograd function with a flash-style backward: only
  q, k, v, the output and the lse are saved; in backward the K/V blocks go around the ring
  again, each with its gradient accumulator, which a final shift returns to the block's owner.
  Blocks are computed in plain torch math (fp32 statistics), device-agnostic; O(S/cp) memory
  per rank plus one block of scores at a time.

Tensors here are in SDPA layout ``[B, heads, S, dim]``; K/V may have fewer heads than Q (GQA:
``heads_q % heads_kv == 0``, kv head j serving q heads ``j*rep .. (j+1)*rep-1``, as HF's
``repeat_kv``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moefold.parallel.comm import all_gather_sequence, gather_along_dim
from moefold.parallel.groups import Group, group_rank, group_ranks, group_size

CP_COMM_MODES = ("p2p", "all_gather")


# --------------------------------------------------------------------------------------------
# splitting a batch for CP
# --------------------------------------------------------------------------------------------
def check_context_parallel_seq_length(seq_length: int, cp: int) -> None:
    """Raise ValueError unless ``seq_length`` splits into ``2*cp`` equal chunks."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive integer")
    if cp > 1 and seq_length % (2 * cp) != 0:
        raise ValueError(f"sequence length {seq_length} is not divisible by 2*cp={2 * cp} "
                         f"(context parallelism cuts the sequence into 2*cp chunks); use a multiple of {2 * cp}")


def split_for_context_parallel(x: Tensor, cp_rank: int, cp: int, seq_dim: int = 0) -> Tensor:
    """This CP rank's part of ``x``: chunks ``cp_rank`` and ``2*cp-1-cp_rank`` of ``2*cp`` along
    ``seq_dim``, concatenated (a copy). ``[.., S, ..] -> [.., S/cp, ..]``. Nothing crosses ranks."""
    if cp == 1:
        return x
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp={cp})")
    check_context_parallel_seq_length(x.shape[seq_dim], cp)
    chunks = x.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=seq_dim)


def context_parallel_positions(seq_length: int, cp_rank: int, cp: int,
                               device: torch.device | str | None = None) -> Tensor:
    """Global positions (int64 ``[seq_length/cp]``) of the tokens CP rank ``cp_rank`` holds."""
    check_context_parallel_seq_length(seq_length, cp)
    return split_for_context_parallel(torch.arange(seq_length, device=device), cp_rank, cp, 0)


def gather_from_context_parallel(x: Tensor, cp_group: Group, seq_dim: int = 0) -> Tensor:
    """Inverse of ``split_for_context_parallel``: every rank gets the full sequence in order.

    Collective over ``cp_group`` (all-gather); backward keeps this rank's part of the gradient.
    """
    cp = group_size(cp_group)
    if cp == 1:
        return x
    gathered = gather_along_dim(x, cp_group, dim=seq_dim)  # rank order: [c0, c_{2cp-1}, c1, c_{2cp-2}, ...]
    parts = gathered.chunk(2 * cp, dim=seq_dim)
    order = [0] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = parts[2 * r], parts[2 * r + 1]
    return torch.cat(order, dim=seq_dim)


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------
def position_mask(q_pos: Tensor, k_pos: Tensor, sliding_window: int | None = None) -> Tensor:
    """Boolean ``[Sq, Sk]``, True where query i may attend key j: ``0 <= q_pos[i] - k_pos[j]``
    (causal) and, with a window, ``q_pos[i] - k_pos[j] < sliding_window`` (HF's sliding window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if sliding_window is not None:
        allowed = allowed & (diff < sliding_window)
    return allowed


def _all_gather_positions(pos: Tensor, cp_group: Group) -> Tensor:
    """Positions of every CP rank, ``[cp, S_local]`` (no autograd; a tiny collective)."""
    out = pos.new_empty(group_size(cp_group) * pos.shape[0])
    dist.all_gather_into_tensor(out, pos.contiguous(), group=cp_group)
    return out.view(group_size(cp_group), pos.shape[0])


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, scale: float, attn_mask: Tensor | None = None) -> Tensor:
    """``scaled_dot_product_attention``: causal by index without a mask, else the boolean ``attn_mask``.

    GQA: with ``is_causal`` the kv heads go in as they are (``enable_gqa``, which the flash kernel
    takes); with a mask they are expanded first, because not every masked fused kernel takes GQA
    and SDPA would otherwise fall back to the unfused math kernel.
    """
    rep = q.shape[1] // k.shape[1]
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


# --------------------------------------------------------------------------------------------
# all_gather mode
# --------------------------------------------------------------------------------------------
def all_gather_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, scale: float,
                         sliding_window: int | None = None) -> Tensor:
    """Attention of local queries against the K/V of the whole cp group.

    q ``[B, h, Sq, d]``, k ``[B, g, Sk, d]``, v ``[B, g, Sk, dv]`` (this rank's tokens), q_pos
    ``[Sq]`` global positions (the keys' too: self-attention). Returns ``[B, h, Sq, dv]``.
    Crosses ranks: K/V (all-gather; backward reduce-scatter of their gradients) and positions.
    """
    k_pos = _all_gather_positions(q_pos, cp_group).reshape(-1)
    k_all = all_gather_sequence(k, cp_group, dim=2)
    v_all = all_gather_sequence(v, cp_group, dim=2)
    return sdpa(q, k_all, v_all, scale=scale, attn_mask=position_mask(q_pos, k_pos, sliding_window))


# --------------------------------------------------------------------------------------------
# p2p (ring) mode
# --------------------------------------------------------------------------------------------
class _PendingShift:
    """Receive buffers of a ring step in flight; ``wait()`` before reading them."""

    def __init__(self) -> None:
        self.works: list = []
        self.sent: list[Tensor] = []  # the send buffers, kept alive until the transfer is done

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], []


def _ring_shift(tensors: tuple[Tensor, ...], group: Group, pending: _PendingShift,
                first_tag: int = 0) -> list[Tensor]:
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


def _expand_heads(t: Tensor, rep: int) -> Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _fold_heads(t: Tensor, rep: int) -> Tensor:
    """Sum a gradient over the query heads that share one kv head: [B, g*rep, ..] -> [B, g, ..]."""
    return t if rep == 1 else t.unflatten(1, (-1, rep)).sum(2)


def _scores(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """fp32 scores; masked entries get the most negative finite float rather than -inf, so a row
    with no visible key in this block stays finite (its weight in the merge is exactly 0)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)


class _RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward (flash-attention style: only q, k, v, the output
    and the log-sum-exp are kept; the probabilities are recomputed block by block).

    Forward: at step s this rank holds the K/V block of CP rank ``(r - s) mod cp`` (the next one
    already in flight), computes its partial output and lse in fp32 and merges them.
    Backward: the K/V blocks travel the same way, each with an fp32 gradient accumulator that
    every rank adds its queries' contribution to; after the last step one more shift brings each
    accumulator home. dq stays local.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, all_pos: Tensor, group: Group, scale: float,
                sliding_window: int | None) -> Tensor:
        n, me, rep = group_size(group), group_rank(group), q.shape[1] // k.shape[1]
        out = lse = None
        kv = [k, v]
        for step in range(n):
            pending = _PendingShift()
            nxt = _ring_shift(tuple(kv), group, pending) if step + 1 < n else None
            mask = position_mask(q_pos, all_pos[(me - step) % n], sliding_window)
            scores = _scores(q, _expand_heads(kv[0], rep), mask, scale)
            lse_s = torch.logsumexp(scores, dim=-1)
            out_s = torch.matmul(torch.exp(scores - lse_s.unsqueeze(-1)), _expand_heads(kv[1], rep).float())
            if out is None:
                out, lse = out_s, lse_s
            else:
                new_lse = torch.logaddexp(lse, lse_s)
                out = out * torch.exp(lse - new_lse).unsqueeze(-1) + out_s * torch.exp(lse_s - new_lse).unsqueeze(-1)
                lse = new_lse
            pending.wait()
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse, q_pos, all_pos)
        ctx.group, ctx.scale, ctx.sliding_window = group, scale, sliding_window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, q_pos, all_pos = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, me, rep = group_size(group), group_rank(group), q.shape[1] // k.shape[1]
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O), the softmax backward's correction
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(n):
            kv_pending = _PendingShift()
            nxt = _ring_shift(tuple(kv), group, kv_pending) if step + 1 < n else None
            k_blk, v_blk = _expand_heads(kv[0], rep).float(), _expand_heads(kv[1], rep).float()
            mask = position_mask(q_pos, all_pos[(me - step) % n], ctx.sliding_window)
            probs = torch.exp(_scores(q, k_blk, mask, scale) - lse.unsqueeze(-1))  # masked -> exactly 0
            dscores = probs * (torch.matmul(grad_out, v_blk.transpose(-1, -2)) - delta) * scale
            dq += torch.matmul(dscores, k_blk)
            dkv[0] = dkv[0] + _fold_heads(torch.matmul(dscores.transpose(-1, -2), q.float()), rep)
            dkv[1] = dkv[1] + _fold_heads(torch.matmul(probs.transpose(-1, -2), grad_out), rep)
            # the accumulator follows its block to the next rank; after the last step, to its owner
            acc_pending = _PendingShift()
            dkv = _ring_shift(tuple(dkv), group, acc_pending, first_tag=2)
            acc_pending.wait()
            kv_pending.wait()
            kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, scale: float,
                   sliding_window: int | None = None) -> Tensor:
    """Ring (p2p) context-parallel attention; shapes as ``all_gather_attention``.

    Memory per rank: q, k, v, the fp32 output and lse, plus one S_local x S_local block of
    scores at a time (no attention matrix is stored for backward). Crosses ranks: K/V blocks
    point-to-point (forward, and in backward together with their gradient accumulators) and
    the positions (one small all-gather).
    """
    all_pos = _all_gather_positions(q_pos, cp_group)
    return _RingAttention.apply(q, k, v, q_pos, all_pos, cp_group, scale, sliding_window)


CP_ATTENTION = {"p2p": ring_attention, "all_gather": all_gather_attention}  # cp_comm -> implementation


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, mode: str,
                               scale: float, sliding_window: int | None = None) -> Tensor:
    """Causal attention across the cp group in exchange mode ``mode`` (``CP_COMM_MODES``).

    q ``[B, h, Sq, d]``, k ``[B, g, Sk, d]``, v ``[B, g, Sk, dv]``, q_pos ``[Sq]`` -> ``[B, h, Sq, dv]``.
    A group of size 1 attends locally (position mask, no communication)."""
    if mode not in CP_ATTENTION:
        raise ValueError(f"cp_comm={mode!r} is not one of {CP_COMM_MODES}")
    if group_size(cp_group) == 1:
        return sdpa(q, k, v, scale=scale, attn_mask=position_mask(q_pos, q_pos, sliding_window))
    return CP_ATTENTION[mode](q, k, v, q_pos, cp_group, scale=scale, sliding_window=sliding_window)
