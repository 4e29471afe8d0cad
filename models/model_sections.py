"""The concerns ``ModelConfig`` is composed of, each a frozen dataclass that checks its own values once.

    ModelAttention      the attention of every layer: heads, kv heads, GQA features, MLA sizes, RoPE
    ModelMoE            which layers are MoE and how many experts, composed of
        ModelRouter         top-k, scoring, groups, balancing, capacity (``moe.router_config.RouterConfig``'s names)
        ModelExperts        the routed experts' size, biases and gated activation (``moe.config.ExpertsConfig``)
        ModelSharedExperts  the shared experts (``moe.config.SharedExpertsConfig``)
    ModelMTP            multi-token prediction
    ModelHybrid         the token mixer of each layer (Gated DeltaNet's ``linear_attention`` layers)

Every field is also ``ModelConfig``'s flat name (``models.composed``), as the earlier flat ``ModelConfig`` named it:
the field itself where the names agree, else its metadata's ``flat`` (``ModelRouter.topk`` is ``moe_topk``). A
section's field names are the component config's it becomes (``dense.attention_config.AttentionConfig``,
``RouterConfig``, ``ExpertsConfig``, ``SharedExpertsConfig``), so each section hands its values on by name
(``component``). A field made with ``model_flag`` is a model flag of ``moefold train`` (``models.flag_field``).
What spans sections (the layer count against patterns, the hidden size against the rotary dims) ``ModelConfig``
checks. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from moefold.models.composed import composed
from moefold.models.flag_field import GQA_ONLY, MLA_ONLY, model_flag
from moefold.models.flag_values import NONE, int_or_none, layer_pattern, skip_freq_pattern, softmax_type, window
from moefold.models.mamba_dims import MambaDims
from moefold.moe.router_config import (
    AUX_LOSS_COUNTS,
    DROP_POLICIES,
    LOAD_BALANCING_TYPES,
    ROUTER_DTYPES,
    SCORE_FUNCTIONS,
    RouterConfig,
)

if TYPE_CHECKING:   # they import torch; a model's description does not
    from moefold.models.v4_dims import V4Dims
    from moefold.moe.activation import GatedActivation
    from moefold.moe.config import ExpertsConfig, SharedExpertsConfig

ATTENTION_KINDS: tuple[str, ...] = ("gqa", "mla")
MOE_SCORE_FUNCTIONS: tuple[str, ...] = SCORE_FUNCTIONS
QK_NORM_SCOPES: tuple[str, ...] = ("head", "projection")   # must equal dense.attention_config.QK_NORM_SCOPES
# what a layer is (HF ``layer_types``): attention (GQA or MLA), Gated DeltaNet or Mamba-2 (a token mixer, followed
# by the FFN), or, in a stack of one-sublayer layers (Nemotron-H: any "moe" or "mlp"), a mixer alone or an FFN alone
LAYER_TYPES: tuple[str, ...] = ("full_attention", "linear_attention", "mamba", "moe", "mlp")
FFN_LAYER_TYPES: tuple[str, ...] = ("moe", "mlp")


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


def _mla(name: str) -> Any:
    """The apply of an MLA size flag: the model's ``mla`` with that size replaced (``none``: None)."""
    return lambda current, v: {"mla": dataclasses.replace(current("mla"), **{name: None if v == NONE else v})}


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention sizes (DeepSeek-V2/V3)."""

    q_lora_rank: int | None = model_flag(1536, "MLA q compression (none: full q_proj)", "--q-lora-rank",
                                         kinds=MLA_ONLY, parse=int_or_none, apply=_mla("q_lora_rank"))
    kv_lora_rank: int = model_flag(512, "MLA compressed K/V latent size", "--kv-lora-rank", kinds=MLA_ONLY,
                                   apply=_mla("kv_lora_rank"))
    qk_nope_head_dim: int = model_flag(128, "MLA q/k head dim without rope", "--qk-head-dim", kinds=MLA_ONLY,
                                       apply=_mla("qk_nope_head_dim"))
    qk_rope_head_dim: int = model_flag(64, "MLA rope head dim", "--qk-pos-emb-head-dim", kinds=MLA_ONLY,
                                       apply=_mla("qk_rope_head_dim"))
    v_head_dim: int = model_flag(128, "MLA value head dim", "--v-head-dim", kinds=MLA_ONLY, apply=_mla("v_head_dim"))
    rope_interleave: bool = True
    # eps of q_a_layernorm / kv_a_layernorm: transformers and DeepSeek fix it at 1e-6 whatever rms_norm_eps says;
    # Megatron-Core uses its layernorm_epsilon (moefold's --norm-epsilon sets both)
    latent_norm_eps: float = 1e-6


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated DeltaNet sizes of the ``linear_attention`` layers (Qwen3-Next; HF ``linear_*``)."""

    num_key_heads: int = 16
    num_value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel_size: int = 4


def _from_json(owner: object, name: str, kind: type) -> None:
    """JSON round trips (checkpoint meta, run configs, YAML) hand back lists and mappings: store what the field
    promises (a tuple, the dataclass ``kind``; ``kind`` tuple: a tuple)."""
    value = getattr(owner, name)
    if kind is tuple and isinstance(value, list):
        object.__setattr__(owner, name, tuple(value))
    elif kind is not tuple and isinstance(value, dict):
        object.__setattr__(owner, name, kind(**value))


@dataclass(frozen=True)
class DSADims:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer of every MLA layer
    (``dense.dsa_indexer``)."""

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
class ModelAttention:
    """The attention of every layer (``dense.attention_config``'s names; the flat names are HF's).

    kind: ``gqa`` or ``mla`` (flat ``attention``; MLA needs ``mla``). Layer ``i`` attends within ``sliding_window``
    when it is set and ``sliding_window_pattern`` is None or has a 1 at ``i``. ``out_bias`` None: ``bias``."""

    num_attention_heads: int = model_flag(MISSING, "query heads", "--num-attention-heads")
    num_query_groups: int | None = model_flag(None, "kv heads", "--num-query-groups", kinds=GQA_ONLY)
    head_dim: int | None = model_flag(None, "attention head dim", "--kv-channels", kinds=GQA_ONLY)   # None: H / heads
    kind: Literal["gqa", "mla"] = field(default="gqa", metadata={"flat": "attention"})
    mla: MLADims | None = field(default=None, metadata={"flags_of": MLADims})
    qk_norm: bool = model_flag(False, "RMSNorm on q and k heads (Qwen3)", "--qk-layernorm", kinds=GQA_ONLY)
    qk_norm_scope: Literal["head", "projection"] = "head"   # projection: OLMoE / MiniMax-M2 qk-norm over all heads
    sliding_window: int | None = model_flag(None, "sliding window: N, or Megatron's L,0", "--window-size",
                                            kinds=GQA_ONLY, parse=window)
    # per layer 1 = sliding window, 0 = full (GPT-OSS 1, 0, ...)
    sliding_window_pattern: tuple[int, ...] | None = model_flag(
        None, "every N-th layer full attention, the others windowed (GPT-OSS: 2)", "--window-attn-skip-freq",
        kinds=GQA_ONLY, parse=int,
        apply=lambda c, v: {"sliding_window_pattern": skip_freq_pattern(c("num_layers"), v)})
    bias: bool = field(default=False, metadata={"flat": "attention_bias"})
    out_bias: bool | None = field(default=None, metadata={"flat": "attention_out_bias"})   # GLM-4.5: q/k/v only
    # a learned logit per head in every softmax row (GPT-OSS)
    sinks: bool = model_flag(False, "vanilla, or learnable: attention sinks, a learned logit per head (GPT-OSS)",
                             "--softmax-type", kinds=GQA_ONLY, parse=str, flat="attention_sinks",
                             apply=lambda c, v: {"attention_sinks": softmax_type(v)})
    # RoPE on int(head_dim * factor) dims of each head (GLM-4.5: 0.5)
    partial_rotary_factor: float = model_flag(1.0, "fraction of each head's dims RoPE rotates (GLM-4.5, MiniMax-M2: "
                                              "0.5)", "--rotary-percent", kinds=GQA_ONLY)
    output_gate: bool = field(default=False, metadata={"flat": "attention_output_gate"})   # Qwen3-Next's gate
    rope_theta: float = model_flag(10000.0, "RoPE theta", "--rotary-base")
    yarn: YarnScaling | None = None
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA with a lightning indexer picking each query's top keys
    dsa: DSADims | None = None
    # DeepSeek-V4: compressed attentions, hash-routed layers, mHC streams (models.v4_dims)
    v4: V4Dims | None = None

    def __post_init__(self) -> None:
        _from_json(self, "mla", MLADims)
        if isinstance(self.v4, dict):
            from moefold.models.v4_dims import V4Dims  # it imports this file's YarnScaling

            object.__setattr__(self, "v4", V4Dims(**self.v4))
        _from_json(self, "dsa", DSADims)
        if self.dsa is not None and (self.kind != "mla" or self.mla is None or self.mla.q_lora_rank is None):
            raise ValueError("dsa (DeepSeek sparse attention) needs attention='mla' with mla.q_lora_rank set (the "
                             "indexer reads the query latent)")
        _from_json(self, "yarn", YarnScaling)
        _from_json(self, "sliding_window_pattern", tuple)
        if self.num_attention_heads <= 0:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be positive")
        # Literal hints are not checked at run time, and a wrong value would otherwise silently build
        # the other kind (any attention that is not "mla" becomes GQA)
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.kind!r} is not one of {ATTENTION_KINDS}")
        if self.num_attention_heads % self.kv_heads != 0:
            raise ValueError(f"num_query_groups={self.kv_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.kind == "mla" and self.mla is None:
            raise ValueError("attention='mla' needs mla=MLADims(...)")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope={self.qk_norm_scope!r} is not one of {QK_NORM_SCOPES}")
        if not 0 <= self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in [0, 1] (0: no RoPE)")
        if self.sliding_window_pattern is not None and self.sliding_window is None:
            raise ValueError("sliding_window_pattern needs sliding_window (the window of its layers marked 1)")

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass(frozen=True)
class ModelRouter:
    """The router of every MoE layer, by ``moe.router_config.RouterConfig``'s names (the flat names are ``moe_`` and
    these, as the earlier ``ModelConfig`` had them). HF semantics per family:

    - Mixtral: softmax over the top-k logits (= softmax over all, renormalised over the k).
    - Qwen3-MoE: softmax over all experts (``pre_softmax``), renormalised iff ``norm_topk_prob``.
    - DeepSeek-V3: sigmoid, group-limited (group score = sum of the top 2), expert bias for selection,
      renormalised and scaled by ``routed_scaling_factor``.

    ``RouterConfig`` checks the values when the layers are built; this section checks what names a model kind (the
    score function) and leaves the rest to it, so each is checked once."""

    topk: int = model_flag(2, "experts per token", "--moe-router-topk", flat="moe_topk")
    score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = model_flag(
        "softmax", "router scores: softmax (Qwen3, Mixtral), sigmoid (DeepSeek-V3) or sqrtsoftplus (sqrt(softplus))",
        "--moe-router-score-function",
        group="router", choices=SCORE_FUNCTIONS, flat="moe_score_function")
    pre_softmax: bool = model_flag(False, "softmax over all experts before the top-k (off: over the k selected)",
                                   "--moe-router-pre-softmax", group="router", flat="moe_pre_softmax")
    norm_topk_prob: bool = field(default=True, metadata={"flat": "moe_norm_topk_prob"})
    topk_scaling_factor: float = model_flag(1.0, "scale of the selected probabilities (DeepSeek-V3: 2.5)",
                                            "--moe-router-topk-scaling-factor", group="router",
                                            flat="moe_topk_scaling_factor")
    num_groups: int | None = model_flag(None, "expert groups of group-limited routing (DeepSeek-V3: 8)",
                                        "--moe-router-num-groups", group="router", flat="moe_num_groups")
    group_topk: int | None = model_flag(None, "groups a token may route to (DeepSeek-V3: 4)", "--moe-router-group-topk",
                                        group="router", flat="moe_group_topk")
    # experts summed per group score; None = topk // group_topk
    group_score_topk: int | None = field(default=None, metadata={"flat": "moe_group_score_topk"})
    # aux-loss-free balancing bias (DeepSeek-V3)
    enable_expert_bias: bool = model_flag(False, "aux-loss-free balancing: a per-expert selection bias updated after "
                                          "each step (DeepSeek-V3)", "--moe-router-enable-expert-bias", group="router",
                                          flat="moe_expert_bias")
    aux_loss_coeff: float = model_flag(0.0, "weight of the load-balancing loss (--moe-router-load-balancing-type)",
                                       "--moe-aux-loss-coeff", group="router", override=True, flat="moe_aux_loss_coeff")
    load_balancing_type: str = model_flag(
        "aux_loss", "the balancing loss --moe-aux-loss-coeff weighs: per micro-batch, per sequence, over the global "
        "batch, or none; or quantile_balancing: a per-expert selection bias from the load quantile, no loss",
        "--moe-router-load-balancing-type", group="router", override=True,
        choices=LOAD_BALANCING_TYPES, flat="moe_load_balancing_type")
    quantile_balancing_ema: float = model_flag(
        0.0, "quantile balancing: the share of the previous step's bias kept (0: the latest quantile)",
        "--moe-router-quantile-balancing-ema", group="router", override=True,
        flat="moe_router_quantile_balancing_ema")
    aux_loss_counts: str = model_flag(
        "topk", "token counts of the balancing losses: topk (default; Megatron-Core, DeepSeek-V3's indicator: a plain "
        "top-k of the scores) or dispatched (moefold's earlier: the routing with expert bias and group limit, so the "
        "loss balances what the experts receive)", "--moe-aux-loss-counts", group="megatron", override=True,
        choices=AUX_LOSS_COUNTS, flat="moe_aux_loss_counts")
    z_loss_coeff: float | None = model_flag(None, "router z-loss coefficient (ST-MoE); unset: off",
                                            "--moe-z-loss-coeff", group="router", override=True,
                                            flat="moe_z_loss_coeff")
    input_jitter_eps: float | None = model_flag(None, "training only: multiply router inputs by uniform noise in "
                                                "[1-eps, 1+eps]", "--moe-input-jitter-eps", group="router",
                                                override=True, flat="moe_input_jitter_eps")
    router_dtype: str = model_flag("fp32", "precision of the gating GEMM and scores", "--moe-router-dtype",
                                   group="router", override=True, choices=ROUTER_DTYPES, flat="moe_router_dtype")
    bias_update_rate: float = model_flag(1e-3, "the expert bias's step per update (--moe-router-enable-expert-bias)",
                                         "--moe-router-bias-update-rate", group="router", override=True,
                                         flat="moe_bias_update_rate")
    expert_capacity_factor: float | None = model_flag(
        None, "expert capacity as a multiple of the balanced load; copies over it are dropped (unset: dropless)",
        "--moe-expert-capacity-factor", group="router", override=True, flat="moe_expert_capacity_factor")
    # per expert-parallel rank (Megatron's HybridEP budget)
    expert_rank_capacity_factor: float | None = model_flag(
        None, "Megatron's per-rank budget: an expert-parallel rank receives at most C x its share of the copies; only "
        "above it are copies dropped (unset: dropless)", "--moe-expert-rank-capacity-factor", group="router",
        override=True, flat="moe_expert_rank_capacity_factor")
    token_drop_policy: str = model_flag("probs", "which copies a full expert drops: the lowest probabilities or the "
                                        "latest positions", "--moe-token-drop-policy", group="router", override=True,
                                        choices=DROP_POLICIES, flat="moe_token_drop_policy")
    pad_expert_input_to_capacity: bool = model_flag(
        False, "pad each expert's input to its capacity: static shapes, no host sync (needs "
        "--moe-expert-capacity-factor)", "--moe-pad-expert-input-to-capacity", group="router", override=True,
        flat="moe_pad_expert_input_to_capacity")
    force_load_balancing: bool = model_flag(False, "benchmarks only: route by random logits (balanced loads)",
                                            "--moe-router-force-load-balancing", group="router", override=True,
                                            flat="moe_router_force_load_balancing")
    bias: bool = field(default=False, metadata={"flat": "moe_router_bias"})   # learned logit bias (GPT-OSS)

    def __post_init__(self) -> None:
        if self.score_function not in MOE_SCORE_FUNCTIONS:
            raise ValueError(f"moe_score_function={self.score_function!r} is not one of {MOE_SCORE_FUNCTIONS}")

    def component(self, num_experts: int, init_std: float) -> RouterConfig:
        """The ``RouterConfig`` of the MoE layers: these values by name, three resolved (pre-softmax only with
        softmax; post-top-k softmax is normalised by definition; a scale of 1 is none)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        pre = self.pre_softmax and self.score_function == "softmax"
        norm = None if self.score_function == "softmax" and not pre else self.norm_topk_prob
        scale = self.topk_scaling_factor if self.topk_scaling_factor != 1.0 else None
        return RouterConfig(**{**values, "pre_softmax": pre, "norm_topk_prob": norm, "topk_scaling_factor": scale},
                            num_experts=num_experts, init_std=init_std)


@dataclass(frozen=True)
class ModelExperts:
    """The routed experts (``moe.config.ExpertsConfig``'s names): their FFN size, biases (GPT-OSS) and gated
    activation ``act(g) = g * sigmoid(alpha * g)``, gate clamped ``<= c`` and up to ``[-c, c]``, times ``up +
    offset`` (GPT-OSS: 1.702, 7, 1; ``moe.activation.GatedActivation``)."""

    ffn_hidden_size: int = model_flag(0, "routed expert size", "--moe-ffn-hidden-size", flat="moe_ffn_hidden_size")
    bias: bool = field(default=False, metadata={"flat": "moe_expert_linear_bias"})
    swiglu_alpha: float = field(default=1.0, metadata={"flat": "moe_swiglu_alpha"})
    activation_clamp: float | None = model_flag(None, "experts' SwiGLU: gate <= c, up in [-c, c] (GPT-OSS: 7)",
                                                "--activation-func-clamp-value", flat="moe_activation_clamp")
    glu_linear_offset: float = model_flag(0.0, "experts' SwiGLU: act(gate) * (up + offset) (GPT-OSS: 1)",
                                          "--glu-linear-offset", flat="moe_glu_linear_offset")

    def __post_init__(self) -> None:
        if self.activation_clamp is not None and not self.activation_clamp > 0:
            raise ValueError(f"moe_activation_clamp={self.activation_clamp} must be > 0 (or None)")
        if not self.swiglu_alpha > 0:
            raise ValueError(f"moe_swiglu_alpha={self.swiglu_alpha} must be > 0")

    @property
    def glu(self) -> GatedActivation:
        from moefold.moe.activation import GatedActivation

        return GatedActivation(self.swiglu_alpha, self.activation_clamp, self.glu_linear_offset)

    def component(self, **run: Any) -> ExpertsConfig:
        """The ``ExpertsConfig`` of the MoE layers (``run``: how they are computed: gemm backend, init, FP8)."""
        from moefold.moe.config import ExpertsConfig

        return ExpertsConfig(ffn_hidden_size=self.ffn_hidden_size, bias=self.bias, glu=self.glu, **run)


@dataclass(frozen=True)
class ModelSharedExperts:
    """The shared experts (``moe.config.SharedExpertsConfig``'s names): ``ffn_size`` of all of them together (0:
    none), ``gate``: Qwen2-MoE's sigmoid gate."""

    ffn_size: int = model_flag(0, "shared experts' total size (0: none)", "--moe-shared-expert-intermediate-size",
                               flat="moe_shared_expert_ffn_size")
    gate: bool = field(default=False, metadata={"flat": "moe_shared_expert_gate"})

    def component(self, init_std: float) -> SharedExpertsConfig | None:
        """The ``SharedExpertsConfig`` (None: no shared experts)."""
        if not (self.ffn_size or self.gate):
            return None
        from moefold.moe.config import SharedExpertsConfig

        return SharedExpertsConfig(self.ffn_size, gate=self.gate, init_std=init_std)


@composed
@dataclass(frozen=True)
class ModelMoE:
    """Which layers are MoE and of what: layer ``i`` is an MoE layer when ``num_experts > 0``, ``i >=
    first_k_dense_replace`` and ``layer_freq`` (every N-th layer, or a 0/1 pattern per layer) selects it.
    ``apply_probs_on_input``: top-1: x * prob before the expert (default: inside the expert's activation)."""

    num_experts: int = model_flag(0, "routed experts per MoE layer (0: a dense model)", "--num-experts")
    first_k_dense_replace: int = 0
    layer_freq: int | tuple[int, ...] = model_flag(
        1, 'MoE layers: N (every N-th) or a 0/1 pattern such as "([0]*3+[1]*58)"', "--moe-layer-freq",
        parse=layer_pattern, flat="moe_layer_freq",
        apply=lambda c, v: {"moe_layer_freq": v, "first_k_dense_replace": 0})
    apply_probs_on_input: bool = model_flag(False, "top-1: scale the token by its probability before the expert (off: "
                                            "inside the expert, its activation times the probability)",
                                            "--moe-apply-probs-on-input",
                                            group="router", override=True, flat="moe_apply_probs_on_input")
    latent_size: int | None = model_flag(None, "latent experts: the exchange and the routed experts at this width, "
                                         "projected down from and back up to the hidden size (unset: off)",
                                         "--moe-latent-size", flat="moe_latent_size")
    router: ModelRouter = field(default_factory=ModelRouter)
    experts: ModelExperts = field(default_factory=ModelExperts)
    shared: ModelSharedExperts = field(default_factory=ModelSharedExperts)

    def __post_init__(self) -> None:
        _from_json(self, "layer_freq", tuple)
        if self.num_experts > 0:
            if not 1 <= self.router.topk <= self.num_experts:
                raise ValueError(f"moe_topk={self.router.topk} must be in [1, num_experts={self.num_experts}]")
            if self.experts.ffn_hidden_size <= 0:
                raise ValueError(f"moe_ffn_hidden_size={self.experts.ffn_hidden_size} must be positive with experts")
        if self.latent_size is not None and self.latent_size < 1:
            raise ValueError(f"moe_latent_size={self.latent_size} must be a positive width (or unset)")
        if isinstance(self.layer_freq, int) and self.layer_freq < 1:
            raise ValueError(f"moe_layer_freq={self.layer_freq} must be >= 1 (or a 0/1 pattern per layer)")

    def is_moe_layer(self, index: int) -> bool:
        if self.num_experts == 0 or index < self.first_k_dense_replace:
            return False
        if isinstance(self.layer_freq, tuple):
            return bool(self.layer_freq[index])
        return index % self.layer_freq == 0


@dataclass(frozen=True)
class ModelMTP:
    """Multi-token prediction (DeepSeek-V3): ``num_layers`` extra depths, their loss weighed by
    ``loss_scaling_factor`` (Megatron's ``--mtp-loss-scaling-factor``)."""

    num_layers: int = model_flag(0, "multi-token prediction depths", "--mtp-num-layers", flat="mtp_num_layers")
    loss_scaling_factor: float = field(default=0.1, metadata={"flat": "mtp_loss_scaling_factor"})

    def __post_init__(self) -> None:
        if self.num_layers < 0:
            raise ValueError(f"mtp_num_layers={self.num_layers} must be >= 0")
        if self.num_layers > 0 and not self.loss_scaling_factor >= 0:
            raise ValueError(f"mtp_loss_scaling_factor={self.loss_scaling_factor} must be >= 0")


@dataclass(frozen=True)
class ModelHybrid:
    """The token mixer of each layer (Qwen3-Next): ``layer_types`` (one of ``LAYER_TYPES`` per layer; None: attention
    everywhere) and the Gated DeltaNet sizes of its ``linear_attention`` layers."""

    layer_types: tuple[str, ...] | None = None
    linear_attention: LinearAttentionDims | None = None
    mamba: MambaDims | None = None   # the ``mamba`` layers' Mamba-2 sizes (Nemotron-H)

    def __post_init__(self) -> None:
        _from_json(self, "layer_types", tuple)
        _from_json(self, "linear_attention", LinearAttentionDims)
        _from_json(self, "mamba", MambaDims)
        if self.layer_types is None:
            return
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types holds {bad}; valid: {LAYER_TYPES}")
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ValueError("layer_types has linear_attention layers: they need "
                             "linear_attention=LinearAttentionDims(...)")
        if "mamba" in self.layer_types and self.mamba is None:
            raise ValueError("layer_types has mamba layers: they need mamba=MambaDims(...)")

    @property
    def one_sublayer(self) -> bool:
        """Each layer is one pre-norm sublayer, a token mixer or an FFN (Nemotron-H's blocks)."""
        return self.layer_types is not None and any(t in FFN_LAYER_TYPES for t in self.layer_types)


__all__ = ["ATTENTION_KINDS", "DSADims", "FFN_LAYER_TYPES", "LAYER_TYPES", "MambaDims", "MOE_SCORE_FUNCTIONS",
           "QK_NORM_SCOPES", "LinearAttentionDims",
           "MLADims",
           "ModelAttention", "ModelExperts", "ModelHybrid", "ModelMTP", "ModelMoE", "ModelRouter",
           "ModelSharedExperts", "YarnScaling"]
