"""Context parallelism (CP): the sequence split over the cp group, and attention across the split.

Load-balanced split: the sequence is cut into ``2*cp`` equal chunks and CP rank ``r`` keeps
chunks ``r`` and ``2*cp-1-r``, so under a causal mask every rank does the same amount of work.
A rank therefore holds non-contiguous tokens. Which keys a query sees follows from the tokens'
true global positions (``position_ids``, from ``context_parallel_positions``), never from local
indices: the math reference builds masks from them, the fused path derives the same visibility
from the chunk layout (rank, cp, chunk length, window) on the host.

Two exchange modes (``cp_comm``), each in two implementations with the same contract:

- ``p2p``: a ring. K/V blocks travel around the cp group with isend/irecv (one
  ``batch_isend_irecv`` per step, launched before the current block is computed so the
  transfer overlaps the math); each block's partial attention (output and log-sum-exp) is
  merged with a log-sum-exp rescale. Backward: only q, k, v, the output and the lse are saved;
  the K/V blocks go around the ring again, each with its gradient accumulator, which a final
  shift returns to the block's owner. O(S/cp) memory per rank.
- ``all_gather``: K/V of every CP rank all-gathered along the sequence (backward: the K/V
  gradients reduce-scattered back). Simple, one collective, O(S) K/V memory per rank.

The default, fused implementation (``dense.cp_fused``, table ``CP_ATTENTION``) runs a flash kernel
per visible block (``dense.attention_kernels``), skips the blocks the causal mask or the window
hides entirely, and needs a mask only for blocks that cross a sliding-window boundary. The math
implementation (``CP_ATTENTION_MATH``: ``ring_attention_math``, ``all_gather_attention_math``) is
the test reference: position masks from the true global positions and plain torch math, every
block computed; the p2p one builds one fp32 ``[B, h, S/cp, S/cp]`` block of scores per step, the
all_gather one passes a boolean ``[S/cp, S]`` mask to SDPA.

Tensors here are in SDPA layout ``[B, heads, S, dim]``; K/V may have fewer heads than Q (GQA:
``heads_q % heads_kv == 0``, kv head j serving q heads ``j*rep .. (j+1)*rep-1``, as HF's
``repeat_kv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.dense.attention_kernels import expand_heads, fold_heads, merge_sinks, sinks_grad
from moefold.dense.choices import CP_COMM_MODES
from moefold.dense.cp_exchange import PendingShift, rank_order_to_global, ring_shift
from moefold.dense.cp_fused import fused_all_gather_attention, fused_ring_attention
from moefold.parallel.comm import all_gather_sequence, all_gather_single, gather_along_dim
from moefold.parallel.groups import Group, group_rank, group_size


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
    return rank_order_to_global(gather_along_dim(x, cp_group, dim=seq_dim), cp, seq_dim)


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
    all_gather_single(out, pos.contiguous(), cp_group)
    return out.view(group_size(cp_group), pos.shape[0])


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, scale: float, attn_mask: Tensor | None = None,
         sinks: Tensor | None = None) -> Tensor:
    """``scaled_dot_product_attention``: causal by index without a mask, else the boolean ``attn_mask``.

    GQA: with ``is_causal`` the kv heads go in as they are (``enable_gqa``, which the flash kernel
    takes); with a mask they are expanded first, because not every masked fused kernel takes GQA
    and SDPA would otherwise fall back to the unfused math kernel.

    ``sinks [h]`` (attention sinks): SDPA has no sink argument and returns no log-sum-exp, so this is
    the plain math of HF's ``eager_attention_forward`` (the reference, and generation with a KV cache);
    training runs sinks through the fused kernels (``cp_fused.fused_local_attention``).
    """
    rep = q.shape[1] // k.shape[1]
    if sinks is not None:
        return _sdpa_with_sinks(q, k, v, scale, attn_mask, sinks)
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def _sdpa_with_sinks(q: Tensor, k: Tensor, v: Tensor, scale: float, attn_mask: Tensor | None, sinks: Tensor) -> Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = expand_heads(k, rep), expand_heads(v, rep)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if attn_mask is None:   # causal by index, SDPA's top-left alignment
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


# --------------------------------------------------------------------------------------------
# the math reference: all_gather mode
# --------------------------------------------------------------------------------------------
def all_gather_attention_math(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, scale: float,
                              sliding_window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention of local queries against the K/V of the whole cp group, SDPA with a boolean position mask.

    q ``[B, h, Sq, d]``, k ``[B, g, Sk, d]``, v ``[B, g, Sk, dv]`` (this rank's tokens), q_pos
    ``[Sq]`` global positions (the keys' too: self-attention). Returns ``[B, h, Sq, dv]``.
    Crosses ranks: K/V (all-gather; backward reduce-scatter of their gradients) and positions.
    """
    k_pos = _all_gather_positions(q_pos, cp_group).reshape(-1)
    k_all = all_gather_sequence(k, cp_group, dim=2)
    v_all = all_gather_sequence(v, cp_group, dim=2)
    return sdpa(q, k_all, v_all, scale=scale, attn_mask=position_mask(q_pos, k_pos, sliding_window), sinks=sinks)


# --------------------------------------------------------------------------------------------
# the math reference: p2p (ring) mode
# --------------------------------------------------------------------------------------------
def _scores(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """fp32 scores; masked entries get the most negative finite float rather than -inf, so a row
    with no visible key in this block stays finite (its weight in the merge is exactly 0)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)


class _RingAttentionMath(torch.autograd.Function):
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
                sliding_window: int | None, sinks: Tensor | None) -> Tensor:
        n, me, rep = group_size(group), group_rank(group), q.shape[1] // k.shape[1]
        out = lse = None
        kv = [k, v]
        for step in range(n):
            pending = PendingShift()
            nxt = ring_shift(tuple(kv), group, pending) if step + 1 < n else None
            mask = position_mask(q_pos, all_pos[(me - step) % n], sliding_window)
            scores = _scores(q, expand_heads(kv[0], rep), mask, scale)
            lse_s = torch.logsumexp(scores, dim=-1)
            out_s = torch.matmul(torch.exp(scores - lse_s.unsqueeze(-1)), expand_heads(kv[1], rep).float())
            if out is None:
                out, lse = out_s, lse_s
            else:
                new_lse = torch.logaddexp(lse, lse_s)
                out = out * torch.exp(lse - new_lse).unsqueeze(-1) + out_s * torch.exp(lse_s - new_lse).unsqueeze(-1)
                lse = new_lse
            pending.wait()
            kv = nxt
        if sinks is not None:
            merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, all_pos, sinks)
        ctx.group, ctx.scale, ctx.sliding_window = group, scale, sliding_window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, q_pos, all_pos, sinks = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, me, rep = group_size(group), group_rank(group), q.shape[1] // k.shape[1]
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O), the softmax backward's correction
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = [k, v]
        dkv = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(n):
            kv_pending = PendingShift()
            nxt = ring_shift(tuple(kv), group, kv_pending) if step + 1 < n else None
            k_blk, v_blk = expand_heads(kv[0], rep).float(), expand_heads(kv[1], rep).float()
            mask = position_mask(q_pos, all_pos[(me - step) % n], ctx.sliding_window)
            probs = torch.exp(_scores(q, k_blk, mask, scale) - lse.unsqueeze(-1))  # masked -> exactly 0
            dscores = probs * (torch.matmul(grad_out, v_blk.transpose(-1, -2)) - delta) * scale
            dq += torch.matmul(dscores, k_blk)
            dkv[0] = dkv[0] + fold_heads(torch.matmul(dscores.transpose(-1, -2), q.float()), rep)
            dkv[1] = dkv[1] + fold_heads(torch.matmul(probs.transpose(-1, -2), grad_out), rep)
            # the accumulator follows its block to the next rank; after the last step, to its owner
            acc_pending = PendingShift()
            dkv = ring_shift(tuple(dkv), group, acc_pending, first_tag=2)
            acc_pending.wait()
            kv_pending.wait()
            kv = nxt
        d_sinks = None if sinks is None else sinks_grad(grad_out, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, d_sinks


def ring_attention_math(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, scale: float,
                        sliding_window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """Ring (p2p) context-parallel attention in plain math; shapes as ``all_gather_attention_math``.

    Memory per rank: q, k, v, the fp32 output and lse, plus one S_local x S_local block of
    scores at a time (no attention matrix is stored for backward). Crosses ranks: K/V blocks
    point-to-point (forward, and in backward together with their gradient accumulators) and
    the positions (one small all-gather).
    """
    all_pos = _all_gather_positions(q_pos, cp_group)
    return _RingAttentionMath.apply(q, k, v, q_pos, all_pos, cp_group, scale, sliding_window, sinks)


# cp_comm -> implementation, chosen once (CoreAttention's constructor), never per forward
CP_ATTENTION = {"p2p": fused_ring_attention, "all_gather": fused_all_gather_attention}
CP_ATTENTION_MATH = {"p2p": ring_attention_math, "all_gather": all_gather_attention_math}


def cp_attention_impl(mode: str, *, fused: bool = True):
    """The CP attention function for exchange mode ``mode`` (``CP_COMM_MODES``): fused (default) or the
    math reference. All take ``(q, k, v, q_pos, cp_group, *, scale, sliding_window, sinks)``."""
    if mode not in CP_ATTENTION:
        raise ValueError(f"cp_comm={mode!r} is not one of {CP_COMM_MODES}")
    return (CP_ATTENTION if fused else CP_ATTENTION_MATH)[mode]


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cp_group: Group, *, mode: str,
                               scale: float, sliding_window: int | None = None, fused: bool = True,
                               sinks: Tensor | None = None) -> Tensor:
    """Causal attention across the cp group in exchange mode ``mode`` (``CP_COMM_MODES``), fused kernels
    or (``fused=False``) the math reference.

    q ``[B, h, Sq, d]``, k ``[B, g, Sk, d]``, v ``[B, g, Sk, dv]``, q_pos ``[Sq]`` -> ``[B, h, Sq, dv]``.
    The fused path takes visibility from the load-balanced layout, so ``q_pos`` must be this rank's
    ``context_parallel_positions``; the math path masks by ``q_pos`` itself.
    A group of size 1 attends locally (position mask, no communication). ``sinks [h]``: attention sinks."""
    impl = cp_attention_impl(mode, fused=fused)
    if group_size(cp_group) == 1:
        return sdpa(q, k, v, scale=scale, attn_mask=position_mask(q_pos, q_pos, sliding_window), sinks=sinks)
    return impl(q, k, v, q_pos, cp_group, scale=scale, sliding_window=sliding_window, sinks=sinks)
