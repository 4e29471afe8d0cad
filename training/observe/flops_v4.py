"""DeepSeek-V4's multiply-adds per token (``models.v4_dims``): what MFU and ``moefold plan`` count for its layers.

Per layer (``dense.compressed_attention``, ``dense.kv_compression``, ``dense.hyper_connections``), for one token of a
``seq_len`` sequence:

- projections: the low-rank query (``H x q_lora_rank + q_lora_rank x heads x head_dim``), the one shared KV head
  (``H x head_dim``), the grouped output projection (``heads x head_dim x o_lora_rank`` then
  ``o_groups x o_lora_rank x H``);
- the compressor of a compressed layer: its KV and gate projections (``H x 2 x head_dim``, twice as wide for the
  overlapping compressed sparse one); a compressed sparse layer's indexer: its own compressor (``H x 4 x
  index_head_dim``), query (``q_lora_rank x index_n_heads x index_head_dim``), head weights (``H x index_n_heads``)
  and its scores over every closed entry of the causal context (``index_n_heads x index_head_dim`` each);
- core attention: every head scores and sums ``head_dim`` wide keys over the window (``min(position + 1,
  sliding_window)``) and the compressed entries it reads: a compressed sparse layer's ``min(closed entries,
  index_topk)``, a heavily compressed layer's every closed entry (``position / rate`` on average);
- the mHC: two hyper-connections per block (their coefficient map ``(2 + N) N x N H``, the collapse and the
  mix-back, ``N H + N^2 H + N H``).

``v4_score_macs`` is the core attention alone (what the planner times as core attention).
"""

from __future__ import annotations

from functools import lru_cache

from moefold.models.config import ModelConfig


@lru_cache(maxsize=256)
def _mean_min(seq_len: int, cap: float, rate: int = 1) -> float:
    """Mean over positions p = 0..S-1 of ``min(closed(p), cap)``, closed(p) = (p + 1) // rate (rate 1: p + 1)."""
    return sum(min((p + 1) // rate, cap) for p in range(seq_len)) / seq_len


def v4_score_macs(c: ModelConfig, seq_len: int, index: int) -> float:
    """Core attention of layer ``index`` for one token: scores and values over the window and the entries read."""
    v4 = c.v4
    kind = v4.attention_kinds[index]
    entries = 0.0
    if kind == "compressed_sparse_attention":
        entries = _mean_min(seq_len, v4.index_topk, v4.csa_rate)
    elif kind == "heavily_compressed_attention":
        entries = _mean_min(seq_len, float("inf"), v4.hca_rate)
    return c.num_attention_heads * 2 * c.head_dim * (_mean_min(seq_len, v4.sliding_window) + entries)


def v4_attention_macs(c: ModelConfig, seq_len: int, index: int) -> float:
    """Layer ``index``'s attention, compressor, indexer and mHC multiply-adds for one token (module docstring)."""
    v4, H, nh, D = c.v4, c.hidden_size, c.num_attention_heads, c.head_dim
    proj = (H * v4.q_lora_rank + v4.q_lora_rank * nh * D + H * D + nh * D * v4.o_lora_rank
            + v4.o_groups * v4.o_lora_rank * H)
    kind = v4.attention_kinds[index]
    if kind != "sliding_attention":
        proj += H * 2 * D * (2 if kind == "compressed_sparse_attention" else 1)
    if kind == "compressed_sparse_attention":
        n, d = v4.index_n_heads, v4.index_head_dim
        proj += H * 4 * d + v4.q_lora_rank * n * d + H * n + n * d * _mean_min(seq_len, float("inf"), v4.csa_rate)
    N = v4.hc_mult
    hyper = 2 * ((2 + N) * N * N * H + N * H + N * N * H + N * H)
    return proj + v4_score_macs(c, seq_len, index) + hyper


def v4_head_macs(c: ModelConfig) -> float:
    """The final collapse of the streams (``hc_head``: ``N x N H`` and the weighted sum)."""
    N = c.v4.hc_mult
    return N * N * c.hidden_size + N * c.hidden_size


__all__ = ["v4_attention_macs", "v4_head_macs", "v4_score_macs"]
