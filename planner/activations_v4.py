"""DeepSeek-V4's activation memory per layer (``planner.profile`` uses it for a config with a ``v4`` section).

What ``dense.compressed_attention.CompressedAttention`` keeps for its backward for one micro-batch (whole sequence
and every head on the rank: V4 refuses tp and cp), read off its code:

- the low-rank query: ``q_a_proj``'s output (the ``q_a_norm`` input, fp32 norm tensors), ``q_b_proj``'s output and
  the per-head RMS and its rotated result; the one KV head: ``kv_proj``'s output, its norm, the rotated ``[T, D]``;
- a compressed layer's compressor: its KV / gate projections (twice as wide for the overlapping compressed sparse
  one) and the ``[B, S / rate, D]`` entries; a compressed sparse layer's int64 picks ``[B, S, k]`` (the lightning
  indexer runs without autograd, ``query_chunk`` queries at a time: its scores are transient);
- the scores: none kept. The core attention runs ``query_chunk`` (C) queries at a time under a checkpoint, each
  block reading the band of ``C + window - 1`` keys and its entries (compressed sparse: each query's k picks,
  gathered ``[B, C, k, D]``; heavily compressed: the closed entries): its ``[B, heads, C, band + entries + 1]``
  scores live only inside the block, in the forward and again in the backward's recompute;
- the output: its rotated-back ``[T, heads, D]``, the grouped projection's input and ``o_b_proj``'s input.

Each ``HyperConnection`` (two per block) keeps the flattened fp32 streams ``[T, N H]``, their RMS, the map's
``[T, (2 + N) N]`` output, each Sinkhorn pass's ``[T, N, N]`` (normalised and divisor), and the mix-back keeps the
streams ``[T, N, H]`` and the sub-layer's output; the residual's gradient is ``N`` streams wide.
"""

from __future__ import annotations

from moefold.planner.activations import ActivationShape, Part

V4_QUERY_CHUNK = 512   # dense.compressed_attention.V4AttentionConfig.query_chunk's default (torch-free here)


def v4_attention(shape: ActivationShape, index: int) -> Part:
    """Layer ``index``'s compressed attention after its input norm (module docstring)."""
    m, a, T, B, S = shape.model, shape.a, shape.T_c, shape.micro_batch, shape.S_c
    v4, H, nh, D = m.v4, m.hidden_size, m.num_attention_heads, m.head_dim
    kind = v4.attention_kinds[index]
    rate = v4.rate(index)
    entries = 0 if kind == "sliding_attention" else S // rate
    saved = {"attention input (norm output)": a * T * H, "q_a_proj output": a * T * v4.q_lora_rank,
             **shape.norm(T, v4.q_lora_rank, "q_a_norm"), "q_b_proj output": a * T * nh * D,
             "q rms": 4 * T * nh, "q rotated": a * T * nh * D, "kv_proj output": a * T * D,
             **shape.norm(T, D, "kv_norm"), "kv rotated": a * T * D, "rope cos/sin": 2 * 4 * S * v4.rope_head_dim,
             "attention output (rotated back)": a * T * nh * D, "o_b_proj input": a * T * v4.o_groups * v4.o_lora_rank}
    chunk = min(V4_QUERY_CHUNK, S)
    read = entries                         # heavily compressed: the last block reads every closed entry
    gathered = 0
    if kind == "compressed_sparse_attention":
        read = min(v4.index_topk, entries)
        gathered = a * B * chunk * read * D
        saved["indexer picks (int64)"] = 8 * B * S * read
    if entries:
        width = 2 * D * (2 if kind == "compressed_sparse_attention" else 1)
        saved.update({"compressor projections": a * T * width, "compressed entries": a * B * entries * D})
    # one block's scores: forward, the masked logits, their concatenation and its shifted copy beside the softmax;
    # backward, the recomputed probabilities (softmax keeps only its output) and two gradients of that size, the
    # gathered entries and their gradient
    scores = a * B * nh * chunk * (min(chunk + v4.sliding_window - 1, S) + read + 1)
    fwd = 3 * scores + gathered
    grads = 3 * scores + 2 * gathered + a * T * nh * D * 3
    return Part("attention", saved, fwd_extra=fwd, bwd_extra=grads, offload=dict.fromkeys(saved, ("core_attn",)))


def v4_streams(model) -> int:
    """The residual streams a block hands on (and a pipeline stage sends): ``hc_mult`` for V4, else 1."""
    return model.v4.hc_mult if model.v4 is not None else 1


def v4_hyper(shape: ActivationShape, prefix: str) -> dict[str, int]:
    """One ``HyperConnection`` and its mix-back (module docstring)."""
    m, a, T = shape.model, shape.a, shape.T_c
    N, H, iters = m.v4.hc_mult, m.hidden_size, m.v4.hc_sinkhorn_iters
    return {f"{prefix} streams (fp32)": 4 * T * N * H, f"{prefix} rms": 4 * T,
            f"{prefix} map output": 4 * T * (2 + N) * N, f"{prefix} sinkhorn": 2 * 4 * T * N * N * (2 * iters),
            f"{prefix} mix streams": a * T * N * H, f"{prefix} mix sub-layer output": a * T * H}


__all__ = ["V4_QUERY_CHUNK", "v4_attention", "v4_hyper", "v4_streams"]
