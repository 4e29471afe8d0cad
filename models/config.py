"""The architecture of one decoder model: a flat, typed description close to HF configs.

Component configs (attention, router, MoE) are derived from it by the model builder, so a
recipe is one readable function returning a ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Literal

FAMILIES: tuple[str, ...] = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe", "minimax_m2",
                             "qwen3_next", "deepseek_v32", "glm_moe_dsa")
ATTENTION_KINDS: tuple[str, ...] = ("gqa", "mla")
MOE_SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid")
QK_NORM_SCOPES: tuple[str, ...] = ("head", "projection")   # must equal dense.attention_config.QK_NORM_SCOPES
# the token mixer of a layer (HF ``layer_types``): attention (GQA or MLA) or Gated DeltaNet
LAYER_TYPES: tuple[str, ...] = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (HF ``rope_scaling`` / ``rope_parameters`` with ``rope_type: yarn``).

    cos/sin are scaled by ``attention_factor`` when it is set, else (as transformers infers it) by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are non-zero, else by
    ``mscale(factor)``; 0 stands for a term the config leaves out."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True                        # round the ramp bounds (HF default; GPT-OSS: False)
    attention_factor: float | None = None        # the cos/sin scale, given (None: inferred as above)


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention sizes (DeepSeek-V2/V3)."""

    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    # eps of q_a_layernorm / kv_a_layernorm: transformers and DeepSeek fix it at 1e-6 whatever rms_norm_eps says;
    # Megatron-Core uses its layernorm_epsilon (moefold's --norm-epsilon sets both)
    latent_norm_eps: float = 1e-6


@dataclass(frozen=True)
class DSADims:
    """DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer of every MLA layer (``dense.dsa_indexer``)."""

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    relu: bool = True                 # relu on the indexer's per-head scores (DeepSeek-V3.2, GLM-5)
    rope_interleave: bool = False     # the indexer's RoPE on pairs (2i, 2i+1) (GLM-5), else half-split (DeepSeek-V3.2)
    loss_coeff: float = 1.0           # weight of the indexer's KL loss (0: the indexer is not trained)

    def __post_init__(self) -> None:
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"dsa.{name}={getattr(self, name)!r} must be a positive integer")
        if not self.loss_coeff >= 0:
            raise ValueError(f"dsa.loss_coeff={self.loss_coeff!r} must be >= 0")


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated DeltaNet sizes of the ``linear_attention`` layers (Qwen3-Next; HF ``linear_*``)."""

    num_key_heads: int = 16
    num_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel_size: int = 4


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only (MoE) transformer. Field names follow HF where they exist.

    Layer ``i`` is an MoE layer when ``num_experts > 0``, ``i >= first_k_dense_replace`` and
    ``moe_layer_pattern[i]`` (derived from ``moe_layer_freq``) is 1. Layer ``i`` attends within
    ``sliding_window`` when it is set and ``sliding_window_pattern`` is None or has a 1 at ``i``. Its token
    mixer is ``layer_types[i]`` (None: attention everywhere; ``linear_attention``: Gated DeltaNet).
    """

    name: str
    family: Literal["deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe", "minimax_m2", "qwen3_next",
                    "deepseek_v32", "glm_moe_dsa"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None          # kv heads (GQA); None = num_attention_heads
    head_dim: int | None = None                  # None = hidden / heads
    attention: Literal["gqa", "mla"] = "gqa"
    mla: MLADims | None = None
    qk_norm: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    rope_theta: float = 10000.0
    yarn: YarnScaling | None = None
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-6
    ffn_hidden_size: int = 0                     # dense MLP layers
    tie_word_embeddings: bool = False
    # mixture of experts
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 2
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_pre_softmax: bool = False                # softmax over all experts before top-k
    moe_norm_topk_prob: bool = True
    moe_topk_scaling_factor: float = 1.0
    moe_num_groups: int | None = None
    moe_group_topk: int | None = None
    moe_group_score_topk: int | None = None      # experts summed per group score; None = topk // group_topk
    moe_expert_bias: bool = False                # aux-loss-free balancing bias (DeepSeek-V3)
    moe_shared_expert_ffn_size: int = 0          # 0 = no shared experts
    moe_shared_expert_gate: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_aux_loss_coeff: float = 0.0
    moe_load_balancing_type: str = "aux_loss"
    moe_aux_loss_counts: str = "topk"            # topk (Megatron-Core) | dispatched (moe.router_config)
    # router training choices (Megatron flag names in moe/router_config.py)
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_router_dtype: str = "fp32"
    moe_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None
    moe_expert_rank_capacity_factor: float | None = None   # per expert-parallel rank (Megatron's HybridEP budget)
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_router_force_load_balancing: bool = False
    moe_apply_probs_on_input: bool = False       # top-1: x * prob before the expert (default: in the combine)
    # multi-token prediction
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # GPT-OSS, GLM-4.5, OLMoE, MiniMax-M2 (general features; see dense.attention_config, moe.experts)
    qk_norm_scope: Literal["head", "projection"] = "head"   # projection: OLMoE / MiniMax-M2 qk-norm over all heads
    partial_rotary_factor: float = 1.0           # RoPE on int(head_dim * factor) dims of each head (GLM-4.5: 0.5)
    attention_out_bias: bool | None = None       # bias on o_proj; None = attention_bias (GLM-4.5: q/k/v only)
    attention_sinks: bool = False                # a learned logit per head in every softmax row (GPT-OSS)
    sliding_window_pattern: tuple[int, ...] | None = None   # per layer 1 = sliding window, 0 = full (GPT-OSS 1,0,..)
    moe_router_bias: bool = False                # a learned bias on the router logits (GPT-OSS)
    moe_expert_linear_bias: bool = False         # biases on the routed experts' projections (GPT-OSS)
    moe_swiglu_alpha: float = 1.0                # expert act(g) = g * sigmoid(alpha * g) (GPT-OSS 1.702)
    moe_activation_clamp: float | None = None    # clamp gate <= c, up to [-c, c] before it (GPT-OSS 7)
    moe_glu_linear_offset: float = 0.0           # act(gate) * (up + offset) (GPT-OSS 1)
    # hybrid stacks (Qwen3-Next): the token mixer of each layer, gated attention, zero-centred norm weights
    layer_types: tuple[str, ...] | None = None   # per layer, one of LAYER_TYPES; None = every layer attention
    linear_attention: LinearAttentionDims | None = None   # sizes of the "linear_attention" layers
    attention_output_gate: bool = False          # sigmoid gate from q_proj on the attention output
    norm_zero_centered_gamma: bool = False       # every RMSNorm stores gamma - 1 (Megatron --apply-layernorm-1p)
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA with a lightning indexer picking each query's top keys
    dsa: DSADims | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._check_hybrid()
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        # Literal hints are not checked at run time, and a wrong value would otherwise silently build
        # the other kind (e.g. any attention that is not "mla" becomes GQA)
        for name, valid in (("family", FAMILIES), ("attention", ATTENTION_KINDS),
                            ("moe_score_function", MOE_SCORE_FUNCTIONS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {valid}")
        groups = self.kv_heads
        if self.num_attention_heads % groups != 0:
            raise ValueError(f"num_query_groups={groups} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.attention == "mla" and self.mla is None:
            raise ValueError("attention='mla' needs mla=MLADims(...)")
        if self.num_experts > 0:
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(f"moe_topk={self.moe_topk} must be in [1, num_experts={self.num_experts}]")
            if self.moe_ffn_hidden_size <= 0:
                raise ValueError(f"moe_ffn_hidden_size={self.moe_ffn_hidden_size} must be positive with experts")
        if isinstance(self.moe_layer_freq, tuple) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq pattern has {len(self.moe_layer_freq)} entries, "
                             f"num_layers={self.num_layers}")
        if isinstance(self.moe_layer_freq, int) and self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq={self.moe_layer_freq} must be >= 1 (or a 0/1 pattern per layer)")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, "
                             f"num_layers={self.num_layers}]")
        dense = [i for i in range(self.num_layers) if not self.is_moe_layer(i)]
        if dense and self.ffn_hidden_size <= 0:
            raise ValueError(f"layers {dense[:8]}{'...' if len(dense) > 8 else ''} are dense and need "
                             f"ffn_hidden_size > 0, got {self.ffn_hidden_size}")
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers={self.mtp_num_layers} must be >= 0")
        if self.mtp_num_layers > 0 and not self.mtp_loss_scaling_factor >= 0:
            raise ValueError(f"mtp_loss_scaling_factor={self.mtp_loss_scaling_factor} must be >= 0")
        self._check_attention_features()

    def _check_attention_features(self) -> None:
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope={self.qk_norm_scope!r} is not one of {QK_NORM_SCOPES}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.attention == "mla":
            bad = [k for k, v in (("partial_rotary_factor", self.partial_rotary_factor != 1.0),
                                  ("attention_sinks", self.attention_sinks),
                                  ("qk_norm", self.qk_norm),
                                  ("attention_output_gate", self.attention_output_gate),
                                  ("norm_zero_centered_gamma", self.norm_zero_centered_gamma)) if v]
            if bad:
                raise ValueError(f"{', '.join(bad)} apply to GQA attention; MLA has its own rope split and latent "
                                 "norms, and no sinks, qk-norm or output gate (set attention='gqa')")
        elif self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives an odd rotary dim "
                             f"{self.rotary_dim} of head_dim={self.attention_head_dim}")
        pattern = self.sliding_window_pattern
        if isinstance(pattern, list):   # from JSON (a moefold checkpoint's config)
            pattern = tuple(pattern)
            object.__setattr__(self, "sliding_window_pattern", pattern)
        if pattern is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_window_pattern needs sliding_window (the window of its layers marked 1)")
            if len(pattern) != self.num_layers or any(p not in (0, 1) for p in pattern):
                raise ValueError(f"sliding_window_pattern={pattern} must hold one 0 (full) or 1 (sliding window) "
                                 f"per layer, num_layers={self.num_layers}")
        if self.moe_activation_clamp is not None and not self.moe_activation_clamp > 0:
            raise ValueError(f"moe_activation_clamp={self.moe_activation_clamp} must be > 0 (or None)")
        if not self.moe_swiglu_alpha > 0:
            raise ValueError(f"moe_swiglu_alpha={self.moe_swiglu_alpha} must be > 0")

    def _check_dsa(self) -> None:
        if isinstance(self.dsa, dict):   # from JSON
            object.__setattr__(self, "dsa", DSADims(**self.dsa))
        if self.dsa is not None and (self.attention != "mla" or self.mla is None or self.mla.q_lora_rank is None):
            raise ValueError("dsa (DeepSeek sparse attention) needs attention='mla' with mla.q_lora_rank set (the "
                             "indexer reads the query latent)")

    def _check_hybrid(self) -> None:
        self._check_dsa()
        # JSON round trips (checkpoint meta, run configs) hand back a list and a dict: store what the fields promise
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.linear_attention, dict):
            object.__setattr__(self, "linear_attention", LinearAttentionDims(**self.linear_attention))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_layers={self.num_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types holds {bad}; valid: {LAYER_TYPES}")
            if "linear_attention" in self.layer_types and self.linear_attention is None:
                raise ValueError("layer_types has linear_attention layers: they need "
                                 "linear_attention=LinearAttentionDims(...)")

    def layer_type(self, index: int) -> str:
        """The token mixer of layer ``index`` (MTP blocks, ``index >= num_layers``, are attention)."""
        if self.layer_types is None or index >= self.num_layers:
            return "full_attention"
        return self.layer_types[index]

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """RoPE dims of each GQA head (HF: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.attention_head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, index: int) -> int | None:
        """The window of layer ``index`` (None: full causal attention). MTP blocks (index >= num_layers)
        attend fully when a pattern is set."""
        if self.sliding_window is None or self.sliding_window_pattern is None:
            return self.sliding_window
        return self.sliding_window if index < self.num_layers and self.sliding_window_pattern[index] else None

    def is_moe_layer(self, index: int) -> bool:
        if self.num_experts == 0 or index < self.first_k_dense_replace:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return bool(self.moe_layer_freq[index])
        return index % self.moe_layer_freq == 0

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (recipes derive tiny/proxy versions this way)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain JSON / YAML values (nested dims as mappings, tuples as lists); ``from_dict`` reads it
        back. What a checkpoint's ``moefold_config.json``, a run's ``config.json`` and ``config.yaml`` record."""
        def plain(value: Any) -> Any:
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        return plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The config ``to_dict`` (or any earlier moefold's saved config) wrote; ValueError naming unknown fields."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        data = dict(data)
        for name, kind in (("yarn", YarnScaling), ("mla", MLADims), ("linear_attention", LinearAttentionDims),
                           ("dsa", DSADims)):
            if isinstance(data.get(name), dict):
                data[name] = kind(**data[name])
        for name in ("moe_layer_freq", "layer_types", "sliding_window_pattern"):
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        return cls(**data)
