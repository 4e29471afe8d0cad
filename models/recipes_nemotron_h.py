"""Nemotron-H recipes (Nemotron 3): the published Nano 30B-A3B, a proxy and a CPU-sized tiny model.

Each layer is one sublayer (``models.hf.nemotron_h``): Mamba-2 (``M``), attention without positional encoding
(``*``), MoE (``E``) or a dense MLP (``-``), in the order of the published ``hybrid_override_pattern``.
"""

from __future__ import annotations

from moefold.models.config import ModelConfig
from moefold.models.mamba_dims import MambaDims

_LETTERS = {"M": "mamba", "*": "full_attention", "E": "moe", "-": "mlp"}
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def pattern_layers(pattern: str) -> dict:
    """``layer_types`` and the matching ``moe_layer_freq`` of a hybrid pattern (its MoE layers are the ``E``s)."""
    types = tuple(_LETTERS[ch] for ch in pattern)
    return {"num_layers": len(types), "layer_types": types, "moe_layer_freq": tuple(int(t == "moe") for t in types)}


def nemotron_3_nano_30b_a3b() -> ModelConfig:
    """NVIDIA Nemotron 3 Nano 30B-A3B (31.6B total, 3.2B active without the embedding): 23 Mamba-2, 23 MoE and 6
    attention layers (GQA 32/2 heads, no RoPE); 128 squared-ReLU experts top-6 (sigmoid, expert bias, x2.5) and
    one shared expert of 3712."""
    return ModelConfig(
        name="nemotron_3_nano_30b_a3b", family="nemotron_h", vocab_size=131072, hidden_size=2688,
        num_attention_heads=32, num_query_groups=2, head_dim=128, partial_rotary_factor=0.0,
        max_position_embeddings=262144, norm_eps=1e-5, ffn_hidden_size=0, ffn_activation="relu2",
        **pattern_layers(NANO_PATTERN),
        mamba=MambaDims(num_heads=64, head_dim=64, state_size=128, num_groups=8, conv_kernel=4, chunk_size=128),
        num_experts=128, moe_ffn_hidden_size=1856, moe_topk=6, moe_score_function="sigmoid", moe_expert_bias=True,
        moe_norm_topk_prob=True, moe_topk_scaling_factor=2.5, moe_shared_expert_ffn_size=3712,
        moe_aux_loss_coeff=1e-4, moe_load_balancing_type="seq_aux_loss",
    )


def nemotron_h_tiny() -> ModelConfig:
    """Every Nemotron-H piece at CPU size: Mamba-2, NoPE attention, MoE and a dense relu2 MLP layer."""
    return nemotron_3_nano_30b_a3b().with_(
        name="nemotron_h_tiny", vocab_size=512, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        head_dim=16, max_position_embeddings=1024, ffn_hidden_size=128, **pattern_layers("MEM*-E"),
        mamba=MambaDims(num_heads=8, head_dim=8, state_size=16, num_groups=2, conv_kernel=4, chunk_size=16),
        num_experts=8, moe_ffn_hidden_size=32, moe_topk=2, moe_shared_expert_ffn_size=64)


def nemotron_h_proxy() -> ModelConfig:
    """The Nano's widths and experts' sizes over one period of its pattern (5 Mamba, 5 MoE, 1 attention layer
    would be 11: here ``MEM*E``), 32 experts: for single-GPU benchmarking."""
    return nemotron_3_nano_30b_a3b().with_(name="nemotron_h_proxy", **pattern_layers("MEM*E"), num_experts=32)


RECIPES = (nemotron_3_nano_30b_a3b, nemotron_h_tiny, nemotron_h_proxy)
