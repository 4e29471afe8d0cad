"""Recipes: functions returning the published architectures, plus CPU-sized and proxy versions.

``*_tiny`` trains in minutes on a CPU (hidden 64, a few layers, 4-8 experts) while keeping
every architectural feature of its family; ``*_proxy`` keeps the true hidden and expert sizes
with few layers and fewer experts, for single-GPU benchmarking.
"""

from __future__ import annotations

from collections.abc import Callable

from moefold.models.config import DSADims, LinearAttentionDims, MLADims, ModelConfig, YarnScaling
from moefold.models.recipes_nemotron_h import RECIPES as NEMOTRON_H_RECIPES
from moefold.models.recipes_v4 import V4_RECIPES


# ----------------------------------------------------------------------------- DeepSeek-V3
def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3 (671B total, 37B active): MLA, sigmoid group-limited routing, MTP."""
    return ModelConfig(
        name="deepseek_v3", family="deepseek_v3",
        vocab_size=129280, hidden_size=7168, num_layers=61, num_attention_heads=128,
        attention="mla", mla=MLADims(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                     qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True),
        rope_theta=10000.0, max_position_embeddings=163840,
        yarn=YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0),
        norm_eps=1e-6, ffn_hidden_size=18432,
        num_experts=256, moe_ffn_hidden_size=2048, moe_topk=8, moe_score_function="sigmoid",
        moe_norm_topk_prob=True, moe_topk_scaling_factor=2.5, moe_num_groups=8, moe_group_topk=4,
        moe_group_score_topk=2,
        moe_expert_bias=True, moe_shared_expert_ffn_size=2048, first_k_dense_replace=3,
        moe_aux_loss_coeff=1e-4, moe_load_balancing_type="seq_aux_loss",
        mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
    )


def deepseek_v3_tiny() -> ModelConfig:
    return deepseek_v3().with_(
        name="deepseek_v3_tiny", vocab_size=512, hidden_size=64, num_layers=3, num_attention_heads=4,
        mla=MLADims(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
        max_position_embeddings=1024,
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=64),
        ffn_hidden_size=128, num_experts=8, moe_ffn_hidden_size=32, moe_topk=2, moe_num_groups=4,
        moe_group_topk=2, moe_shared_expert_ffn_size=32, first_k_dense_replace=1,
    )


def deepseek_v3_proxy() -> ModelConfig:
    return deepseek_v3().with_(name="deepseek_v3_proxy", num_layers=4, first_k_dense_replace=1,
                               num_experts=16, mtp_num_layers=1)


# ----------------------------------------------------------------------------- DeepSeek-V3.2
def deepseek_v32() -> ModelConfig:
    """DeepSeek-V3.2(-Exp): DeepSeek-V3 with DeepSeek sparse attention, a lightning indexer of 64 heads x 128 in
    every layer keeping each query's 2048 best keys (MTP as transformers reads it: none)."""
    return deepseek_v3().with_(name="deepseek_v32", family="deepseek_v32", mtp_num_layers=0,
                               dsa=DSADims(index_n_heads=64, index_head_dim=128, index_topk=2048))


def deepseek_v32_tiny() -> ModelConfig:
    # index_topk 64: sparse from the 65th token of a sequence on
    return deepseek_v3_tiny().with_(name="deepseek_v32_tiny", family="deepseek_v32", mtp_num_layers=0,
                                    dsa=DSADims(index_n_heads=4, index_head_dim=16, index_topk=64))


def deepseek_v32_proxy() -> ModelConfig:
    return deepseek_v32().with_(name="deepseek_v32_proxy", num_layers=4, first_k_dense_replace=1, num_experts=16)


def glm5() -> ModelConfig:
    """GLM-5 (744B total, 40B active without the embedding): DeepSeek-V3.2's architecture at transformers'
    ``GlmMoeDsaConfig`` sizes (78 layers, 64 heads of 192 + 64, values 256, one expert group), its indexer of 32 heads
    with interleaved RoPE. RoPE theta 1e6 (GLM-5's published config.json, ``rope_parameters``: default RoPE, no
    YaRN, as GLM-4.5's; transformers' class default is 10000); ``--load-hf`` takes a checkpoint's own."""
    return deepseek_v32().with_(
        name="glm5", family="glm_moe_dsa", vocab_size=154880, hidden_size=6144, num_layers=78, num_attention_heads=64,
        mla=MLADims(q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256),
        yarn=None, rope_theta=1e6, max_position_embeddings=202752, norm_eps=1e-5, ffn_hidden_size=12288,
        moe_num_groups=1, moe_group_topk=1,
        dsa=DSADims(index_n_heads=32, index_head_dim=128, index_topk=2048, rope_interleave=True))


def glm5_tiny() -> ModelConfig:
    indexer = DSADims(index_n_heads=4, index_head_dim=16, index_topk=64, rope_interleave=True)
    return deepseek_v32_tiny().with_(name="glm5_tiny", family="glm_moe_dsa", norm_eps=1e-5, yarn=None,
                                     rope_theta=1e6, moe_num_groups=1, moe_group_topk=1, dsa=indexer)


# ----------------------------------------------------------------------------- Qwen3-MoE
def qwen3_moe_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B: GQA with qk-norm, 128 experts top-8, global-batch aux loss."""
    return ModelConfig(
        name="qwen3_moe_30b_a3b", family="qwen3_moe",
        vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32, num_query_groups=4,
        head_dim=128, qk_norm=True, rope_theta=1_000_000.0, max_position_embeddings=40960, norm_eps=1e-6,
        num_experts=128, moe_ffn_hidden_size=768, moe_topk=8, moe_score_function="softmax",
        moe_pre_softmax=True, moe_norm_topk_prob=True,
        moe_aux_loss_coeff=1e-3, moe_load_balancing_type="global_aux_loss",
    )


def qwen3_moe_235b_a22b() -> ModelConfig:
    return qwen3_moe_30b_a3b().with_(
        name="qwen3_moe_235b_a22b", hidden_size=4096, num_layers=94, num_attention_heads=64,
        moe_ffn_hidden_size=1536,
    )


def qwen3_moe_tiny() -> ModelConfig:
    return qwen3_moe_30b_a3b().with_(
        name="qwen3_moe_tiny", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=16, max_position_embeddings=1024, num_experts=8,
        moe_ffn_hidden_size=32, moe_topk=2,
    )


def qwen3_moe_proxy() -> ModelConfig:
    return qwen3_moe_30b_a3b().with_(name="qwen3_moe_proxy", num_layers=4, num_experts=16)


# ----------------------------------------------------------------------------- Mixtral
def mixtral_8x7b() -> ModelConfig:
    """Mixtral 8x7B: GQA, 8 experts top-2 with softmax over the top-2, rope theta 1e6."""
    return ModelConfig(
        name="mixtral_8x7b", family="mixtral",
        vocab_size=32000, hidden_size=4096, num_layers=32, num_attention_heads=32, num_query_groups=8,
        rope_theta=1_000_000.0, max_position_embeddings=32768, norm_eps=1e-5,
        num_experts=8, moe_ffn_hidden_size=14336, moe_topk=2, moe_score_function="softmax",
        moe_norm_topk_prob=True, moe_aux_loss_coeff=0.02, moe_load_balancing_type="aux_loss",
    )


def mixtral_8x22b() -> ModelConfig:
    return mixtral_8x7b().with_(
        name="mixtral_8x22b", vocab_size=32768, hidden_size=6144, num_layers=56, num_attention_heads=48,
        moe_ffn_hidden_size=16384, max_position_embeddings=65536,
    )


def mixtral_tiny() -> ModelConfig:
    return mixtral_8x7b().with_(
        name="mixtral_tiny", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_query_groups=2, max_position_embeddings=1024, sliding_window=16, num_experts=4,
        moe_ffn_hidden_size=128,
    )


def mixtral_proxy() -> ModelConfig:
    return mixtral_8x7b().with_(name="mixtral_proxy", num_layers=2)


# ----------------------------------------------------------------------------- GPT-OSS
def gpt_oss_120b() -> ModelConfig:
    """gpt-oss-120b (116.8B total, 5.1B active): GQA with attention sinks, sliding-window (128) and full
    layers alternating, biases everywhere, 128 experts top-4 with a router bias and the clamped SwiGLU."""
    return ModelConfig(
        name="gpt_oss_120b", family="gpt_oss",
        vocab_size=201088, hidden_size=2880, num_layers=36, num_attention_heads=64, num_query_groups=8, head_dim=64,
        attention_bias=True, attention_sinks=True, sliding_window=128, sliding_window_pattern=(1, 0) * 18,
        rope_theta=150000.0, max_position_embeddings=131072,
        yarn=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                         mscale=0.0, mscale_all_dim=0.0, truncate=False),
        norm_eps=1e-5, num_experts=128, moe_ffn_hidden_size=2880, moe_topk=4, moe_score_function="softmax",
        moe_norm_topk_prob=True, moe_router_bias=True, moe_expert_linear_bias=True, moe_swiglu_alpha=1.702,
        moe_activation_clamp=7.0, moe_glu_linear_offset=1.0, moe_aux_loss_coeff=0.9,
        moe_load_balancing_type="aux_loss",
    )


def gpt_oss_20b() -> ModelConfig:
    """gpt-oss-20b (20.9B total, 3.6B active)."""
    return gpt_oss_120b().with_(name="gpt_oss_20b", num_layers=24, sliding_window_pattern=(1, 0) * 12, num_experts=32)


def gpt_oss_tiny() -> ModelConfig:
    return gpt_oss_120b().with_(
        name="gpt_oss_tiny", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
        head_dim=16, sliding_window=8, sliding_window_pattern=(1, 0), max_position_embeddings=1024,
        yarn=YarnScaling(factor=4.0, original_max_position_embeddings=64, mscale=0.0, mscale_all_dim=0.0,
                         truncate=False),
        num_experts=8, moe_ffn_hidden_size=32, moe_topk=2, moe_aux_loss_coeff=0.01,
    )


# ----------------------------------------------------------------------------- GLM-4.5 / 4.6
def glm4_5() -> ModelConfig:
    """GLM-4.5 (355B total, 32B active): GQA with qk-norm, q/k/v biases, half-dim RoPE, 3 dense layers,
    160 experts top-8 with sigmoid scores, expert bias and a shared expert, one MTP layer."""
    return ModelConfig(
        name="glm4_5", family="glm4_moe",
        vocab_size=151552, hidden_size=5120, num_layers=92, num_attention_heads=96, num_query_groups=8, head_dim=128,
        qk_norm=True, partial_rotary_factor=0.5, attention_bias=True, attention_out_bias=False,
        rope_theta=1_000_000.0, max_position_embeddings=131072, norm_eps=1e-5, ffn_hidden_size=12288,
        num_experts=160, moe_ffn_hidden_size=1536, moe_topk=8, moe_score_function="sigmoid", moe_norm_topk_prob=True,
        moe_topk_scaling_factor=2.5, moe_num_groups=1, moe_group_topk=1, moe_group_score_topk=2, moe_expert_bias=True,
        moe_shared_expert_ffn_size=1536, first_k_dense_replace=3, moe_aux_loss_coeff=1e-4,
        moe_load_balancing_type="seq_aux_loss", mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
    )


def glm4_5_air() -> ModelConfig:
    """GLM-4.5-Air (106B total, 12B active)."""
    return glm4_5().with_(
        name="glm4_5_air", hidden_size=4096, num_layers=46, qk_norm=False, ffn_hidden_size=10944, num_experts=128,
        moe_ffn_hidden_size=1408, moe_topk_scaling_factor=1.0, moe_shared_expert_ffn_size=1408,
        first_k_dense_replace=1,
    )


def glm4_6() -> ModelConfig:
    """GLM-4.6: GLM-4.5's architecture with a 200K context."""
    return glm4_5().with_(name="glm4_6", max_position_embeddings=202752)


def glm4_moe_tiny() -> ModelConfig:
    return glm4_5().with_(
        name="glm4_moe_tiny", vocab_size=512, hidden_size=64, num_layers=3, num_attention_heads=4, num_query_groups=2,
        head_dim=16, max_position_embeddings=1024, ffn_hidden_size=128, num_experts=8, moe_ffn_hidden_size=32,
        moe_topk=2, moe_num_groups=2, moe_shared_expert_ffn_size=32, first_k_dense_replace=1,
    )


# ----------------------------------------------------------------------------- Kimi-K2
def kimi_k2() -> ModelConfig:
    """Kimi-K2 (1.04T total, 32B active): DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer,
    one expert group, no MTP."""
    return deepseek_v3().with_(
        name="kimi_k2", vocab_size=163840, num_attention_heads=64, rope_theta=50000.0, max_position_embeddings=131072,
        yarn=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0),
        num_experts=384, moe_topk_scaling_factor=2.827, moe_num_groups=1, moe_group_topk=1, first_k_dense_replace=1,
        moe_aux_loss_coeff=1e-3, mtp_num_layers=0,
    )


def kimi_k2_tiny() -> ModelConfig:
    return deepseek_v3_tiny().with_(
        name="kimi_k2_tiny", yarn=YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=1.0,
                                              beta_slow=1.0),
        num_experts=12, moe_topk_scaling_factor=2.827, moe_num_groups=1, moe_group_topk=1, mtp_num_layers=0,
    )


# ----------------------------------------------------------------------------- OLMoE
def olmoe_1b_7b() -> ModelConfig:
    """OLMoE-1B-7B (6.9B total, 1.3B active): qk-norm over the whole q / k projections, 64 experts top-8
    (softmax over all, not renormalised), no shared expert."""
    return ModelConfig(
        name="olmoe_1b_7b", family="olmoe",
        vocab_size=50304, hidden_size=2048, num_layers=16, num_attention_heads=16, num_query_groups=16, qk_norm=True,
        qk_norm_scope="projection", rope_theta=10000.0, max_position_embeddings=4096, norm_eps=1e-5,
        num_experts=64, moe_ffn_hidden_size=1024, moe_topk=8, moe_score_function="softmax", moe_pre_softmax=True,
        moe_norm_topk_prob=False, moe_aux_loss_coeff=0.01, moe_load_balancing_type="aux_loss",
    )


def olmoe_tiny() -> ModelConfig:
    return olmoe_1b_7b().with_(
        name="olmoe_tiny", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
        max_position_embeddings=1024, num_experts=8, moe_ffn_hidden_size=32, moe_topk=2,
    )


# ----------------------------------------------------------------------------- MiniMax-M2
def minimax_m2() -> ModelConfig:
    """MiniMax-M2 (230B total, 10B active): GQA with qk-norm over the whole projections and RoPE on half of
    each head, 256 experts top-8 with sigmoid scores and an expert bias."""
    return ModelConfig(
        name="minimax_m2", family="minimax_m2",
        vocab_size=200064, hidden_size=3072, num_layers=62, num_attention_heads=48, num_query_groups=8, head_dim=128,
        qk_norm=True, qk_norm_scope="projection", partial_rotary_factor=0.5, rope_theta=5_000_000.0,
        max_position_embeddings=196608, norm_eps=1e-6, num_experts=256, moe_ffn_hidden_size=1536, moe_topk=8,
        moe_score_function="sigmoid", moe_norm_topk_prob=True, moe_expert_bias=True, moe_aux_loss_coeff=1e-3,
        moe_load_balancing_type="aux_loss",
    )


def minimax_m2_tiny() -> ModelConfig:
    return minimax_m2().with_(
        name="minimax_m2_tiny", vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=16, max_position_embeddings=1024, num_experts=8, moe_ffn_hidden_size=32,
        moe_topk=2,
    )


# ----------------------------------------------------------------------------- Qwen3-Next
def _every_4th_full(num_layers: int) -> tuple[str, ...]:
    """Qwen3-Next's hybrid layout: three Gated DeltaNet layers, then one gated full-attention layer."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers))


def qwen3_next_80b_a3b() -> ModelConfig:
    """Qwen3-Next-80B-A3B: 36 Gated DeltaNet + 12 gated-attention layers (3:1, partial RoPE 64 of 256 dims),
    512 experts top-10 plus one gated shared expert, zero-centred RMSNorm weights."""
    return ModelConfig(
        name="qwen3_next_80b_a3b", family="qwen3_next",
        vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=16, num_query_groups=2,
        head_dim=256, qk_norm=True, rope_theta=10_000_000.0, max_position_embeddings=262144, norm_eps=1e-6,
        ffn_hidden_size=5120,   # HF intermediate_size; every layer is MoE
        num_experts=512, moe_ffn_hidden_size=512, moe_topk=10, moe_score_function="softmax", moe_pre_softmax=True,
        moe_norm_topk_prob=True, moe_shared_expert_ffn_size=512, moe_shared_expert_gate=True,
        moe_aux_loss_coeff=1e-3, moe_load_balancing_type="global_aux_loss",
        layer_types=_every_4th_full(48),
        linear_attention=LinearAttentionDims(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                             value_head_dim=128, conv_kernel_size=4),
        attention_output_gate=True, partial_rotary_factor=0.25, norm_zero_centered_gamma=True,
    )


def qwen3_next_tiny() -> ModelConfig:
    return qwen3_next_80b_a3b().with_(
        name="qwen3_next_tiny", vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4,
        num_query_groups=2, head_dim=16, max_position_embeddings=1024, ffn_hidden_size=128, num_experts=8,
        moe_ffn_hidden_size=32, moe_topk=2, moe_shared_expert_ffn_size=32, layer_types=_every_4th_full(4),
        linear_attention=LinearAttentionDims(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                                             conv_kernel_size=4),
    )


def qwen3_next_proxy() -> ModelConfig:
    return qwen3_next_80b_a3b().with_(name="qwen3_next_proxy", num_layers=4, layer_types=_every_4th_full(4),
                                      num_experts=32)


# ----------------------------------------------------------------------------- Qwen3.5-MoE (text)
def qwen3_5_35b_a3b() -> ModelConfig:
    """Qwen3.5-35B-A3B's text model (HF ``Qwen3_5MoeForCausalLM``; transformers' ``Qwen3_5MoeTextConfig``
    defaults are this checkpoint's): Qwen3-Next's hybrid, 30 Gated DeltaNet + 10 gated-attention layers, every
    layer MoE (256 experts top-8, renormalised, plus one gated shared expert), a 248k vocabulary."""
    return qwen3_next_80b_a3b().with_(
        name="qwen3_5_35b_a3b", family="qwen3_5_moe", vocab_size=248320, num_layers=40, ffn_hidden_size=0,
        num_experts=256, moe_topk=8, layer_types=_every_4th_full(40))


def qwen3_5_moe_tiny() -> ModelConfig:
    return qwen3_next_tiny().with_(name="qwen3_5_moe_tiny", family="qwen3_5_moe", ffn_hidden_size=0)


def qwen3_5_moe_proxy() -> ModelConfig:
    return qwen3_5_35b_a3b().with_(name="qwen3_5_moe_proxy", num_layers=4, layer_types=_every_4th_full(4),
                                   num_experts=32)


RECIPES: dict[str, Callable[[], ModelConfig]] = {
    fn.__name__: fn for fn in (
        deepseek_v3, deepseek_v3_tiny, deepseek_v3_proxy, deepseek_v32, deepseek_v32_tiny, deepseek_v32_proxy,
        glm5, glm5_tiny,
        qwen3_moe_30b_a3b, qwen3_moe_235b_a22b, qwen3_moe_tiny, qwen3_moe_proxy,
        mixtral_8x7b, mixtral_8x22b, mixtral_tiny, mixtral_proxy,
        gpt_oss_120b, gpt_oss_20b, gpt_oss_tiny, glm4_5, glm4_5_air, glm4_6, glm4_moe_tiny, kimi_k2, kimi_k2_tiny,
        olmoe_1b_7b, olmoe_tiny, minimax_m2, minimax_m2_tiny,
        qwen3_next_80b_a3b, qwen3_next_tiny, qwen3_next_proxy,
        qwen3_5_35b_a3b, qwen3_5_moe_tiny, qwen3_5_moe_proxy,
        *NEMOTRON_H_RECIPES,   # models/recipes_nemotron_h.py
    )
}
RECIPES.update({fn.__name__: fn for fn in V4_RECIPES})   # DeepSeek-V4 (models.recipes_v4)


def get_recipe(name: str) -> ModelConfig:
    """The config of recipe ``name``; unknown names fail listing the valid ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[name]()
