"""DeepSeek-V4's compressed KV (section 2.3): the heavily compressed and the compressed sparse branches.

A ``KVCompressor`` turns every closed window of ``rate`` tokens into one KV entry: a softmax-gated sum of the
window's projected tokens (gate logits plus a learned per-slot ``position_bias``), RMS-normalised, with the
interleaved RoPE at the window's first position. Query t sees entry w only once its window has closed,
``w < (t + 1) // rate``.

- heavily compressed attention (HCA, ``overlap=False``, rate m' = 128 in V4): windows side by side; every query
  sees every closed entry;
- compressed sparse attention (CSA, ``overlap=True``, rate m = 4): each token projects two series; entry w mixes
  window w-1's first series with window w's second (``2 * rate`` slots, stride ``rate``; window 0's missing half
  has weight 0), and a ``CompressedIndexer`` (the lightning indexer, on its own smaller compressor) keeps each
  query's ``topk`` best closed entries: the attention reads only those.

The math is transformers' ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` / ``DeepseekV4Indexer`` in
training form (the whole sequence at once, no cache). Tensors are batch-first ``[B, S, ...]`` here; nothing
crosses ranks (one rank holds the whole sequence: the attention refuses tp and cp).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from moefold.dense.norm import RMSNorm
from moefold.dense.rope import RotaryEmbedding, YarnConfig
from moefold.parallel.sharding import normal_init, set_init


def interleaved_cos_sin(rotary: RotaryEmbedding, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin ``[..., rope_dim / 2]`` fp32 (one angle per interleaved pair; YaRN's factor applied when set)."""
    cos, sin = rotary(positions)
    half = rotary.dim // 2
    return cos[..., :half], sin[..., :half]


def interleaved_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of x in interleaved pairs (V4's ``[nope | rope]`` heads);
    cos/sin broadcast against x's leading dims (``[S, R/2]`` for ``[..., S, D]``). fp32 math, x's dtype out."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = rope.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def closed_entries(seq_len: int, rate: int, device: torch.device) -> Tensor:
    """int64 [S]: how many compressed entries query t may see, ``(t + 1) // rate``."""
    return (torch.arange(seq_len, device=device) + 1) // rate


class KVCompressor(nn.Module):
    """Windows of ``rate`` tokens -> entries of width ``head_dim`` (module docstring). HF names: ``kv_proj``,
    ``gate_proj`` [(1 or 2) * head_dim, H], ``position_bias`` [rate, (1 or 2) * head_dim] fp32, ``kv_norm``.

    ``forward(x [B, S, H], positions [S]) -> [B, S // rate, head_dim]`` (RoPE on the trailing ``rope_dim``)."""

    def __init__(self, hidden: int, head_dim: int, rate: int, *, overlap: bool, rope_dim: int, rope_theta: float,
                 yarn: YarnConfig | None = None, norm_eps: float = 1e-6, init_std: float = 0.02,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(rate, int) or rate < 1:
            raise ValueError(f"KVCompressor: rate={rate!r} must be a positive integer")
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(f"KVCompressor: rope_dim={rope_dim} must be even and in (0, head_dim={head_dim}]")
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        # HF's "compress" rope (YaRN when set)
        self.rotary = RotaryEmbedding(rope_dim, rope_theta, yarn, device=device)
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(hidden, width, bias=False, device=device)
        self.gate_proj = nn.Linear(hidden, width, bias=False, device=device)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32, device=device))
        self.kv_norm = RMSNorm(head_dim, norm_eps, device=device)
        for lin in (self.kv_proj, self.gate_proj):
            set_init(lin.weight, normal_init(init_std))

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        n, m, d = s // self.rate, self.rate, self.head_dim
        if n == 0:
            return x.new_zeros(b, 0, d)
        kv = self.kv_proj(x[:, :n * m]).view(b, n, m, -1)
        gate = self.gate_proj(x[:, :n * m]).view(b, n, m, -1) + self.position_bias
        if self.overlap:   # slots [0, m): window w-1's first series; [m, 2m): window w's second
            first_kv = torch.cat([kv.new_zeros(b, 1, m, d), kv[:, :-1, :, :d]], dim=1)
            first_gate = torch.cat([gate.new_full((b, 1, m, d), float("-inf")), gate[:, :-1, :, :d]], dim=1)
            kv = torch.cat([first_kv, kv[..., d:]], dim=2)
            gate = torch.cat([first_gate, gate[..., d:]], dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        cos, sin = interleaved_cos_sin(self.rotary, torch.arange(n, device=x.device) * m)
        return interleaved_rope(self.kv_norm(pooled), cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rate={self.rate}, overlap={self.overlap}"


class IndexScorer(nn.Module):
    """``sum_h w_{t,h} ReLU(q_{t,h} . k_s) / sqrt(c)``, ``w = weights_proj(x) / sqrt(heads)`` (HF's scorer)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, init_std: float = 0.02, *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.softmax_scale, self.weights_scaling = head_dim ** -0.5, heads ** -0.5
        self.weights_proj = nn.Linear(hidden, heads, bias=False, device=device)
        set_init(self.weights_proj.weight, normal_init(init_std))

    def forward(self, q_BSNC: Tensor, keys_BTC: Tensor, x_BSH: Tensor) -> Tensor:
        scores = torch.matmul(q_BSNC.float(), keys_BTC.transpose(-1, -2).float().unsqueeze(1))   # [B, S, N, T]
        weights = self.weights_proj(x_BSH).float() * self.weights_scaling
        return (F.relu(scores) * self.softmax_scale * weights.unsqueeze(-1)).sum(dim=2)          # [B, S, T]


class CompressedIndexer(KVCompressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at ``head_dim`` c (the parent's
    parameters, HF's names), queries from the attention's q low-rank residual (``q_b_proj`` [heads * c, q_rank])
    with RoPE at their positions, and each query's ``topk`` best closed entries.
    ``select(x [B, S, H], q_residual [B, S, R]) -> int64 [B, S, k]`` (k = min(topk, entries); -1 where fewer
    entries are closed)."""

    def __init__(self, hidden: int, q_rank: int, heads: int, head_dim: int, rate: int, topk: int, *, rope_dim: int,
                 rope_theta: float, yarn: YarnConfig | None = None, norm_eps: float = 1e-6,
                 init_std: float = 0.02, device: torch.device | str | None = None) -> None:
        super().__init__(hidden, head_dim, rate, overlap=True, rope_dim=rope_dim, rope_theta=rope_theta, yarn=yarn,
                         norm_eps=norm_eps, init_std=init_std, device=device)
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"CompressedIndexer: index_topk={topk!r} must be a positive integer")
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_rank, heads * head_dim, bias=False, device=device)
        set_init(self.q_b_proj.weight, normal_init(init_std))
        self.scorer = IndexScorer(hidden, heads, head_dim, init_std, device=device)

    @torch.no_grad()
    def select(self, x: Tensor, q_residual: Tensor, query_chunk: int = 512) -> Tensor:
        """Each query's picks; without autograd (the top-k passes no gradient, as in transformers) and
        ``query_chunk`` queries at a time, so the scores are ``[B, chunk, heads, T]``, never ``[B, S, heads, T]``."""
        b, s, _ = x.shape
        keys = self(x)
        t = keys.shape[1]
        cos, sin = interleaved_cos_sin(self.rotary, torch.arange(s, device=x.device))
        closed = closed_entries(s, self.rate, x.device).view(1, s, 1)
        picks = []
        for s0 in range(0, s, query_chunk):
            sl = slice(s0, s0 + query_chunk)
            q = self.q_b_proj(q_residual[:, sl]).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
            q = interleaved_rope(q, cos[sl], sin[sl]).transpose(1, 2)           # [B, C, n, c]
            scores = self.scorer(q, keys, x[:, sl])
            scores = scores.masked_fill(torch.arange(t, device=x.device).view(1, 1, t) >= closed[:, sl],
                                        float("-inf"))
            ids = scores.topk(min(self.topk, t), dim=-1).indices
            picks.append(torch.where(ids >= closed[:, sl], torch.full_like(ids, -1), ids))
        return torch.cat(picks, dim=1)


__all__ = ["CompressedIndexer", "IndexScorer", "KVCompressor", "closed_entries",
           "interleaved_cos_sin", "interleaved_rope"]
