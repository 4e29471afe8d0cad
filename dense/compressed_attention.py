"""DeepSeek-V4's attention: shared-KV MQA over a sliding window plus, per layer, compressed KV entries.

Per layer kind (``V4AttentionKind``; HF ``layer_types``):

- ``SLIDING``: each query attends to the last ``window`` tokens (itself included);
- ``HEAVILY_COMPRESSED`` (HCA): and to every closed entry of a ``KVCompressor`` at rate m' (128 in V4);
- ``COMPRESSED_SPARSE`` (CSA): and to the ``index_topk`` closed entries of an overlapping compressor at rate m
  (4 in V4) that its lightning indexer (``CompressedIndexer``) picks.

The rest as transformers' ``DeepseekV4Attention``: queries through a low-rank ``q_a_proj`` -> ``q_a_norm`` ->
``q_b_proj`` and an unweighted RMS norm per head; one KV head (``kv_proj`` -> ``kv_norm``) read as key and value;
interleaved RoPE on each head's trailing ``rope_dim`` channels (the sliding layers at ``rope_theta``, the
compressed ones at ``compress_rope_theta`` with ``compress_yarn`` when set), undone on the output at the query's
position; a learned sink logit per head (``sinks``); a grouped output projection (``o_a_proj``: ``o_groups`` blocks
to ``o_lora_rank`` each, then ``o_b_proj``). Training form: the whole sequence, positions 0..S-1, no cache.

``forward(x [S, B, H], position_ids [S]) -> [S, B, H]``. One rank holds the whole sequence and every head:
nothing crosses ranks (the model refuses tp and cp for this attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from moefold.dense.kv_compression import (
    CompressedIndexer,
    KVCompressor,
    entries_bias,
    interleaved_cos_sin,
    interleaved_rope,
)
from moefold.dense.norm import RMSNorm
from moefold.dense.rope import RotaryEmbedding, YarnConfig
from moefold.parallel.sharding import normal_init, set_init


class V4AttentionKind(StrEnum):
    """HF ``layer_types`` values."""

    SLIDING = "sliding_attention"
    COMPRESSED_SPARSE = "compressed_sparse_attention"
    HEAVILY_COMPRESSED = "heavily_compressed_attention"


@dataclass(frozen=True)
class V4AttentionConfig:
    """The attention's sizes (HF ``DeepseekV4Config`` names). ``rate``: the layer kind's compression rate (HF
    ``compress_rates[kind]``; unused for ``SLIDING``); ``rope_dim``: RoPE'd channels per head."""

    hidden: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_dim: int
    window: int
    kind: V4AttentionKind = V4AttentionKind.SLIDING
    rate: int = 1
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnConfig | None = None   # YaRN of the compressed layers' rope (HF: only theirs)
    index_heads: int = 1
    index_head_dim: int = 2
    index_topk: int = 1
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", V4AttentionKind(self.kind))
        for name in ("hidden", "heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window", "rate"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"V4AttentionConfig: {name}={value!r} must be a positive integer")
        if self.heads % self.o_groups:
            raise ValueError(f"V4AttentionConfig: num_attention_heads={self.heads} must be a multiple of "
                             f"o_groups={self.o_groups}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"V4AttentionConfig: the rotary dims {self.rope_dim} (head_dim x partial_rotary_factor)"
                             f" must be even and in (0, head_dim={self.head_dim}]")


class CompressedAttention(nn.Module):
    """One V4 attention layer (module docstring); parameter names as HF's (``compressor``, ``compressor.indexer``)."""

    def __init__(self, config: V4AttentionConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        c = self.config = config
        std = c.init_std
        self.q_a_proj = nn.Linear(c.hidden, c.q_lora_rank, bias=False, device=device)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.norm_eps, device=device)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.heads * c.head_dim, bias=False, device=device)
        self.kv_proj = nn.Linear(c.hidden, c.head_dim, bias=False, device=device)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps, device=device)
        # grouped output projection: o_groups blocks [o_lora_rank, heads * head_dim / o_groups] stacked
        self.o_a_proj = nn.Linear(c.heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False,
                                  device=device)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden, bias=False, device=device)
        for lin in (self.q_a_proj, self.q_b_proj, self.kv_proj, self.o_a_proj, self.o_b_proj):
            set_init(lin.weight, normal_init(std))
        self.sinks = nn.Parameter(torch.zeros(c.heads, dtype=torch.float32, device=device))
        compressed = c.kind is not V4AttentionKind.SLIDING
        self.rotary = RotaryEmbedding(c.rope_dim, c.compress_rope_theta if compressed else c.rope_theta,
                                      c.compress_yarn if compressed else None, device=device)
        rope = {"rope_dim": c.rope_dim, "rope_theta": c.compress_rope_theta, "yarn": c.compress_yarn,
                "norm_eps": c.norm_eps, "init_std": std, "device": device}
        self.compressor: KVCompressor | None = None
        if c.kind is not V4AttentionKind.SLIDING:
            self.compressor = KVCompressor(c.hidden, c.head_dim, c.rate,
                                           overlap=c.kind is V4AttentionKind.COMPRESSED_SPARSE, **rope)
        if c.kind is V4AttentionKind.COMPRESSED_SPARSE:
            self.compressor.indexer = CompressedIndexer(c.hidden, c.q_lora_rank, c.index_heads, c.index_head_dim,
                                                        c.rate, c.index_topk, **rope)

    def forward(self, x_SBH: Tensor, position_ids: Tensor) -> Tensor:
        c = self.config
        s, b, _ = x_SBH.shape
        # (a meta build, which the device-build checks run, has no values to check)
        if position_ids.device.type != "meta" and not torch.equal(position_ids.cpu(), torch.arange(s)):
            raise ValueError("CompressedAttention: the compressed windows need positions 0..S-1 (the whole "
                             "sequence on this rank, no packed documents)")
        x = x_SBH.transpose(0, 1)                                                # [B, S, H]
        cos, sin = interleaved_cos_sin(self.rotary, torch.arange(s, device=x.device))
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(b, s, c.heads, c.head_dim).transpose(1, 2)   # [B, N, S, D]
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + c.norm_eps).to(q.dtype)
        q = interleaved_rope(q, cos, sin)
        kv = interleaved_rope(self.kv_norm(self.kv_proj(x)), cos, sin)          # [B, S, D]
        bias = _sliding_bias(s, c.window, x.device, q.dtype).expand(b, s, s)
        if self.compressor is not None:
            entries = self.compressor(x)                                         # [B, T, D]
            indexer = getattr(self.compressor, "indexer", None)
            selected = indexer.select(x, q_residual) if indexer is not None else None
            kv = torch.cat([kv, entries], dim=1)
            bias = torch.cat([bias, entries_bias(s, entries.shape[1], c.rate, selected, x.device,
                                                 q.dtype).expand(b, s, -1)], dim=-1)
        logits = torch.matmul(q, kv.unsqueeze(1).transpose(-1, -2)) * c.head_dim ** -0.5 + bias.unsqueeze(1)
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1, 1).expand(b, -1, s, 1)
        logits = torch.cat([logits, sinks], dim=-1)
        probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        out = torch.matmul(probs.to(kv.dtype), kv.unsqueeze(1))                 # [B, N, S, D]
        out = interleaved_rope(out, cos, -sin).transpose(1, 2)                  # [B, S, N, D]: undo the V rotation
        grouped = out.reshape(b, s, c.o_groups, -1)
        w = self.o_a_proj.weight.view(c.o_groups, c.o_lora_rank, -1)
        mixed = torch.einsum("bsgi,goi->bsgo", grouped, w).flatten(2)
        return self.o_b_proj(mixed).transpose(0, 1)

    def extra_repr(self) -> str:
        c = self.config
        return f"kind={c.kind.value}, heads={c.heads}, head_dim={c.head_dim}, window={c.window}, rate={c.rate}"


def _sliding_bias(seq_len: int, window: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[1, S, S]: 0 where ``t - window < j <= t``, -inf elsewhere."""
    t = torch.arange(seq_len, device=device)
    visible = (t.view(1, -1) <= t.view(-1, 1)) & (t.view(1, -1) > t.view(-1, 1) - window)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf")).unsqueeze(0)


__all__ = ["CompressedAttention", "V4AttentionConfig", "V4AttentionKind"]
