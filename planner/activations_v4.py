"""DeepSeek-V4's activation memory per layer (``planner.profile`` uses it for a config with a ``v4`` section).

What ``dense.compressed_attention.CompressedAttention`` keeps for its backward for one micro-batch (whole sequence
and every head on the rank: V4 refuses tp and cp), read off its code:

- the low-rank query: ``q_a_proj``'s output (the ``q_a_norm`` input, fp32 norm tensors), ``q_b_proj``'s output and
  the per-head RMS and its rotated result; the one KV head: ``kv_proj``'s output, its norm, the rotated ``[T, D]``;
- a compressed layer's compressor: its KV / gate projections (twice as wide for the overlapping compressed sparse
  one) and the ``[B, S / rate, D]`` entries (the lightning indexer keeps nothing: its top-k passes no gradient);
- the scores: computed densely over the window and every entry and masked, so the ``[B, heads, S, S + S / rate + 1]``
  probabilities (the masked softmax's output, which the value product keeps too; the additive mask is not kept);
- the output: its rotated-back ``[T, heads, D]``, the grouped projection's input and ``o_b_proj``'s input.

Each ``HyperConnection`` (two per block) keeps the flattened fp32 streams ``[T, N H]``, their RMS, the map's
``[T, (2 + N) N]`` output, each Sinkhorn pass's ``[T, N, N]`` (normalised and divisor), and the mix-back keeps the
streams ``[T, N, H]`` and the sub-layer's output; the residual's gradient is ``N`` streams wide.
"""

from __future__ import annotations

from moefold.planner.activations import ActivationShape, Part


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
             "attention probabilities": a * B * nh * S * (S + entries + 1),
             "attention output (rotated back)": a * T * nh * D, "o_b_proj input": a * T * v4.o_groups * v4.o_lora_rank}
    if entries:
        width = 2 * D * (2 if kind == "compressed_sparse_attention" else 1)
        saved.update({"compressor projections": a * T * width, "compressed entries": a * B * entries * D})
    scores = a * B * nh * S * (S + entries + 1)   # the logits beside their softmax
    grads = 2 * scores + a * T * nh * D * 3
    return Part("attention", saved, fwd_extra=scores, bwd_extra=grads, offload=dict.fromkeys(saved, ("core_attn",)))


def v4_hyper(shape: ActivationShape, prefix: str) -> dict[str, int]:
    """One ``HyperConnection`` and its mix-back (module docstring)."""
    m, a, T = shape.model, shape.a, shape.T_c
    N, H, iters = m.v4.hc_mult, m.hidden_size, m.v4.hc_sinkhorn_iters
    return {f"{prefix} streams (fp32)": 4 * T * N * H, f"{prefix} rms": 4 * T,
            f"{prefix} map output": 4 * T * (2 + N) * N, f"{prefix} sinkhorn": 2 * 4 * T * N * N * (2 * iters),
            f"{prefix} mix streams": a * T * N * H, f"{prefix} mix sub-layer output": a * T * H}


__all__ = ["v4_attention", "v4_hyper"]
