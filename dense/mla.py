"""DeepSeek-V3 multi-latent attention (MLA), HF ``DeepseekV3Attention`` semantics, with TP/SP/CP.

Parameters map 1:1 onto HF names (weights ``[out, in]``):

- down-projections ``q_a_proj`` (if ``q_lora_rank``), ``kv_a_proj_with_mqa`` and the latent norms
  ``q_a_layernorm``, ``kv_a_layernorm`` are replicated over TP. They run on the block input as
  it is (the sequence shard under SP, so their gradients are partial and marked
  ``mark_sequence_parallel``; without SP every rank computes the same complete gradient),
  and only the small latents are all-gathered, not the hidden states.
- up-projections ``q_proj``/``q_b_proj`` and ``kv_b_proj`` are column-parallel, split by heads
  (output layout head-major ``[heads, nope + rope]`` / ``[heads, nope + v]`` as HF).
- ``o_proj`` row-parallel.

The decoupled RoPE key (``qk_rope_head_dim`` wide, one head) is shared by all heads: it is
all-gathered under SP (else enters through ``copy_to_region``) because every rank's heads use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moefold.dense.attention import AttentionRegions
from moefold.dense.attention_config import MLAConfig
from moefold.dense.choices import Recompute
from moefold.dense.core_attention import CoreAttention
from moefold.dense.documents import Documents
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.norm import RMSNorm
from moefold.dense.regions import (
    CHECKPOINT,
    KEEP_OUTPUT,
    OUTPUT_KIND,
    PLAIN,
    OpenedOutput,
    OutputRegion,
    Region,
    replace_regions,
)
from moefold.dense.rope import RotaryEmbedding, apply_rotary, yarn_softmax_mscale
from moefold.parallel.comm import all_gather_sequence, copy_to_region
from moefold.parallel.groups import Group, group_size
from moefold.parallel.sharding import mark_sequence_parallel


@dataclass(frozen=True)
class MLARegions(AttentionRegions):
    """An attention's three regions, and ``up_proj`` (an output region): the q/kv up-projections with RoPE,
    whose outputs core attention saves (Megatron's ``mla_up_proj``)."""

    up_proj: OutputRegion = field(default=KEEP_OUTPUT, metadata=OUTPUT_KIND)


class MLAttention(nn.Module):
    """forward(x ``[S/tp, B, H]`` with SP else ``[S, B, H]``, position_ids ``[S]``, documents (``dense.documents``,
    or None: attention inside each packed document)) -> same shape as x.

    ``S`` is this rank's sequence (its CP part; ``position_ids`` are the true global positions).
    Crosses ranks: tp (latent all-gathers / output reduce-scatter under SP, else the region
    all-reduces) and cp (K/V exchange, see ``dense.context_parallel``).
    """

    def __init__(self, config: MLAConfig, tp_group: Group = None, cp_group: Group = None, *,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        tp, cp = group_size(tp_group), group_size(cp_group)
        config.check_parallel(tp, cp)
        c = config
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        self.local_heads = c.num_heads // tp
        sp = sequence_parallel
        kw = {"init_std": c.init_std, "dtype": dtype, "device": device}
        up = {"sequence_parallel": sp, **kw}
        latent_eps = c.norm_eps if c.latent_norm_eps is None else c.latent_norm_eps
        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, c.num_heads * c.qk_head_dim, tp_group, **up)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = self._replicated(c.hidden_size, c.q_lora_rank, kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, latent_eps, sequence_parallel=sp, dtype=dtype, device=device)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, c.num_heads * c.qk_head_dim, tp_group, **up)
        self.kv_a_proj_with_mqa = self._replicated(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, latent_eps, sequence_parallel=sp, dtype=dtype, device=device)
        self.kv_b_proj = ColumnParallelLinear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                              tp_group, **up)
        self.o_proj = RowParallelLinear(c.num_heads * c.v_head_dim, c.hidden_size, tp_group, bias=c.bias,
                                        sequence_parallel=sp, **kw)
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.yarn, device=device)
        scale = c.qk_head_dim ** -0.5 * yarn_softmax_mscale(c.yarn)
        self.core = CoreAttention(scale, cp_group=cp_group, cp_comm=c.cp_comm)
        # selective recompute of core attention by default (``config.recompute``); moefold.execution reconfigures it
        self.regions = MLARegions(core_attn=CHECKPOINT if c.recompute is Recompute.SELECTIVE else PLAIN)

    def configure(self, **regions: Region | OutputRegion) -> None:
        """Install regions by name (``MLARegions``); ValueError for an unknown name or a wrong kind."""
        self.regions = replace_regions(self.regions, "MLAttention", **regions)

    def _replicated(self, in_features: int, out_features: int, kw: dict) -> ColumnParallelLinear:
        """A TP-replicated down-projection (HF ``attention_bias`` applies)."""
        layer = ColumnParallelLinear(in_features, out_features, None, bias=self.config.bias, **kw)
        if self.sequence_parallel:
            for p in layer.parameters():
                mark_sequence_parallel(p)
        return layer

    def _project_in(self, x: Tensor, position_ids: Tensor, up: OpenedOutput, documents: Documents | None = None,
                    ) -> tuple[Tensor, Tensor, Tensor]:
        """The ``qkv_linear`` part: down-projections, latent norms, and the up-projections with RoPE run in ``up``."""
        c = self.config
        q_in = x if self.q_proj is not None else self.q_a_layernorm(self.q_a_proj(x))
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_in = self.kv_a_layernorm(kv_latent)
        # the shared rope key feeds every rank's heads: its gradient is partial per rank
        if self.sequence_parallel:
            k_rot = all_gather_sequence(k_rot, self.tp_group, 0)
        else:
            k_rot = copy_to_region(k_rot, self.tp_group)
        S = k_rot.shape[0]
        if position_ids.shape != (S,):
            raise ValueError(f"MLAttention: position_ids {tuple(position_ids.shape)} must be [{S}] "
                             "(one global position per token of this rank's sequence, before the SP split)")
        cos, sin = self.rotary(position_ids if documents is None else
                               documents.rope_positions(position_ids, k_rot.shape[1]))
        return up.run(self._up_project, q_in, kv_in, k_rot, cos, sin)

    def forward(self, x: Tensor, position_ids: Tensor, documents: Documents | None = None) -> Tensor:
        up = self.regions.up_proj.open()
        q, k, v = self.regions.qkv_linear(self._project_in, x, position_ids, up, documents)
        out = self.regions.core_attn(self.core, q, k, v, position_ids, None, documents)
        up.consumed(out)   # q, k, v may be freed now that core attention saved them, recomputed before its backward
        return self.regions.attn_proj(self.o_proj, out)

    def _up_project(self, q_in: Tensor, kv_in: Tensor, k_rot: Tensor, cos: Tensor, sin: Tensor,
                    ) -> tuple[Tensor, Tensor, Tensor]:
        """Latents -> per-head q, k, v with RoPE applied (Megatron's ``mla_up_proj`` region)."""
        c, h = self.config, self.local_heads
        q = self.q_proj(q_in) if self.q_proj is not None else self.q_b_proj(q_in)
        S, B = q.shape[:2]
        q_nope, q_rot = q.view(S, B, h, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(kv_in).view(S, B, h, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        q_rot = apply_rotary(q_rot, cos, sin, interleaved=c.rope_interleave)
        k_rot = apply_rotary(k_rot.view(S, B, 1, c.qk_rope_head_dim), cos, sin, interleaved=c.rope_interleave)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(S, B, h, c.qk_rope_head_dim)], dim=-1)
        return q, k, v.contiguous()

    def extra_repr(self) -> str:
        return (f"heads={self.local_heads}/{self.config.num_heads}, q_lora_rank={self.config.q_lora_rank}, "
                f"kv_lora_rank={self.config.kv_lora_rank}, sp={self.sequence_parallel}")
