"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) in the activation model: ``dense.dsa.DSAttention``'s tensors.

What one DSA layer keeps for its backward on one rank (``h = heads / tp``; MLA's latents ``r`` = ``kv_lora_rank``,
``R`` = rope, query latent ``q``; the indexer's ``n`` heads of ``d``, replicated over tp; ``K = index_topk``), read
off its code and the tensors a built layer saves (the whole peak against the trainer's measured one:
``tests/planner/test_memory_dsa.py``):

- MLA's projections: the input, the query latent (``q_a_proj``'s output, its norm's fp32 tensors, the latent the
  up-projection and the indexer read), ``q_b_proj``'s output ``[T, h, nope + R]``, ``kv_a``'s output and the
  latent norm's tensors, the latent keys ``[T, r + R]``; RoPE's cos/sin;
- the absorbed form: the queries ``[T, h, r + R]`` (``kv_b_proj``'s key half folded in) and the sparse attention's
  output ``[T, h, r]`` (``kv_b_proj``'s value half applied after); nothing of the scores: each 512-query block runs
  under a checkpoint (its gathered ``[chunk, K, r + R]`` latents and ``[chunk, h, K]`` scores recomputed in the
  backward);
- the indexer: its queries ``[T, n, d]``, head weights ``[T, n]`` (fp32), keys ``[T, d]``, the picks ``[T, K]``
  (int64) and their validity (bool), the loss's target ``[T, K]`` (fp32: the probabilities summed over heads).

Transient: one block's gathered latents, scores and probabilities (forward; again with their gradients in the
backward, with the loss's gathered indexer keys ``[chunk, K, d]``), and the indexer's fp32 scores of a block
against every key ``[chunk, n, S]`` and their ReLU. Selective recompute's modules are not applied to this layer's
counts.
"""

from __future__ import annotations

from moefold.planner.activations import ActivationShape, Part

DSA_QUERY_CHUNK = 512   # dense.dsa_indexer.DSAConfig.query_chunk's default


def dsa_attention(shape: ActivationShape) -> Part:
    """``DSAttention`` after its input norm (module docstring)."""
    m, a, T, B, S = shape.model, shape.a, shape.T_c, shape.micro_batch, shape.S_c
    mla, dsa, H = m.mla, m.dsa, m.hidden_size
    h, r, R, q = m.num_attention_heads // shape.tp, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank
    n, d = dsa.index_n_heads, dsa.index_head_dim
    keys = S * shape.cp   # every cp rank's latents, gathered in position order
    K = min(dsa.index_topk, keys)
    saved = {"attention input (norm output)": a * T * H, "q_a_proj output": a * T * q,
             **shape.norm(T, q, "q_a_layernorm"), "query latent": a * T * q,
             "q_b_proj output": a * T * h * (mla.qk_nope_head_dim + R), "kv_a_proj output": a * T * (r + R),
             **shape.norm(T, r, "kv_a_layernorm"), "latent keys": a * B * keys * (r + R),
             "rope cos/sin": 2 * 4 * S * R,
             "absorbed queries": a * T * h * (r + R), "sparse attention output": a * T * h * r,
             "indexer queries": a * T * n * d, "indexer weights (fp32)": 4 * T * n, "indexer keys": a * B * keys * d,
             "indexer picks (int64), valid": 9 * T * K}
    if dsa.loss_coeff > 0:
        saved["indexer loss target (fp32)"] = 4 * T * K
    chunk = B * min(DSA_QUERY_CHUNK, S)
    gathered = a * chunk * K * (r + R)
    scores = 4 * chunk * h * K
    indexer_scores = 2 * 4 * chunk * n * keys   # the scores and their ReLU
    fwd = max(gathered + 3 * scores, indexer_scores)
    bwd = 2 * gathered + 4 * scores + (2 * a * chunk * K * d if dsa.loss_coeff > 0 else 0) + a * T * h * (r + R)
    return Part("attention", saved, fwd_extra=fwd, bwd_extra=bwd, offload=dict.fromkeys(saved, ("core_attn",)))


__all__ = ["DSA_QUERY_CHUNK", "dsa_attention"]
