"""DeepSeek-V4 recipes: the published DeepSeek-V4-Flash, a single-GPU proxy and a CPU-sized tiny one.

``deepseek_v4`` is the ``config.json`` of ``deepseek-ai/DeepSeek-V4-Flash-Base`` as transformers 5.25 reads it
(``models.hf.deepseek_v4``; the transcription is in ``tests/models/test_deepseek_v4_recipes.py``): 43 layers, the
first two sliding-window only, then compressed sparse (rate 4) and heavily compressed (rate 128) attention
alternating; the first three MoE layers hash-routed; 4 mHC streams; the compressed layers' RoPE with YaRN (factor
16, cos/sin unscaled as transformers forces). Its MTP layer is not built: transformers' class has none.
"""

from __future__ import annotations

from moefold.models.config import ModelConfig, YarnScaling
from moefold.models.v4_dims import V4Dims


def _flash_kinds(num_layers: int) -> tuple[str, ...]:
    """Two sliding layers, then compressed sparse / heavily compressed alternating (DeepSeek-V4-Flash)."""
    return tuple("sliding_attention" if i < 2 else ("compressed_sparse_attention" if i % 2 == 0
                                                    else "heavily_compressed_attention") for i in range(num_layers))


def deepseek_v4() -> ModelConfig:
    """DeepSeek-V4-Flash (284B total): compressed sparse / heavily compressed attention, hash-routed MoE, mHC."""
    return ModelConfig(
        name="deepseek_v4", family="deepseek_v4", vocab_size=129280, hidden_size=4096, num_layers=43,
        num_attention_heads=64, num_query_groups=1, head_dim=512, rope_theta=10000.0,
        max_position_embeddings=1048576, norm_eps=1e-6,
        num_experts=256, moe_topk=6, moe_ffn_hidden_size=2048, moe_shared_expert_ffn_size=2048,
        moe_score_function="sqrtsoftplus", moe_norm_topk_prob=True, moe_topk_scaling_factor=1.5,
        moe_expert_bias=True, moe_activation_clamp=10.0, moe_aux_loss_coeff=0.0,
        v4=V4Dims(attention_kinds=_flash_kinds(43), num_hash_layers=3, csa_rate=4, hca_rate=128, q_lora_rank=1024,
                  o_groups=8, o_lora_rank=1024, rope_head_dim=64, sliding_window=128, compress_rope_theta=160000.0,
                  compress_yarn=YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, attention_factor=1.0),
                  index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20,
                  hc_eps=1e-6),
    )


def deepseek_v4_proxy() -> ModelConfig:
    """The published widths (hidden, heads, experts' size) at 4 layers and 16 experts: one of each attention kind,
    one hash-routed layer."""
    kinds = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             "compressed_sparse_attention")
    full = deepseek_v4()
    return full.with_(name="deepseek_v4_proxy", num_layers=4, num_experts=16,
                      v4=_replace(full.v4, attention_kinds=kinds, num_hash_layers=1))


def deepseek_v4_tiny() -> ModelConfig:
    """CPU-sized, every feature kept: each attention kind, a hash-routed layer, 4 mHC streams, compressed YaRN."""
    kinds = ("heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
             "heavily_compressed_attention")
    return deepseek_v4().with_(
        name="deepseek_v4_tiny", vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4, head_dim=16,
        max_position_embeddings=1024, num_experts=8, moe_topk=2, moe_ffn_hidden_size=32,
        moe_shared_expert_ffn_size=32,
        v4=V4Dims(attention_kinds=kinds, num_hash_layers=1, csa_rate=4, hca_rate=16, q_lora_rank=32, o_groups=2,
                  o_lora_rank=16, rope_head_dim=8, sliding_window=8, compress_rope_theta=160000.0,
                  compress_yarn=YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, attention_factor=1.0),
                  index_n_heads=2, index_head_dim=8, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6))


def _replace(v4: V4Dims, **changes: object) -> V4Dims:
    import dataclasses

    return dataclasses.replace(v4, **changes)


V4_RECIPES = (deepseek_v4, deepseek_v4_proxy, deepseek_v4_tiny)

__all__ = ["V4_RECIPES", "deepseek_v4", "deepseek_v4_proxy", "deepseek_v4_tiny"]
