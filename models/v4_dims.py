"""DeepSeek-V4's own sizes (``ModelConfig``'s ``v4`` section, flat name ``v4``): what its layers add to the rest.

    V4Dims(attention_kinds=("heavily_compressed_attention", ...), num_hash_layers=3, csa_rate=4, hca_rate=128, ...)

The rest of a V4 model is described by the fields every family shares: ``num_attention_heads`` / ``head_dim`` /
``rope_theta`` / ``norm_eps`` the attention, the MoE section the routed experts (sqrtsoftplus scores, the
correction bias of the top-k layers, ``moe_topk_scaling_factor``, ``moe_activation_clamp``: HF ``swiglu_limit``,
on the routed and the shared experts alike) and ``moe_shared_expert_ffn_size`` the shared expert. Every layer is an
MoE layer: the first ``num_hash_layers`` hash-routed (a frozen token-id -> experts table), the rest top-k.
Torch-free (a model's description).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moefold.models.model_sections import YarnScaling

# HF ``layer_types`` values (``dense.compressed_attention.V4AttentionKind``; this file stays torch-free)
V4_ATTENTION_KINDS: tuple[str, ...] = ("sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention")


@dataclass(frozen=True)
class V4Dims:
    """DeepSeek-V4 (HF ``DeepseekV4Config`` names where they exist):

    attention_kinds: per layer, one of ``V4_ATTENTION_KINDS`` (HF ``layer_types``)
    num_hash_layers: the first layers whose MoE is hash-routed (HF ``mlp_layer_types``: that many ``hash_moe``)
    csa_rate / hca_rate: ``compress_rates`` of the compressed sparse / heavily compressed layers
    q_lora_rank, o_groups, o_lora_rank: the low-rank query and the grouped output projection
    rope_head_dim: RoPE'd channels of each head (HF ``head_dim * partial_rotary_factor``)
    sliding_window: every layer's local window; compress_rope_theta / compress_yarn: the compressed layers' RoPE
    index_n_heads, index_head_dim, index_topk: the lightning indexer of the compressed sparse layers
    hc_mult, hc_sinkhorn_iters, hc_eps: the mHC residual streams
    """

    attention_kinds: tuple[str, ...]
    num_hash_layers: int = 3
    csa_rate: int = 4
    hca_rate: int = 128
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    rope_head_dim: int = 64
    sliding_window: int = 128
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnScaling | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    def __post_init__(self) -> None:
        if isinstance(self.attention_kinds, list):   # JSON round trips hand back lists and mappings
            object.__setattr__(self, "attention_kinds", tuple(self.attention_kinds))
        if isinstance(self.compress_yarn, dict):
            object.__setattr__(self, "compress_yarn", YarnScaling(**self.compress_yarn))
        bad = sorted(set(self.attention_kinds) - set(V4_ATTENTION_KINDS))
        if bad or not self.attention_kinds:
            raise ValueError(f"v4.attention_kinds holds {bad or 'nothing'}; valid per layer: {V4_ATTENTION_KINDS}")
        for name in ("csa_rate", "hca_rate", "q_lora_rank", "o_groups", "o_lora_rank", "rope_head_dim",
                     "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                     "hc_sinkhorn_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"v4.{name}={value!r} must be a positive integer")
        if not 0 <= self.num_hash_layers <= len(self.attention_kinds):
            raise ValueError(f"v4.num_hash_layers={self.num_hash_layers} must be in [0, num_layers="
                             f"{len(self.attention_kinds)}]")
        if self.rope_head_dim % 2:
            raise ValueError(f"v4.rope_head_dim={self.rope_head_dim} must be even (interleaved RoPE pairs)")
        if not self.hc_eps >= 0 or not self.compress_rope_theta > 0:
            raise ValueError(f"v4.hc_eps={self.hc_eps} must be >= 0 and v4.compress_rope_theta="
                             f"{self.compress_rope_theta} > 0")

    def rate(self, index: int) -> int:
        """Compression rate of layer ``index`` (1 for a sliding layer: nothing compressed)."""
        kind = self.attention_kinds[index]
        rates = {"compressed_sparse_attention": self.csa_rate, "heavily_compressed_attention": self.hca_rate}
        return rates.get(kind, 1)

    def is_hash_layer(self, index: int) -> bool:
        return index < self.num_hash_layers


def check_v4_model(config: Any) -> None:
    """What a ``deepseek_v4`` ``ModelConfig`` must hold beyond ``V4Dims`` (called once, by the config)."""
    v4, name = config.v4, config.name
    if (v4 is None) != (config.family != "deepseek_v4"):
        raise ValueError(f"{name}: family={config.family!r} with v4={'set' if v4 is not None else 'None'}: the "
                         "v4 section (models.v4_dims.V4Dims) is DeepSeek-V4's and the deepseek_v4 family needs it")
    if len(v4.attention_kinds) != config.num_layers:
        raise ValueError(f"{name}: v4.attention_kinds has {len(v4.attention_kinds)} entries, num_layers="
                         f"{config.num_layers}")
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense:
        raise ValueError(f"{name}: layers {dense[:8]} are dense; every DeepSeek-V4 layer is an MoE layer "
                         "(num_experts > 0, first_k_dense_replace=0, moe_layer_freq=1)")
    if config.attention != "gqa" or config.head_dim is None or config.kv_heads != 1:
        raise ValueError(f"{name}: DeepSeek-V4's attention is one shared KV head of head_dim (attention='gqa', "
                         f"num_query_groups=1, head_dim set), got attention={config.attention!r}, "
                         f"num_query_groups={config.num_query_groups}, head_dim={config.head_dim}")
    if config.num_attention_heads % v4.o_groups:
        raise ValueError(f"{name}: num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"v4.o_groups={v4.o_groups}")
    if v4.rope_head_dim > config.head_dim:
        raise ValueError(f"{name}: v4.rope_head_dim={v4.rope_head_dim} exceeds head_dim={config.head_dim}")
    if config.mtp_num_layers:
        raise ValueError(f"{name}: mtp_num_layers={config.mtp_num_layers}: transformers' DeepseekV4ForCausalLM "
                         "builds no MTP layer (num_nextn_predict_layers is not instantiated), so moefold has none "
                         "to equal; use mtp_num_layers=0")
    unused = [k for k, on in (("sliding_window", config.sliding_window is not None),
                              ("qk_norm", config.qk_norm), ("attention_sinks", config.attention_sinks),
                              ("attention_bias", config.attention_bias), ("yarn", config.yarn is not None),
                              ("dsa", config.dsa is not None), ("layer_types", config.layer_types is not None),
                              ("tie_word_embeddings", config.tie_word_embeddings),
                              ("moe_latent_size", config.moe_latent_size is not None)) if on]
    if unused:
        raise ValueError(f"{name}: {', '.join(unused)} do not apply to DeepSeek-V4 (its window, sinks, norms and "
                         "compressed RoPE are the v4 section's; HF unties the head)")


__all__ = ["V4Dims", "V4_ATTENTION_KINDS", "check_v4_model"]
