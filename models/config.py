"""The architecture of one decoder model: ``ModelConfig``, composed of its concerns, read by HF-like flat names.

    ModelConfig(name, family, vocab_size, hidden_size, num_layers, ffn_hidden_size, norm_eps, ...,
                self_attention=ModelAttention(...), moe=ModelMoE(router=..., experts=..., shared=...),
                mtp=ModelMTP(...), hybrid=ModelHybrid(...))

The sections (``models.model_sections``) each check their own values; every value is also a flat name, as the
earlier flat ``ModelConfig`` had it: ``config.moe_topk`` is ``config.moe.router.topk``, ``ModelConfig(moe_topk=4,
...)`` and ``config.with_(moe_topk=4)`` reach it, and ``to_dict`` / ``from_dict`` keep the flat form that
checkpoints and run configs record (``from_dict`` reads the nested form too). A recipe is one readable function
returning a ``ModelConfig``; ``models.layer_factory`` hands each section to the component it configures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field, replace
from typing import Any, Literal

from moefold.models.composed import composed
from moefold.models.flag_field import model_flag
from moefold.models.model_sections import ATTENTION_KINDS as ATTENTION_KINDS
from moefold.models.model_sections import (
    FFN_LAYER_TYPES,
    DSADims,
    LinearAttentionDims,
    MLADims,
    ModelAttention,
    ModelHybrid,
    ModelMoE,
    ModelMTP,
    YarnScaling,
)
from moefold.models.model_sections import LAYER_TYPES as LAYER_TYPES
from moefold.models.model_sections import MOE_SCORE_FUNCTIONS as MOE_SCORE_FUNCTIONS
from moefold.models.model_sections import QK_NORM_SCOPES as QK_NORM_SCOPES

FAMILIES: tuple[str, ...] = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe", "minimax_m2",
                             "qwen3_next", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa", "nemotron_h",
                             "deepseek_v4")
# the FFNs' activation (dense MLP, shared and routed experts): SwiGLU, or Nemotron-H's ungated squared ReLU
FFN_ACTIVATIONS: tuple[str, ...] = ("swiglu", "relu2")


def _norm_eps(current: Any, v: float) -> dict[str, Any]:
    """Megatron's --norm-epsilon is every norm's eps, MLA's latent norms included (HF fixes those at 1e-6)."""
    mla = {"mla": dataclasses.replace(current("mla"), latent_norm_eps=v)} if current("attention") == "mla" else {}
    return {"norm_eps": v, **mla}


@composed
@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only (MoE) transformer (module docstring). Field names follow HF where they exist.

    Layer ``i`` is an MoE layer when ``num_experts > 0``, ``i >= first_k_dense_replace`` and
    ``moe_layer_pattern[i]`` (derived from ``moe_layer_freq``) is 1. Layer ``i`` attends within
    ``sliding_window`` when it is set and ``sliding_window_pattern`` is None or has a 1 at ``i``. Its token
    mixer is ``layer_types[i]`` (None: attention everywhere; ``linear_attention``: Gated DeltaNet).
    """

    name: str
    family: Literal["deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe", "minimax_m2", "qwen3_next",
                    "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa", "nemotron_h",
                    "deepseek_v4"]
    vocab_size: int
    hidden_size: int = model_flag(MISSING, "model width", "--hidden-size")
    num_layers: int = model_flag(MISSING, "decoder layers (without MTP)", "--num-layers")
    ffn_hidden_size: int = model_flag(0, "dense MLP size", "--ffn-hidden-size")   # the dense MLP layers
    norm_eps: float = model_flag(1e-6, "RMSNorm epsilon", "--norm-epsilon", apply=_norm_eps)
    norm_zero_centered_gamma: bool = False       # every RMSNorm stores gamma - 1 (Megatron --apply-layernorm-1p)
    ffn_activation: str = "swiglu"               # FFN_ACTIVATIONS: of the dense MLP, shared and routed experts
    tie_word_embeddings: bool = model_flag(False, "separate output head (--no-untie-...: tied)",
                                           "--untie-embeddings-and-output-weights",
                                           apply=lambda c, v: {"tie_word_embeddings": not v})
    max_position_embeddings: int = model_flag(4096, "longest sequence the RoPE setup allows",
                                              "--max-position-embeddings")
    self_attention: ModelAttention = field(default_factory=ModelAttention)
    moe: ModelMoE = field(default_factory=ModelMoE)
    mtp: ModelMTP = field(default_factory=ModelMTP)
    hybrid: ModelHybrid = field(default_factory=ModelHybrid)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        """What spans the sections; each section checked its own values when it was made."""
        for name in ("vocab_size", "hidden_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        # Literal hints are not checked at run time
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not one of {FAMILIES}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_layers={self.num_layers}")
        if isinstance(self.moe_layer_freq, tuple) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq pattern has {len(self.moe_layer_freq)} entries, "
                             f"num_layers={self.num_layers}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, "
                             f"num_layers={self.num_layers}]")
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise ValueError(f"ffn_activation={self.ffn_activation!r} is not one of {FFN_ACTIVATIONS}")
        if self.hybrid.one_sublayer:
            wrong = [i for i in range(self.num_layers) if self.is_moe_layer(i) != (self.layer_type(i) == "moe")]
            if wrong:
                raise ValueError(f"layers {wrong[:8]}: in a stack of one-sublayer layers the MoE layers are exactly "
                                 "the layer_types 'moe' ones (set moe_layer_freq to that pattern)")
        dense = [i for i in range(self.num_layers) if not self.is_moe_layer(i) and self.has_ffn(i)]
        if dense and self.ffn_hidden_size <= 0:
            raise ValueError(f"layers {dense[:8]}{'...' if len(dense) > 8 else ''} are dense and need "
                             f"ffn_hidden_size > 0, got {self.ffn_hidden_size}")
        self._check_attention_features()
        if self.v4 is not None or self.family == "deepseek_v4":
            from moefold.models.v4_dims import check_v4_model

            check_v4_model(self)

    def _check_attention_features(self) -> None:
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
        if pattern is not None and (len(pattern) != self.num_layers or any(p not in (0, 1) for p in pattern)):
            raise ValueError(f"sliding_window_pattern={pattern} must hold one 0 (full) or 1 (sliding window) "
                             f"per layer, num_layers={self.num_layers}")

    def has_mixer(self, index: int) -> bool:
        """Layer ``index`` has a token mixer (all but the FFN-only layers of a one-sublayer stack)."""
        return self.layer_type(index) not in FFN_LAYER_TYPES

    def has_ffn(self, index: int) -> bool:
        """Layer ``index`` has an FFN (all but the mixer-only layers of a one-sublayer stack; MTP blocks do)."""
        return index >= self.num_layers or not self.hybrid.one_sublayer or self.layer_type(index) in FFN_LAYER_TYPES

    def layer_type(self, index: int) -> str:
        """The token mixer of layer ``index`` (MTP blocks, ``index >= num_layers``, are attention)."""
        if self.layer_types is None or index >= self.num_layers:
            return "full_attention"
        return self.layer_types[index]

    @property
    def kv_heads(self) -> int:
        return self.self_attention.kv_heads

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
        return self.moe.is_moe_layer(index)

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed, by their flat names or whole sections (recipes derive tiny/proxy versions
        this way)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every value by its flat name, as plain JSON / YAML values (nested dims as mappings, tuples as lists);
        ``from_dict`` reads it back. What a checkpoint's ``moefold_config.json``, a run's ``config.json`` and
        ``config.yaml`` record, as every moefold before the sections wrote it."""
        def plain(value: Any) -> Any:
            if dataclasses.is_dataclass(value):
                return plain(dataclasses.asdict(value))
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        return plain(self.flat_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The config ``to_dict`` (or any earlier moefold's saved config) wrote, flat, nested by section or mixed;
        ValueError naming unknown fields. Each section turns its lists and mappings back into its tuples and dims."""
        unknown = sorted(set(data) - set(cls.FLAT_NAMES) - set(cls.SECTIONS))
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        return cls(**data)


__all__ = ["DSADims", "FAMILIES", "FFN_ACTIVATIONS", "LinearAttentionDims", "MLADims", "ModelConfig", "YarnScaling"]
