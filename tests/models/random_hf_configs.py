"""Valid HF configs drawn at random, per family, over the fields that change the computation.

``draw(family, seed)`` returns config fields for ``tests.models.hf_tiny.hf_model(family, seed, **fields)``: head
counts and dims, kv heads, eps, rope type and parameters (default or YaRN with or without mscale / mscale_all_dim /
attention_factor / truncate, partial RoPE where the class applies it), biases, tied embeddings, expert counts and
top-k, renormalisation, scaling, groups, shared experts, first dense layers and MoE-layer patterns, windows and
window patterns, GPT-OSS's clamp and alpha, DeltaNet's sizes and layer types. Every draw also fits the parallel
layouts of ``tests/models/test_random_configs.py`` (tp2: even heads, kv heads even or dividing 2; ep2: an even
expert count; DeltaNet's key heads even). Transformers' classes do not model MTP layers, so none are drawn
(MTP is checked against Megatron-Core: tests/models/test_megatron_layouts.py).
"""

from __future__ import annotations

import random
from typing import Any

# families drawn (Kimi-K2 is DeepSeek-V3's class; its values are one of DeepSeek-V3's draws)
FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe", "minimax_m2", "qwen3_next",
            "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa")


def _rope(r: random.Random, yarn: bool = True, partial: tuple[float, ...] = ()) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(round(10 ** r.uniform(3, 6)))}
    if yarn and r.random() < 0.6:
        rope.update(rope_type="yarn", factor=r.choice([2.0, 4.0, 8.0]),
                    original_max_position_embeddings=r.choice([8, 16, 32]), beta_fast=r.choice([8.0, 32.0]),
                    beta_slow=r.choice([1.0, 2.0]))
        if r.random() < 0.5:
            rope["mscale_all_dim"] = r.choice([0.5, 1.0])
        if r.random() < 0.5:
            rope["mscale"] = r.choice([0.7, 1.0])
        if r.random() < 0.3:
            rope["attention_factor"] = round(r.uniform(0.6, 1.4), 3)
        if r.random() < 0.3:
            rope["truncate"] = False
    if partial:
        rope["partial_rotary_factor"] = r.choice(partial)
    return rope


def _heads(r: random.Random) -> tuple[int, int]:
    heads = r.choice([2, 4, 8])
    return heads, r.choice([k for k in (1, 2, 4, 8) if heads % k == 0 and (k % 2 == 0 or k in (1, 2))])


def _common(r: random.Random, head_dims: tuple[int, ...] = (4, 8, 12, 16)) -> dict[str, Any]:
    heads, kv = _heads(r)
    return dict(hidden_size=r.choice([32, 48]), num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=r.choice(head_dims), rms_norm_eps=r.choice([1e-6, 1e-5, 1e-4, 1e-3, 1e-2]),
                tie_word_embeddings=r.random() < 0.3, max_position_embeddings=64)


def _experts(r: random.Random) -> tuple[int, int]:
    experts = r.choice([4, 6, 8])
    return experts, r.choice([k for k in (1, 2, 3) if k <= experts])


def _groups(r: random.Random, experts: int, topk: int) -> tuple[int, int]:
    """(n_group, topk_group): experts split evenly in groups of >= 2 (a group scores by its top 2), and the groups
    kept hold at least top-k experts."""
    options = [(g, t) for g in (1, 2, 3, 4) if experts % g == 0 and experts // g >= 2
               for t in range(1, g + 1) if t * (experts // g) >= topk]
    return r.choice(options)


def draw(family: str, seed: int) -> dict[str, Any]:
    """Config fields of one random valid ``family`` model (module docstring)."""
    r = random.Random(f"{family}-{seed}")
    c = _common(r)
    experts, topk = _experts(r)
    if family == "deepseek_v3":
        groups, kept = _groups(r, experts, topk)
        layers = r.choice([2, 3])
        c.pop("head_dim")   # the class sets it (qk_rope_head_dim)
        return dict(c, num_key_value_heads=c["num_attention_heads"], num_hidden_layers=layers,
                    intermediate_size=r.choice([24, 48]), moe_intermediate_size=r.choice([8, 16]),
                    n_routed_experts=experts, num_experts_per_tok=topk, n_group=groups, topk_group=kept,
                    n_shared_experts=r.choice([0, 1, 2]), first_k_dense_replace=r.choice([0, 1]),
                    routed_scaling_factor=round(r.uniform(0.5, 3.0), 3), norm_topk_prob=r.random() < 0.7,
                    q_lora_rank=r.choice([None, 8, 16]), kv_lora_rank=r.choice([8, 12]),
                    qk_nope_head_dim=r.choice([4, 8]), qk_rope_head_dim=r.choice([2, 4, 8]),
                    v_head_dim=r.choice([4, 8]),
                    rope_interleave=r.random() < 0.5, attention_bias=r.random() < 0.3, rope_parameters=_rope(r))
    if family in ("deepseek_v32", "glm_moe_dsa"):   # DeepSeek-V3's draw less rope_interleave and MTP, the indexer
        groups, kept = _groups(r, experts, topk)
        layers = r.choice([2, 3])
        c.pop("head_dim")
        rope = r.choice([2, 4, 8])
        return dict(c, num_key_value_heads=c["num_attention_heads"], num_hidden_layers=layers,
                    intermediate_size=r.choice([24, 48]), moe_intermediate_size=r.choice([8, 16]),
                    n_routed_experts=experts, num_experts_per_tok=topk, n_group=groups, topk_group=kept,
                    n_shared_experts=r.choice([0, 1, 2]), routed_scaling_factor=round(r.uniform(0.5, 3.0), 3),
                    norm_topk_prob=r.random() < 0.7, q_lora_rank=r.choice([8, 16]), kv_lora_rank=r.choice([8, 12]),
                    qk_nope_head_dim=r.choice([4, 8]), qk_rope_head_dim=rope, v_head_dim=r.choice([4, 8]),
                    attention_bias=r.random() < 0.3, rope_parameters=_rope(r),
                    mlp_layer_types=[r.choice(["dense", "sparse"]) for _ in range(layers)],
                    index_n_heads=r.choice([1, 2, 4]), index_head_dim=r.choice([h for h in (4, 8, 16) if h >= rope]),
                    index_topk=r.choice([1, 2, 5, 9, 16]))
    if family == "qwen3_moe":
        layers = r.choice([2, 3])
        window = r.random() < 0.3
        return dict(c, num_hidden_layers=layers, intermediate_size=r.choice([24, 48]),
                    moe_intermediate_size=r.choice([8, 16]), num_experts=experts, num_experts_per_tok=topk,
                    norm_topk_prob=r.random() < 0.5, decoder_sparse_step=r.choice([1, 1, 2]),
                    mlp_only_layers=sorted(r.sample(range(layers), r.choice([0, 1]))),
                    attention_bias=r.random() < 0.3, use_sliding_window=window,
                    sliding_window=r.choice([3, 5]) if window else None, rope_parameters=_rope(r))
    if family == "mixtral":
        return dict(c, num_hidden_layers=r.choice([1, 2]), intermediate_size=r.choice([8, 16]),
                    num_local_experts=experts, num_experts_per_tok=topk, sliding_window=r.choice([None, 3, 6]),
                    rope_parameters=_rope(r))
    if family == "gpt_oss":
        layers = r.choice([2, 3])
        types = [r.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
        return dict(c, num_hidden_layers=layers, intermediate_size=r.choice([8, 16]), num_local_experts=experts,
                    num_experts_per_tok=topk, layer_types=types, sliding_window=r.choice([2, 4, 6]),
                    swiglu_limit=round(r.uniform(0.3, 7.0), 2), swiglu_alpha=round(r.uniform(1.0, 2.0), 3),
                    attention_bias=r.random() < 0.7, rope_parameters=_rope(r))
    if family == "glm4_moe":
        groups, kept = _groups(r, experts, topk)
        return dict(c, head_dim=r.choice([8, 16]), num_hidden_layers=r.choice([2, 3]),
                    intermediate_size=r.choice([24, 48]), moe_intermediate_size=r.choice([8, 16]),
                    n_routed_experts=experts, num_experts_per_tok=topk, n_group=groups, topk_group=kept,
                    n_shared_experts=r.choice([0, 1, 2]),
                    first_k_dense_replace=r.choice([0, 1]), routed_scaling_factor=round(r.uniform(0.5, 3.0), 3),
                    norm_topk_prob=r.random() < 0.7, use_qk_norm=r.random() < 0.5, attention_bias=r.random() < 0.5,
                    rope_parameters=_rope(r, partial=(0.25, 0.5, 1.0)))
    if family == "olmoe":
        c.pop("head_dim")   # OLMoE's is hidden_size / heads
        return dict(c, hidden_size=c["num_attention_heads"] * r.choice([4, 8]),
                    num_hidden_layers=r.choice([1, 2]), intermediate_size=r.choice([8, 16]), num_experts=experts,
                    num_experts_per_tok=topk, norm_topk_prob=r.random() < 0.5, attention_bias=r.random() < 0.3,
                    rope_parameters=_rope(r))
    if family == "minimax_m2":
        return dict(c, num_hidden_layers=r.choice([1, 2]), intermediate_size=r.choice([8, 16]),
                    num_local_experts=experts, num_experts_per_tok=topk,
                    rotary_dim=r.choice([d for d in (2, 4, 8, 12, 16) if d <= c["head_dim"]]),
                    rope_parameters=_rope(r))
    if family == "qwen3_next":
        layers = 4
        types = [r.choice(["linear_attention", "full_attention"]) for _ in range(layers - 1)] + ["full_attention"]
        types[r.randrange(layers - 1)] = "linear_attention"
        return dict(c, head_dim=r.choice([8, 16]), num_hidden_layers=layers, layer_types=types,
                    intermediate_size=r.choice([24, 48]), moe_intermediate_size=r.choice([8, 16]),
                    shared_expert_intermediate_size=r.choice([8, 24]), num_experts=experts,
                    num_experts_per_tok=topk, norm_topk_prob=r.random() < 0.5,
                    mlp_only_layers=sorted(r.sample(range(layers), r.choice([0, 1]))),
                    decoder_sparse_step=r.choice([1, 1, 2]), attention_bias=r.random() < 0.3,
                    linear_num_key_heads=2, linear_num_value_heads=r.choice([2, 4]),
                    linear_key_head_dim=r.choice([8, 16]), linear_value_head_dim=r.choice([8, 16]),
                    linear_conv_kernel_dim=r.choice([2, 4]), rope_parameters=_rope(r, partial=(0.25, 0.5)))
    if family == "qwen3_5_moe":   # Qwen3-Next's draw less its dense layers and renormalisation switch
        layers = 4
        types = [r.choice(["linear_attention", "full_attention"]) for _ in range(layers - 1)] + ["full_attention"]
        types[r.randrange(layers - 1)] = "linear_attention"
        rope = _rope(r, partial=(0.25, 0.5))
        # multimodal RoPE's sections (a text sequence: the 1-D embedding whatever they are)
        rope.update(mrope_section=r.choice([[1, 1, 0], [2, 1, 1]]), mrope_interleaved=r.random() < 0.5)
        return dict(c, head_dim=r.choice([8, 16]), num_hidden_layers=layers, layer_types=types,
                    moe_intermediate_size=r.choice([8, 16]), shared_expert_intermediate_size=r.choice([8, 24]),
                    num_experts=experts, num_experts_per_tok=topk, attention_bias=r.random() < 0.3,
                    linear_num_key_heads=2, linear_num_value_heads=r.choice([2, 4]),
                    linear_key_head_dim=r.choice([8, 16]), linear_value_head_dim=r.choice([8, 16]),
                    linear_conv_kernel_dim=r.choice([2, 4]), rope_parameters=rope)
    raise ValueError(family)
