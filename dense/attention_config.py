"""Typed configs of the two attention kinds, validated where each field is declared.

``AttentionConfig``: GQA self-attention (Qwen3-MoE, Mixtral, GPT-OSS, GLM-4.5, OLMoE, MiniMax-M2): heads,
kv heads (``num_query_groups``), optional qk-norm (per head or over the whole projection), sliding window,
attention sinks, partial RoPE, biases, Qwen3-Next's output gate. ``MLAConfig``: DeepSeek-V3
multi-latent attention. Both carry the RoPE settings, the context-parallel exchange mode and
the recompute choice; ``check_parallel(tp, cp)`` checks a layout against them (the attention
modules call it at construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from moefold.dense.choices import CPComm
from moefold.dense.context_parallel import CP_COMM_MODES, check_context_parallel_seq_length
from moefold.dense.recompute import check_recompute
from moefold.dense.rope import YarnConfig


class QKNormScope(StrEnum):
    """Where the q/k RMSNorm's weights apply: per head (Qwen3) or over the whole projection (OLMoE, MiniMax-M2)."""

    HEAD = "head"
    PROJECTION = "projection"


QK_NORM_SCOPES: tuple[str, ...] = tuple(s.value for s in QKNormScope)


def _positive_int(cls: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{cls}.{name}={value!r} must be a positive integer")


def _check_common(cls: str, cfg: AttentionConfig | MLAConfig) -> None:
    _positive_int(cls, "hidden_size", cfg.hidden_size)
    _positive_int(cls, "num_heads", cfg.num_heads)
    if not cfg.norm_eps > 0:
        raise ValueError(f"{cls}.norm_eps={cfg.norm_eps!r} must be > 0")
    if not cfg.rope_theta > 1:
        raise ValueError(f"{cls}.rope_theta={cfg.rope_theta!r} must be > 1")
    if cfg.yarn is not None and not isinstance(cfg.yarn, YarnConfig):
        raise ValueError(f"{cls}.yarn must be a dense.rope.YarnConfig or None, got {type(cfg.yarn).__name__}")
    if cfg.cp_comm not in CP_COMM_MODES:
        raise ValueError(f"{cls}.cp_comm={cfg.cp_comm!r} is not one of {CP_COMM_MODES}")
    object.__setattr__(cfg, "cp_comm", CPComm(cfg.cp_comm))   # the layers compare the enum
    # "selective": the attention module checkpoints its core attention; "full": TransformerBlock
    # checkpoints the whole block and the attention module does nothing extra
    object.__setattr__(cfg, "recompute", check_recompute(cfg.recompute, f"{cls}.recompute"))
    if not cfg.init_std > 0:
        raise ValueError(f"{cls}.init_std={cfg.init_std!r} must be > 0")
    if cfg.seq_length is not None:
        _positive_int(cls, "seq_length", cfg.seq_length)


def _check_layout(cls: str, cfg: AttentionConfig | MLAConfig, tp: int, cp: int) -> None:
    if cfg.num_heads % tp != 0:
        raise ValueError(f"{cls}: num_heads={cfg.num_heads} is not divisible by tp={tp}")
    if cfg.seq_length is not None:
        check_context_parallel_seq_length(cfg.seq_length, cp)


@dataclass(frozen=True)
class AttentionConfig:
    """GQA causal self-attention, HF ``Qwen3MoeAttention`` / ``MixtralAttention`` semantics.

    ``num_query_groups``: kv heads (None: = num_heads, plain multi-head). ``head_dim``: None ->
    hidden_size // num_heads. ``qk_norm``: RMSNorm over head_dim on q and k before RoPE (Qwen3).
    ``sliding_window``: a query sees keys with ``0 <= q_pos - k_pos < sliding_window`` (Mixtral).
    ``bias``: bias on q/k/v/o projections (HF ``attention_bias``). ``seq_length``: when set, the
    training sequence length, checked against ``2*cp`` at construction.

    ``rotary_dim``: RoPE on the first ``rotary_dim`` dims of each head, the rest passes through (None: all; 0: no
    positional encoding, Nemotron-H).
    Qwen3-Next's gated attention: ``output_gate`` (q_proj also yields a per-head gate, the attention output
    is multiplied by its sigmoid before o_proj), ``zero_centered_gamma`` (q/k norms store ``gamma - 1``,
    ``dense.norm.RMSNorm``).
    """

    hidden_size: int
    num_heads: int
    num_query_groups: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    qk_norm_scope: QKNormScope = QKNormScope.HEAD
    norm_eps: float = 1e-6
    sliding_window: int | None = None
    sinks: bool = False
    rotary_dim: int | None = None
    bias: bool = False
    out_bias: bool | None = None
    rope_theta: float = 10000.0
    yarn: YarnConfig | None = None
    cp_comm: CPComm = CPComm.P2P
    recompute: str = "none"
    init_std: float = 0.02
    seq_length: int | None = None
    output_gate: bool = False
    zero_centered_gamma: bool = False
    max_logit: bool = False   # record each head's largest logit in training forwards (QK-clip: training.optim.qk_clip)

    def __post_init__(self) -> None:
        _check_common("AttentionConfig", self)
        if self.max_logit and self.qk_norm:
            raise ValueError("AttentionConfig: max_logit (--qk-clip) with qk_norm: the q/k norms undo a clip of the "
                             "projections; QK-clip is for attention without qk-norm")
        if self.num_query_groups is not None:
            _positive_int("AttentionConfig", "num_query_groups", self.num_query_groups)
            if self.num_heads % self.num_query_groups != 0:
                raise ValueError(f"AttentionConfig: num_query_groups={self.num_query_groups} (kv heads) does not "
                                 f"divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(f"AttentionConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}; set head_dim explicitly")
        if self.head_dim is not None:
            _positive_int("AttentionConfig", "head_dim", self.head_dim)
        if self.rotary_dim is None and self.head_dim_resolved % 2 != 0:
            raise ValueError(f"AttentionConfig: head_dim={self.head_dim_resolved} must be even (RoPE)")
        if self.sliding_window is not None:
            _positive_int("AttentionConfig", "sliding_window", self.sliding_window)
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"AttentionConfig.qk_norm_scope={self.qk_norm_scope!r} is not one of {QK_NORM_SCOPES}")
        object.__setattr__(self, "qk_norm_scope", QKNormScope(self.qk_norm_scope))
        if self.rotary_dim is not None:
            if self.rotary_dim != 0:   # 0: no positional encoding (NoPE: Nemotron-H's attention layers)
                _positive_int("AttentionConfig", "rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or self.rotary_dim > self.head_dim_resolved:
                raise ValueError(f"AttentionConfig: rotary_dim={self.rotary_dim} must be even and at most "
                                 f"head_dim={self.head_dim_resolved}")

    @property
    def out_bias_resolved(self) -> bool:
        return self.bias if self.out_bias is None else self.out_bias

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def head_dim_resolved(self) -> int:
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def rotary_dim_resolved(self) -> int:
        return self.head_dim_resolved if self.rotary_dim is None else self.rotary_dim

    def check_parallel(self, tp: int, cp: int = 1) -> None:
        """Raise ValueError unless heads, kv heads and sequence split over ``tp`` x ``cp``.

        kv heads are split over tp when ``kv_heads % tp == 0``, else replicated (Megatron-style),
        which needs ``tp % kv_heads == 0``."""
        _check_layout("AttentionConfig", self, tp, cp)
        g = self.kv_heads
        if g % tp != 0 and tp % g != 0:
            raise ValueError(f"AttentionConfig: num_query_groups={g} (kv heads) must be divisible by tp={tp} "
                             f"(split) or divide it (replicated)")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V3 multi-latent attention, HF ``DeepseekV3Attention`` semantics.

    ``q_lora_rank``: None -> a full q_proj, else q_a_proj -> q_a_layernorm -> q_b_proj.
    ``kv_lora_rank``: the compressed KV latent. Query/key head dim = qk_nope_head_dim +
    qk_rope_head_dim; the rope part of the key is one head shared by all heads. ``rope_interleave``:
    HF ``rope_interleave`` (DeepSeek checkpoints: True). ``bias``: HF ``attention_bias`` (on
    q_a_proj, kv_a_proj_with_mqa and o_proj). Softmax scale qk_head_dim^-0.5 times YaRN's
    ``mscale(factor, mscale_all_dim)^2``.
    """

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    norm_eps: float = 1e-6
    latent_norm_eps: float | None = None
    bias: bool = False
    rope_theta: float = 10000.0
    yarn: YarnConfig | None = None
    cp_comm: CPComm = CPComm.P2P
    recompute: str = "none"
    init_std: float = 0.02
    seq_length: int | None = None

    def __post_init__(self) -> None:
        _check_common("MLAConfig", self)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int("MLAConfig", name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("MLAConfig", "q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE)")
        if self.latent_norm_eps is not None and not self.latent_norm_eps > 0:
            raise ValueError(f"MLAConfig.latent_norm_eps={self.latent_norm_eps!r} must be > 0 (or None: norm_eps)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check_parallel(self, tp: int, cp: int = 1) -> None:
        """Raise ValueError unless heads and sequence split over ``tp`` x ``cp``."""
        _check_layout("MLAConfig", self, tp, cp)
