"""DeepSeek Sparse Attention (DSA): MLA where each query attends only to the ``index_topk`` keys its lightning
indexer (``dense.dsa_indexer``) selects. HF ``DeepseekV32Attention`` semantics, with TP/SP/CP.

The attention runs in MLA's absorbed (multi-query) form, as DeepSeek's sparse kernels do: ``kv_b_proj``'s key half
is folded into the queries (``q_nope W_uk``), so every head scores the same ``[kv_lora_rank + rope]`` latent key,
and its value half is applied after the weighted sum. Each query gathers only its selected latents,
``query_chunk`` queries at a time under a checkpoint: time ``O(S * K * heads * latent)`` and memory
``O(chunk * K * latent)`` transient, never an ``[S, T]`` score matrix (the indexer's scores are ``[chunk, T]`` at a
time, without autograd). ``kv_b_proj``'s weight is read directly (its configured GEMM is not used on this path).

Parallelism. tp: heads split as in MLA; the latent and the rope key enter the TP region as in MLA; the indexer is
replicated (its inputs detached and, under SP, all-gathered), so every rank selects world 1's keys; the loss's target
(attention probabilities summed over heads) is all-reduced over tp, and every rank computes the same indexer loss
(complete, identical gradients of its replicated parameters). cp: queries stay local; the latent, the rope key and
the indexer keys are all-gathered over cp (backward: reduce-scatter) and put in global position order, which keeps
the indexer's top-k, ties included, equal to world 1's.

The indexer's loss (``dense.dsa_indexer.indexer_kl_loss`` times ``loss_coeff``) joins the backward through
``attach_loss`` on the attention output (Megatron-Core's ``DSAIndexerLossAutoScaler``): its gradient is 1 per
micro-batch, whatever the LM loss is scaled by, and it reaches only the indexer (its inputs are detached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.dense.attention_config import MLAConfig
from moefold.dense.dsa_indexer import DSAConfig, LightningIndexer, indexer_kl_loss
from moefold.dense.mla import MLAttention
from moefold.dense.recompute import checkpointed
from moefold.dense.rope import apply_rotary
from moefold.parallel.comm import all_gather_sequence, all_gather_single, all_reduce_sum, copy_to_region
from moefold.parallel.groups import Group, group_size


class _AttachLoss(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: ``out``'s gradient passes, ``loss`` gets gradient 1."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def attach_loss(out: Tensor, loss: Tensor) -> Tensor:
    """``out``, with ``loss`` added to whatever loss the backward starts from (scale 1)."""
    return _AttachLoss.apply(out, loss)


def sparse_latent_attention(q: Tensor, kv_B: Tensor, idx: Tensor, valid: Tensor, scale: float,
                            value_dim: int) -> tuple[Tensor, Tensor]:
    """One block of queries: q ``[C, B, h, D]`` (absorbed nope part, then rope), latent keys kv_B ``[B, T, D]`` (their
    first ``value_dim`` channels are the values), idx/valid ``[B, C, K]`` -> (out ``[C, B, h, value_dim]``, the
    probabilities summed over the heads ``[B, C, K]`` fp32, detached). fp32 softmax."""
    sel = gather_rows(kv_B, idx)                                                       # [B*C, K, D]
    C, B, h, D = q.shape
    q_ = q.transpose(0, 1).reshape(B * C, h, D)
    # one small GEMM per query (batched), its K keys loaded once for all its heads, as MQA kernels do
    # keys on the left: sel's gradient comes out contiguous (no transposed [K, D] copy to add)
    s = torch.bmm(sel.float(), q_.float().transpose(1, 2)).transpose(1, 2) * scale     # [B*C, h, K]
    p = torch.softmax(s.masked_fill(~valid.reshape(B * C, 1, -1), float("-inf")), dim=-1)
    # the product with every channel, then the value ones: a slice of sel would cost a zero-filled copy of its
    # gradient in the backward (the rope channels add rope / (r + rope) to this product's FLOPs)
    out = torch.bmm(p.to(sel.dtype), sel)[..., :value_dim]                              # [B*C, h, r]
    return out.reshape(B, C, h, value_dim).transpose(0, 1), p.detach().sum(1).view(B, C, -1)


def gather_rows(t_BTD: Tensor, idx: Tensor) -> Tensor:
    """``t[b, idx[b, c, k]]`` as ``[B*C, K, D]`` (``index_select`` on the flattened rows: its backward is one
    ``index_add``, not advanced indexing's sorting ``index_put``)."""
    B, T, D = t_BTD.shape
    flat = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * T).reshape(-1)
    return t_BTD.reshape(B * T, D).index_select(0, flat).view(-1, idx.shape[-1], D)


@dataclass
class LatentCache:
    """What generation keeps of a DSA layer's past tokens: latent keys ``[T, B, r + rope]``, indexer keys
    ``[T, B, d]`` and their positions ``[T]`` (None before the first step)."""

    kv: Tensor | None = None
    index_keys: Tensor | None = None
    positions: Tensor | None = None

    def extend(self, kv: Tensor, index_keys: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append this step's tokens; every token seen so far."""
        if self.kv is not None:
            kv, index_keys = torch.cat([self.kv, kv]), torch.cat([self.index_keys, index_keys])
            positions = torch.cat([self.positions, positions])
        self.kv, self.index_keys, self.positions = kv, index_keys, positions
        return kv, index_keys, positions


class DSAttention(MLAttention):
    """forward(x ``[S/tp, B, H]`` with SP else ``[S, B, H]``, position_ids ``[S]``) -> same shape as x.

    MLA's parameters (``dense.mla``) plus ``indexer`` (``LightningIndexer``). Needs ``q_lora_rank`` (the indexer
    reads the query latent). Crosses ranks: tp (MLA's, the target's all-reduce, under SP the indexer inputs'
    all-gather) and cp (all-gathers of the latent and indexer keys, their positions).
    """

    def __init__(self, config: MLAConfig, dsa: DSAConfig, tp_group: Group = None, cp_group: Group = None, *,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        if config.q_lora_rank is None:
            raise ValueError("DSAttention: the lightning indexer reads the query latent; q_lora_rank must be set")
        super().__init__(config, tp_group, cp_group, sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.dsa, self.cp_group = dsa, cp_group
        self.indexer = LightningIndexer(dsa, config.hidden_size, config.q_lora_rank, config.qk_rope_head_dim,
                                        init_std=config.init_std, dtype=dtype, device=device)
        self.cache: LatentCache | None = None   # set by generation (models.generate.kv_cache) only

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        q_nope, q_rot, kv, k_pos, iq, iw, ik = self.regions.qkv_linear(self._project, x, position_ids)
        idx, valid = self.indexer.select(iq, iw, ik, position_ids, k_pos)
        out, target = self.regions.core_attn(self._attend, q_nope, q_rot, kv, idx, valid)
        if self.dsa.loss_coeff > 0 and torch.is_grad_enabled():
            target = all_reduce_sum(target, self.tp_group)
            out = attach_loss(out, self._indexer_loss(iq, iw, ik, idx, target, valid) * self.dsa.loss_coeff)
        return self.regions.attn_proj(self.o_proj, out)

    def _indexer_loss(self, iq: Tensor, iw: Tensor, ik: Tensor, idx: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        """``indexer_kl_loss`` over this rank's queries, ``query_chunk`` at a time under a checkpoint: the gathered
        ``[chunk, K, d]`` indexer keys are recomputed in the backward, not kept."""
        rows = idx.shape[0] * idx.shape[1] * group_size(self.cp_group)
        total = iq.new_zeros((), dtype=torch.float32)
        for s0 in range(0, idx.shape[1], self.dsa.query_chunk):
            sl = slice(s0, s0 + self.dsa.query_chunk)
            total = total + checkpointed(self._chunk_loss, iq[:, sl], iw[:, sl], ik, idx[:, sl], target[:, sl],
                                         valid[:, sl])
        return total / rows

    def _chunk_loss(self, iq: Tensor, iw: Tensor, ik: Tensor, idx: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        return indexer_kl_loss(self.indexer.selected_scores(iq, iw, ik, idx), target, valid, 1)

    def _enter_tp(self, t: Tensor) -> Tensor:
        return all_gather_sequence(t, self.tp_group, 0) if self.sequence_parallel else copy_to_region(t, self.tp_group)

    def _project(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, ...]:
        """-> q_nope ``[S, B, h, nope]``, q_rot ``[S, B, h, rope]`` (RoPE applied), latent keys ``[T, B, r + rope]``,
        their positions ``[T]``, the indexer's q ``[B, S, n, d]``, weights ``[B, S, n]`` and keys ``[T, B, d]``."""
        c, h = self.config, self.local_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_in, k_rot = self._enter_tp(self.kv_a_layernorm(kv_latent)), self._enter_tp(k_rot)
        S, B = k_rot.shape[:2]
        if position_ids.shape != (S,):
            raise ValueError(f"DSAttention: position_ids {tuple(position_ids.shape)} must be [{S}] "
                             "(one global position per token of this rank's sequence, before the SP split)")
        cos, sin = self.rotary(position_ids)
        q = self.q_b_proj(q_resid).view(S, B, h, c.qk_head_dim)
        q_nope, q_rot = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rot = apply_rotary(q_rot, cos, sin, interleaved=c.rope_interleave)
        k_rot = apply_rotary(k_rot.view(S, B, 1, -1), cos, sin, interleaved=c.rope_interleave).view(S, B, -1)
        kv = torch.cat([kv_in, k_rot], dim=-1)
        # the indexer learns only from its own loss: detached inputs, whole sequence (replicated over tp)
        x_i, q_i = x.detach(), q_resid.detach()
        if self.sequence_parallel:
            x_i, q_i = all_gather_sequence(x_i, self.tp_group, 0), all_gather_sequence(q_i, self.tp_group, 0)
        iq, iw = self.indexer.queries(x_i, q_i, cos, sin)
        ik = self.indexer.keys(x_i, cos, sin)
        kv, ik, k_pos = self._gather_keys(kv, ik, position_ids)
        return q_nope, q_rot, kv, k_pos, iq, iw, ik

    def _gather_keys(self, kv: Tensor, ik: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every cp rank's latent and indexer keys, in global position order (identity without cp)."""
        cp = group_size(self.cp_group)
        if self.cache is not None:   # generation (cp 1): the past tokens' keys, then this step's
            return self.cache.extend(kv, ik, position_ids)
        if cp == 1:
            return kv, ik, position_ids
        positions = position_ids.new_empty(cp * position_ids.shape[0])
        all_gather_single(positions, position_ids.contiguous(), self.cp_group)
        order = torch.argsort(positions)
        kv = all_gather_sequence(kv.contiguous(), self.cp_group, 0)[order]
        ik = all_gather_sequence(ik.contiguous(), self.cp_group, 0)[order]
        return kv, ik, positions[order]

    def _attend(self, q_nope: Tensor, q_rot: Tensor, kv: Tensor, idx: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Sparse absorbed attention -> (``[S, B, h * v]``, head-summed probabilities ``[B, S, K]``)."""
        c, h = self.config, self.local_heads
        S, B = q_nope.shape[:2]
        w_uk, w_uv = self.kv_b_proj.weight.view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank).split(
            [c.qk_nope_head_dim, c.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("sbhn,hnr->sbhr", q_nope, w_uk), q_rot], dim=-1)
        kv_B = kv.transpose(0, 1)
        outs, targets = [], []
        for s0 in range(0, S, self.dsa.query_chunk):
            sl = slice(s0, s0 + self.dsa.query_chunk)
            out, target = checkpointed(sparse_latent_attention, q[sl], kv_B, idx[:, sl], valid[:, sl],
                                       self.core.scale, c.kv_lora_rank)
            outs.append(out)
            targets.append(target)
        out = torch.einsum("sbhr,hvr->sbhv", torch.cat(outs), w_uv)
        return out.reshape(S, B, h * c.v_head_dim), torch.cat(targets, dim=1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dsa_topk={self.dsa.index_topk}"
