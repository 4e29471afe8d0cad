"""GQA causal self-attention (Qwen3-MoE, Mixtral) with tensor, sequence and context parallelism.

Parameters map 1:1 onto HF's ``q_proj/k_proj/v_proj/o_proj`` (+ ``q_norm/k_norm``), each
weight ``[out, in]`` like ``nn.Linear``:

- ``q_proj`` column-parallel: the local weight holds whole heads ``[h/tp * d, H]``.
- ``k_proj``/``v_proj`` column-parallel when ``kv_heads % tp == 0``; with fewer kv heads than
  tp (Megatron-style replication) each rank keeps the *full* ``[kv_heads * d, H]`` weight and uses
  the rows of kv head ``tp_rank // (tp / kv_heads)``. The weight enters through
  ``copy_to_region``, so its gradient is all-reduced over tp in backward and is complete and
  identical on every tp rank (it needs no further reduction).
- ``q_norm``/``k_norm`` (qk-norm) are replicated; each rank normalises only its own heads, so
  their weights also enter through ``copy_to_region``: complete gradients on every rank. Over the
  whole projection (``qk_norm_scope="projection"``, OLMoE / MiniMax-M2) the weights are
  ``[heads * d]`` / ``[kv_heads * d]``; each rank uses the rows of its heads, and the row's sum of
  squares over all heads is all-reduced over tp (backward: all-reduce of its gradient), one
  ``[S, B, 1]`` fp32 tensor per norm. With replicated kv heads each rank projects every kv head
  for the norm and keeps its own.
- ``sinks [h/tp]`` (attention sinks, HF ``self_attn.sinks``): split over tp with the query heads.
- ``o_proj`` row-parallel (reduce-scatter to the sequence shard under SP, else all-reduce).
- Partial RoPE (``rotary_dim`` < head_dim): the first ``rotary_dim`` dims of each head rotate.

The block input (the sequence shard under SP) is all-gathered once for q, k and v together.

Gated attention (``output_gate``, Qwen3-Next): ``q_proj`` is ``[heads * 2d, H]`` laid out per head as
``[q_h, gate_h]`` (HF's), so a tp shard still holds whole heads; the core attention's output is multiplied by
``sigmoid(gate)`` before ``o_proj`` (``output_gate``, in fp32). ``zero_centered_gamma`` (Qwen3-Next): the q/k
norms store ``gamma - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from moefold.dense.attention_config import AttentionConfig, QKNormScope
from moefold.dense.choices import Recompute
from moefold.dense.core_attention import CoreAttention
from moefold.dense.documents import Documents
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear, on_tp_input
from moefold.dense.norm import RMSNorm
from moefold.dense.regions import CHECKPOINT, PLAIN, Region, recomputes, replace_regions
from moefold.dense.rope import RotaryEmbedding, apply_partial_rotary
from moefold.parallel.comm import copy_to_region, reduce_from_region
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import Shard, mark_sharded


def output_gate(out: Tensor, gate: Tensor) -> Tensor:
    """Gated attention's ``out * sigmoid(gate)`` (same shapes), in out's dtype.

    An fp32 island: the sigmoid and the product in fp32, rounded once, as Megatron-Core's
    ``Attention._apply_output_gate`` computes them (HF's Qwen3-Next rounds the sigmoid to bf16, then the product)."""
    return (out.float() * torch.sigmoid(gate.float())).to(out.dtype)


@dataclass(frozen=True)
class AttentionRegions:
    """Where an attention runs its three parts (``dense.regions``; Megatron's module names): ``qkv_linear`` the
    input projections, q/k norms and RoPE, ``core_attn`` softmax(q k^T) v, ``attn_proj`` the output projection."""

    qkv_linear: Region = PLAIN
    core_attn: Region = PLAIN
    attn_proj: Region = PLAIN


class GQAAttention(nn.Module):
    """forward(x ``[S/tp, B, H]`` with SP else ``[S, B, H]``, position_ids ``[S]``, documents) -> same shape as x.

    ``S`` is this rank's sequence (its CP part: ``position_ids`` are the true global positions,
    int64). ``documents`` (``dense.documents``, or None): attention inside each packed document, RoPE at the
    restarted positions when it carries them. Crosses ranks: tp (input all-gather / output reduce-scatter under
    SP, else the column/row region all-reduces) and cp (K/V exchange, see ``dense.context_parallel``).
    """

    def __init__(self, config: AttentionConfig, tp_group: Group = None, cp_group: Group = None, *,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        tp, cp = group_size(tp_group), group_size(cp_group)
        config.check_parallel(tp, cp)
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        c, d, g = config, config.head_dim_resolved, config.kv_heads
        self.head_dim = d
        self.local_heads = c.num_heads // tp
        self.kv_replicated = g % tp != 0
        self.local_kv_heads = 1 if self.kv_replicated else g // tp
        # replicated kv: the one kv head whose query group contains this rank's query heads
        self.kv_head_index = group_rank(tp_group) // (tp // g) if self.kv_replicated else 0
        kw = {"bias": c.bias, "init_std": c.init_std, "dtype": dtype, "device": device}
        self.q_proj = ColumnParallelLinear(c.hidden_size, c.num_heads * d * (2 if c.output_gate else 1), tp_group, **kw)
        kv_group = None if self.kv_replicated else tp_group
        self.k_proj = ColumnParallelLinear(c.hidden_size, g * d, kv_group, **kw)
        self.v_proj = ColumnParallelLinear(c.hidden_size, g * d, kv_group, **kw)
        self.o_proj = RowParallelLinear(c.num_heads * d, c.hidden_size, tp_group, sequence_parallel=sequence_parallel,
                                        **{**kw, "bias": c.out_bias_resolved})
        self.projection_norm = c.qk_norm and c.qk_norm_scope is QKNormScope.PROJECTION
        if c.qk_norm:
            q_dim, k_dim = (c.num_heads * d, g * d) if self.projection_norm else (d, d)
            norm_kw = {"zero_centered_gamma": c.zero_centered_gamma, "dtype": dtype, "device": device}
            self.q_norm = RMSNorm(q_dim, c.norm_eps, **norm_kw)
            self.k_norm = RMSNorm(k_dim, c.norm_eps, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        if c.sinks:   # zero: Megatron's learnable softmax offset starts at 0; checkpoints overwrite it
            self.sinks = nn.Parameter(torch.zeros(self.local_heads, dtype=dtype, device=device))
            mark_sharded(self.sinks, Shard.over(tp_group, 0))
        else:
            self.register_parameter("sinks", None)
        if c.max_logit and cp > 1:
            raise ValueError(f"GQAAttention: max_logit (--qk-clip) with context parallelism (cp={cp}) is not "
                             "supported: a rank's queries see keys of other ranks")
        # max_logit: [h/tp] fp32, each local head's largest logit of the training forwards since the last reset
        self.max_logits: Tensor | None = None
        # rotary_dim 0: no positional encoding at all (Nemotron-H's attention layers)
        self.rotary = (RotaryEmbedding(c.rotary_dim_resolved, c.rope_theta, c.yarn, device=device)
                       if c.rotary_dim_resolved else None)
        self.core = CoreAttention(d ** -0.5, sliding_window=c.sliding_window, cp_group=cp_group, cp_comm=c.cp_comm)
        # selective recompute of core attention by default (``config.recompute``); moefold.execution reconfigures it
        self.regions = AttentionRegions(core_attn=CHECKPOINT if c.recompute is Recompute.SELECTIVE else PLAIN)

    def configure(self, **regions: Region) -> None:
        """Install regions by name (``AttentionRegions``); ValueError for an unknown name or a wrong kind."""
        self.regions = replace_regions(self.regions, type(self).__name__, **regions)

    def _project_kv(self, proj: ColumnParallelLinear, x: Tensor) -> Tensor:
        if not self.kv_replicated:
            return proj.forward_local(x)
        rows = slice(self.kv_head_index * self.head_dim, (self.kv_head_index + 1) * self.head_dim)
        w = copy_to_region(proj.weight, self.tp_group)[rows]
        b = None if proj.bias is None else copy_to_region(proj.bias, self.tp_group)[rows]
        return F.linear(x, w, b)

    def _head_norm(self, norm: RMSNorm, x: Tensor) -> Tensor:
        return functional_call(norm, {"weight": copy_to_region(norm.weight, self.tp_group)}, (x,))

    def _projection_norm(self, norm: RMSNorm, x_SBhd: Tensor, first_row: int, split: bool) -> Tensor:
        """RMSNorm over the whole projection of which ``x`` holds the heads starting at weight row ``first_row``;
        ``split``: the other heads are on the other tp ranks (their sums of squares are all-reduced)."""
        S, B, h, d = x_SBhd.shape
        weight = copy_to_region(norm.weight, self.tp_group)
        if not split:
            return functional_call(norm, {"weight": weight}, (x_SBhd.reshape(S, B, h * d),)).view(S, B, h, d)
        x32 = x_SBhd.reshape(S, B, h * d).float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True)
        # every rank's rows need the sum over all heads, and its gradient flows back to every rank
        sum_sq = reduce_from_region(copy_to_region(sum_sq, self.tp_group), self.tp_group)
        x32 = x32 * torch.rsqrt(sum_sq / norm.hidden + norm.eps)
        rows = weight[first_row:first_row + h * d]
        if norm.zero_centered_gamma:   # RMSNorm's order: (1 + weight) in fp32, one cast
            return (x32 * (1.0 + rows.float())).to(x_SBhd.dtype).view(S, B, h, d)
        # the weight multiply in fp32 and one rounding, as dense.norm.rms_norm (the unsplit path) does
        return (rows.to(torch.float32) * x32).to(x_SBhd.dtype).view(S, B, h, d)

    def _qk(self, x: Tensor, S: int, B: int) -> tuple[Tensor, Tensor | None, Tensor]:
        """q ``[S, B, h/tp, d]``, the output gate ``[S, B, h/tp, d]`` (None without ``output_gate``) and
        k ``[S, B, kv/tp or 1, d]``; q and k qk-normed, before RoPE."""
        d = self.head_dim
        q = self.q_proj.forward_local(x).view(S, B, self.local_heads, -1)
        gate = None
        if self.config.output_gate:   # per head [q_h, gate_h]
            q, gate = q.chunk(2, dim=-1)
        if not self.projection_norm:
            k = self._project_kv(self.k_proj, x).view(S, B, self.local_kv_heads, d)
            if self.q_norm is not None:
                q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
            return q, gate, k
        split = group_size(self.tp_group) > 1
        q = self._projection_norm(self.q_norm, q, group_rank(self.tp_group) * self.local_heads * d, split)
        if not self.kv_replicated:
            k = self.k_proj.forward_local(x).view(S, B, self.local_kv_heads, d)
            k = self._projection_norm(self.k_norm, k, group_rank(self.tp_group) * self.local_kv_heads * d, split)
            return q, gate, k
        # replicated kv heads: the norm needs every kv head, which this rank can project (it holds the weight)
        bias = None if self.k_proj.bias is None else copy_to_region(self.k_proj.bias, self.tp_group)
        k_all = F.linear(x, copy_to_region(self.k_proj.weight, self.tp_group), bias)
        k_all = self._projection_norm(self.k_norm, k_all.view(S, B, self.config.kv_heads, d), 0, False)
        return q, gate, k_all[:, :, self.kv_head_index:self.kv_head_index + 1]

    def _qkv(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """q, the output gate, k and v of the gathered / replicated input ``x [S, B, H]``."""
        S, B = x.shape[:2]
        if position_ids.shape != (S,):
            raise ValueError(f"GQAAttention: position_ids {tuple(position_ids.shape)} must be [{S}] "
                             "(one global position per token of this rank's sequence, before the SP split)")
        q, gate, k = self._qk(x, S, B)
        return q, gate, k, self._project_kv(self.v_proj, x).view(S, B, self.local_kv_heads, self.head_dim)

    def _project_in(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None,
                    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """The ``qkv_linear`` part: (q, output gate, k, v), q and k with RoPE."""
        # one all-gather (SP) or one region entry for q, k and v together; under SP their GEMMs keep the shard
        # (dense.linear.on_tp_input)
        q, gate, k, v = on_tp_input(x, self.tp_group, self.sequence_parallel,
                                    lambda x_in: self._qkv(x_in, position_ids))
        B = q.shape[1]
        if self.rotary is not None:
            cos, sin = self.rotary(position_ids if documents is None else documents.rope_positions(position_ids, B))
            q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if self.config.max_logit and self.training:   # a recompute records the same values again: max is idempotent
            self._record_max_logits(q, k, position_ids, documents)
        return q, gate, k, v

    @torch.no_grad()
    def _record_max_logits(self, q: Tensor, k: Tensor, position_ids: Tensor, documents: Documents | None = None,
                           block: int = 256) -> None:
        """``max_logits[h] = max(max_logits[h], max over b, i, j visible to i of scale * q_bhi . k_bgj)`` for q
        ``[S, B, h, d]``, k ``[S, B, g, d]`` (causal, sliding window, inside packed ``documents``); query blocks of
        ``block`` rows bound the scores' memory to ``B h block S``."""
        qf, kf = q.float().permute(1, 2, 0, 3), k.float().permute(1, 2, 0, 3)
        kf = kf.repeat_interleave(qf.shape[1] // kf.shape[1], dim=1)
        ahead = position_ids[:, None] - position_ids[None, :]
        visible = ahead >= 0
        if self.config.sliding_window is not None:
            visible &= ahead < self.config.sliding_window
        doc = None
        if documents is not None and documents.isolate:   # [B, S]: each token's document in its sample
            doc = documents.document_ids(position_ids)
        best = torch.full((qf.shape[1],), float("-inf"), device=q.device)
        for i in range(0, qf.shape[2], block):
            scores = (qf[:, :, i:i + block] @ kf.transpose(-1, -2)) * self.core.scale
            seen = visible[i:i + block]
            if doc is not None:
                seen = (seen & (doc[:, i:i + block, None] == doc[:, None, :]))[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
        self.max_logits = best if self.max_logits is None else torch.maximum(self.max_logits, best)

    def _project_out(self, out: Tensor, gate: Tensor | None) -> Tensor:
        """The ``attn_proj`` part: the output gate (Qwen3-Next), which is the projection's input, and the projection."""
        if gate is not None:
            S, B = out.shape[:2]
            out = output_gate(out, gate.reshape(S, B, -1))
        return self.o_proj(out)

    def forward(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None) -> Tensor:
        q, gate, k, v = self.regions.qkv_linear(self._project_in, x, position_ids, documents)
        out = self.regions.core_attn(self.core, q, k, v, position_ids, self.sinks, documents)
        return self.regions.attn_proj(self._project_out, out, gate)

    def extra_repr(self) -> str:
        return (f"heads={self.local_heads}/{self.config.num_heads}, kv_heads={self.local_kv_heads}/"
                f"{self.config.kv_heads}{' (replicated)' if self.kv_replicated else ''}, head_dim={self.head_dim}, "
                f"qk_norm={self.config.qk_norm and self.config.qk_norm_scope.value}, "
                f"sliding_window={self.config.sliding_window}, sinks={self.config.sinks}, "
                f"{'output_gate, ' if self.config.output_gate else ''}"
                f"rotary_dim={self.config.rotary_dim_resolved}, "
                f"sp={self.sequence_parallel}{', recompute core_attn' if recomputes(self.regions.core_attn) else ''}")
