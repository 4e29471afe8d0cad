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

Cost as the published design bounds it: ``query_chunk`` queries at a time under a checkpoint, each block scoring
only the band of ``chunk + window - 1`` keys that holds its windows and the entries it may read (HCA: the closed
ones; CSA: each query's gathered picks), one softmax over both and the sink. Nothing of size ``[S, S]`` exists; the
blocks' scores are recomputed in the backward, so what is kept is O(S) (CSA: plus the ``[B, S, k]`` picks).

``forward(x [S, B, H], position_ids [S]) -> [S, B, H]``. One rank holds the whole sequence and every head:
nothing crosses ranks (the model refuses tp and cp for this attention, and packed documents at start-up).
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
    interleaved_cos_sin,
    interleaved_rope,
)
from moefold.dense.norm import RMSNorm
from moefold.dense.recompute import checkpointed
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
    query_chunk: int = 512   # queries per checkpointed block: bounds the transient scores (not a model value)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", V4AttentionKind(self.kind))
        for name in ("hidden", "heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window", "rate",
                     "query_chunk"):
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
        # positions are 0..S-1 by construction: cp is refused (``check_v4_layout``) and so are packed documents'
        # restarted positions (``RunConfig.resolve``); only the shape is checked here (no device-to-host sync)
        if tuple(position_ids.shape) != (s,):
            raise ValueError(f"CompressedAttention: position_ids {tuple(position_ids.shape)} must be [{s}], the "
                             "positions 0..S-1 of the whole sequence")
        x = x_SBH.transpose(0, 1)                                                # [B, S, H]
        cos, sin = interleaved_cos_sin(self.rotary, torch.arange(s, device=x.device))
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(b, s, c.heads, c.head_dim).transpose(1, 2)   # [B, N, S, D]
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + c.norm_eps).to(q.dtype)
        q = interleaved_rope(q, cos, sin)
        kv = interleaved_rope(self.kv_norm(self.kv_proj(x)), cos, sin)          # [B, S, D]
        entries = selected = None
        if self.compressor is not None:
            entries = self.compressor(x)                                         # [B, S / rate, D]
            indexer = getattr(self.compressor, "indexer", None)
            if indexer is not None:
                selected = indexer.select(x, q_residual, c.query_chunk)          # [B, S, k], -1: none
        outs = []
        for s0 in range(0, s, c.query_chunk):
            s1 = min(s0 + c.query_chunk, s)
            picks = None if selected is None else selected[:, s0:s1]
            outs.append(checkpointed(self._attend, q[:, :, s0:s1], kv, entries, picks, s0))
        out = interleaved_rope(torch.cat(outs, dim=2), cos, -sin).transpose(1, 2)   # [B, S, N, D]: undo V's rotation
        grouped = out.reshape(b, s, c.o_groups, -1)
        w = self.o_a_proj.weight.view(c.o_groups, c.o_lora_rank, -1)
        mixed = torch.einsum("bsgi,goi->bsgo", grouped, w).flatten(2)
        return self.o_b_proj(mixed).transpose(0, 1)

    def _attend(self, q: Tensor, kv: Tensor, entries: Tensor | None, picks: Tensor | None, s0: int) -> Tensor:
        """Queries ``s0 .. s0 + C - 1``: q ``[B, N, C, D]``, the sequence's KV ``[B, S, D]``, the compressed entries
        ``[B, T, D]`` (None: sliding), the indexer's picks ``[B, C, k]`` (None: every closed entry) -> ``[B, N, C, D]``.

        Reads only what the queries may see: the band of ``C + window - 1`` keys ending at the chunk's last query,
        then the closed entries (HCA) or each query's gathered picks (CSA); one softmax over both and the sink.
        Scores ``[B, N, C, C + window - 1 + (T or k) + 1]``: O(S * (window + k)) for the sequence, O(S * S / rate)
        for HCA, as the published kernels; never ``[S, S]``."""
        c = self.config
        b, _, chunk, _ = q.shape
        scale = c.head_dim ** -0.5
        lo, hi = max(0, s0 - c.window + 1), s0 + chunk
        t = torch.arange(s0, hi, device=q.device).view(-1, 1)                   # query positions
        j = torch.arange(lo, hi, device=q.device).view(1, -1)                   # band key positions
        band = kv[:, lo:hi]                                                      # [B, L, D]
        logits = [torch.matmul(q, band.unsqueeze(1).transpose(-1, -2)).mul(scale)
                  .masked_fill((j > t) | (j <= t - c.window), float("-inf"))]   # [B, N, C, L]
        keys = None
        if entries is not None and picks is None:   # HCA: every entry closed for some query of the chunk
            keys = entries[:, :hi // c.rate]                                     # [B, E, D]
            hidden = torch.arange(keys.shape[1], device=q.device).view(1, -1) >= (t + 1) // c.rate
            logits.append(torch.matmul(q, keys.unsqueeze(1).transpose(-1, -2)).mul(scale).masked_fill(
                hidden, float("-inf")))
        elif picks is not None:                     # CSA: each query's own k picks, shared by its heads
            keys = _gather_entries(entries, picks)                              # [B, C, k, D]
            scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2))    # [B, C, N, k]
            logits.append(scores.transpose(1, 2).mul(scale).masked_fill((picks < 0).unsqueeze(1), float("-inf")))
        logits.append(self.sinks.to(q.dtype).view(1, -1, 1, 1).expand(b, -1, chunk, 1))
        full = torch.cat(logits, dim=-1)
        probs = F.softmax(full - full.max(dim=-1, keepdim=True).values, dim=-1).to(kv.dtype)
        p_band, p_entries = probs[..., :band.shape[1]], probs[..., band.shape[1]:-1]
        out = torch.matmul(p_band, band.unsqueeze(1))                           # [B, N, C, D]
        if keys is not None and picks is None:
            out = out + torch.matmul(p_entries, keys.unsqueeze(1))
        elif keys is not None:
            out = out + torch.matmul(p_entries.transpose(1, 2), keys).transpose(1, 2)
        return out

    def extra_repr(self) -> str:
        c = self.config
        return f"kind={c.kind.value}, heads={c.heads}, head_dim={c.head_dim}, window={c.window}, rate={c.rate}"


def _gather_entries(entries: Tensor, picks: Tensor) -> Tensor:
    """``entries[b, picks[b, c, k]]`` as ``[B, C, k, D]`` (a -1 pick reads entry 0, masked by the caller);
    ``index_select`` on the flattened rows, whose backward is one ``index_add``."""
    b, e, d = entries.shape
    if e == 0:
        return entries.new_zeros(*picks.shape, d)
    rows = picks.clamp(min=0) + torch.arange(b, device=picks.device).view(b, 1, 1) * e
    return entries.reshape(b * e, d).index_select(0, rows.reshape(-1)).view(*picks.shape, d)


__all__ = ["CompressedAttention", "V4AttentionConfig", "V4AttentionKind"]
