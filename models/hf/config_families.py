"""HF ``config.json`` <-> ``ModelConfig`` for GPT-OSS, GLM-4.5/4.6 (``glm4_moe``), OLMoE and MiniMax-M2.

``models.hf.config_map`` dispatches here for these families (Kimi-K2's config is DeepSeek-V3's:
``DeepseekV3ForCausalLM`` with ``model_type: kimi_k2``, read by the DeepSeek-V3 path). Each family
has its reader (``from_hf``), the fields its transformers class hard-codes (``NEEDS``: an export of a
config with another value fails naming it) and its writer (``to_hf``). The values follow transformers
5.24's ``modeling_<family>.py``:

- GPT-OSS: sinks, biases on q/k/v/o, the router and the experts, softmax over the top-k logits (with
  the router bias), clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``, ``up + 1``), ``layer_types``
  of ``sliding_attention`` / ``full_attention``.
- GLM-4.5: DeepSeek-V3's router (sigmoid, expert bias, groups scored by their top 2, scaling), a
  shared expert of ``n_shared_experts * moe_intermediate_size``, ``first_k_dense_replace`` dense
  layers, per-head qk-norm when ``use_qk_norm``, q/k/v bias without an o_proj bias, partial RoPE
  (``partial_rotary_factor``, 0.5 when absent as in transformers), DeepSeek-style MTP layers.
- OLMoE: qk-norm over the whole q and k projections, softmax over all experts (renormalised iff
  ``norm_topk_prob``); ``clip_qkv`` is refused.
- MiniMax-M2: qk-norm over the whole projections, partial RoPE (``rotary_dim`` or
  ``partial_rotary_factor``), sigmoid scores with an expert bias, always renormalised.
"""

from __future__ import annotations

from typing import Any

from moefold.models.config import ModelConfig

ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss", "Glm4MoeForCausalLM": "glm4_moe", "OlmoeForCausalLM": "olmoe",
                 "MiniMaxM2ForCausalLM": "minimax_m2"}
MODEL_TYPES = {"gpt_oss": "gpt_oss", "glm4_moe": "glm4_moe", "olmoe": "olmoe", "minimax_m2": "minimax_m2",
               "kimi_k2": "deepseek_v3"}
FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}
# transformers' config defaults for keys a config.json may leave out, where they differ from config_map's
DEFAULTS = {"gpt_oss": {"attention_bias": True, "rms_norm_eps": 1e-5},
            "glm4_moe": {"rms_norm_eps": 1e-5}, "olmoe": {"rms_norm_eps": 1e-5}, "minimax_m2": {"rms_norm_eps": 1e-6}}
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' partial_rotary_factor where a config leaves it out and it is not 1 (any family of config_map)
PARTIAL_ROTARY_DEFAULTS = {"glm4_moe": 0.5, "qwen3_next": 0.25, "qwen3_5_moe": 0.25}

# ModelConfig fields of features DeepSeek-V3, Qwen3-MoE, Mixtral and Qwen3-Next's HF classes do not have (their
# values there; config_map checks these for every family)
PLAIN: dict[str, Any] = {
    "qk_norm_scope": "head", "partial_rotary_factor": 1.0, "attention_sinks": False, "sliding_window_pattern": None,
    "moe_router_bias": False, "moe_expert_linear_bias": False, "moe_swiglu_alpha": 1.0, "moe_activation_clamp": None,
    "moe_glu_linear_offset": 0.0,
}
# field: the value the family's HF class hard-codes (in addition to PLAIN's, which they override)
NEEDS: dict[str, dict[str, Any]] = {
    "gpt_oss": {"attention": "gqa", "attention_sinks": True, "qk_norm": False, "moe_score_function": "softmax",
                "moe_pre_softmax": False, "moe_router_bias": True, "moe_expert_linear_bias": True,
                "moe_glu_linear_offset": 1.0, "moe_expert_bias": False, "moe_shared_expert_ffn_size": 0,
                "moe_topk_scaling_factor": 1.0, "moe_num_groups": None, "mtp_num_layers": 0},
    "glm4_moe": {"attention": "gqa", "moe_score_function": "sigmoid", "moe_expert_bias": True, "sliding_window": None,
                 "moe_shared_expert_gate": False},
    "olmoe": {"attention": "gqa", "qk_norm": True, "qk_norm_scope": "projection", "moe_score_function": "softmax",
              "moe_pre_softmax": True, "moe_expert_bias": False, "moe_shared_expert_ffn_size": 0,
              "moe_topk_scaling_factor": 1.0, "moe_num_groups": None, "sliding_window": None, "mtp_num_layers": 0,
              "attention_bias": False},
    "minimax_m2": {"attention": "gqa", "qk_norm": True, "qk_norm_scope": "projection", "moe_score_function": "sigmoid",
                   "moe_norm_topk_prob": True, "moe_expert_bias": True, "moe_shared_expert_ffn_size": 0,
                   "moe_topk_scaling_factor": 1.0, "moe_num_groups": None, "sliding_window": None,
                   "mtp_num_layers": 0, "attention_bias": False},
}


# PLAIN fields a family's HF config expresses freely (through layer_types, swiglu_*, partial_rotary_factor)
FREE = {"gpt_oss": ("sliding_window_pattern", "moe_swiglu_alpha", "moe_activation_clamp"),
        "glm4_moe": ("partial_rotary_factor",), "minimax_m2": ("partial_rotary_factor",),
        "qwen3_next": ("partial_rotary_factor",), "qwen3_5_moe": ("partial_rotary_factor",)}


def needs(family: str, base: dict[str, Any]) -> dict[str, Any]:
    """The values the HF class of ``family`` hard-codes: ``base`` (config_map's, for its own families), PLAIN's
    and this module's ``NEEDS``, less what the family expresses (``FREE``)."""
    out = {**PLAIN, **base, **NEEDS.get(family, {})}
    for key in FREE.get(family, ()):
        out.pop(key)
    return out


def first_k_dense(c: ModelConfig, model: str) -> int:
    """HF's ``first_k_dense_replace`` of ``c`` (DeepSeek-V3, GLM-4.5: k dense layers, then MoE ones), or ValueError."""
    moe = [c.is_moe_layer(i) for i in range(c.num_layers)]
    first_k = moe.index(True) if any(moe) else c.num_layers
    if moe != [i >= first_k for i in range(c.num_layers)]:
        raise ValueError(f"{model} export needs k dense layers followed by MoE layers (HF first_k_dense_replace); "
                         f"the MoE layers are {[i for i, m in enumerate(moe) if m]}")
    return first_k


def n_shared_experts(c: ModelConfig) -> int:
    """HF's ``n_shared_experts``: the shared experts' total size in routed-expert units, or ValueError."""
    if c.moe_shared_expert_ffn_size % c.moe_ffn_hidden_size:
        raise ValueError(f"moe_shared_expert_ffn_size={c.moe_shared_expert_ffn_size} is not a multiple of "
                         f"moe_ffn_hidden_size={c.moe_ffn_hidden_size} (HF n_shared_experts)")
    return c.moe_shared_expert_ffn_size // c.moe_ffn_hidden_size


def out_bias_error(c: ModelConfig) -> str | None:
    """Why ``c``'s o_proj bias cannot be written for its family (None: it can)."""
    out_bias = c.attention_bias if c.attention_out_bias is None else c.attention_out_bias
    if c.family == "glm4_moe":
        return None if not out_bias else "GLM-4.5's o_proj has no bias (attention_out_bias must be False)"
    if out_bias != c.attention_bias:
        return (f"attention_out_bias={c.attention_out_bias} differs from attention_bias={c.attention_bias}, "
                f"one flag in HF {c.family}")
    return None


def partial_rotary_factor(hf: dict[str, Any], family: str) -> float:
    """HF's partial RoPE: ``rope_parameters.partial_rotary_factor``, the top-level key of older configs,
    MiniMax-M2's ``rotary_dim`` / head_dim, or transformers' default (``PARTIAL_ROTARY_DEFAULTS``, else 1)."""
    params = hf.get("rope_parameters") or {}
    for source in (params, hf):
        if source.get("partial_rotary_factor") is not None:
            return float(source["partial_rotary_factor"])
    if family == "minimax_m2" and hf.get("rotary_dim"):
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        return int(hf["rotary_dim"]) / int(head_dim)
    return PARTIAL_ROTARY_DEFAULTS.get(family, 1.0)


def _refuse(family: str, what: str) -> ValueError:
    return ValueError(f"{family}: {what} is not supported (transformers 5.24's {FAMILY_ARCH[family]} semantics)")


def _sliding(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """GPT-OSS ``layer_types`` -> sliding_window (+ pattern)."""
    types = list(hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(L)])
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if len(types) != L or bad:
        raise _refuse("gpt_oss", f"layer_types {bad or types} (need {L} of {SLIDING!r} / {FULL!r})")
    window = hf.get("sliding_window")
    if SLIDING not in types:
        return {"sliding_window": None}
    if window is None:
        raise _refuse("gpt_oss", "sliding_attention layers without a sliding_window")
    pattern = tuple(int(t == SLIDING) for t in types)
    return {"sliding_window": int(window), "sliding_window_pattern": None if all(pattern) else pattern}


def from_hf(family: str, hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` of one of this module's families; ``common`` holds config_map's shared fields."""
    common = dict(common)
    for key, field in (("attention_bias", "attention_bias"), ("rms_norm_eps", "norm_eps")):
        if key not in hf and key in DEFAULTS[family]:
            common[field] = DEFAULTS[family][key]
    L = common["num_layers"]
    gqa = dict(num_query_groups=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
               head_dim=hf.get("head_dim"), partial_rotary_factor=partial_rotary_factor(hf, family))
    topk = int(hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 0)
    if family == "gpt_oss":
        return ModelConfig(
            **common, **gqa, **_sliding(hf, L), attention_sinks=True, num_experts=int(hf["num_local_experts"]),
            moe_ffn_hidden_size=int(hf["intermediate_size"]), moe_topk=topk, moe_score_function="softmax",
            moe_router_bias=True, moe_expert_linear_bias=True, moe_swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            moe_activation_clamp=float(hf.get("swiglu_limit", 7.0)), moe_glu_linear_offset=1.0,
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), moe_load_balancing_type="aux_loss")
    if family == "glm4_moe":
        moe_ffn = int(hf["moe_intermediate_size"])
        return ModelConfig(
            **common, **gqa, qk_norm=bool(hf.get("use_qk_norm", False)), attention_out_bias=False,
            ffn_hidden_size=int(hf["intermediate_size"]), num_experts=int(hf["n_routed_experts"]),
            moe_ffn_hidden_size=moe_ffn, moe_topk=topk, moe_score_function="sigmoid",
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            moe_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_num_groups=int(hf.get("n_group") or 1), moe_group_topk=int(hf.get("topk_group") or 1),
            moe_group_score_topk=2, moe_expert_bias=True,
            moe_shared_expert_ffn_size=moe_ffn * int(hf.get("n_shared_experts") or 0),
            first_k_dense_replace=int(hf.get("first_k_dense_replace", 1)), moe_aux_loss_coeff=1e-4,
            moe_load_balancing_type="seq_aux_loss", mtp_num_layers=int(hf.get("num_nextn_predict_layers", 0)))
    if family == "olmoe":   # clip_qkv is refused by config_fields.check_fields
        return ModelConfig(
            **common, **gqa, qk_norm=True, qk_norm_scope="projection", num_experts=int(hf["num_experts"]),
            moe_ffn_hidden_size=int(hf["intermediate_size"]), moe_topk=topk, moe_score_function="softmax",
            moe_pre_softmax=True, moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)), moe_load_balancing_type="aux_loss")
    # minimax_m2: keys of the published config.json that transformers does not read must agree with it
    for key, ok in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer"), ("use_qk_norm", True),
                    ("use_routing_bias", True)):
        if key in hf and hf[key] != ok:
            raise _refuse("minimax_m2", f"{key}={hf[key]!r} (transformers computes {key}={ok!r})")
    if hf.get("shared_intermediate_size"):
        raise _refuse("minimax_m2", f"shared_intermediate_size={hf['shared_intermediate_size']}")
    if any(t != 1 for t in hf.get("attn_type_list") or ()):
        raise _refuse("minimax_m2", "attn_type_list with linear-attention layers (0)")
    return ModelConfig(
        **common, **gqa, qk_norm=True, qk_norm_scope="projection", num_experts=int(hf["num_local_experts"]),
        moe_ffn_hidden_size=int(hf["intermediate_size"]), moe_topk=topk, moe_score_function="sigmoid",
        moe_norm_topk_prob=True, moe_expert_bias=True,
        moe_input_jitter_eps=float(hf.get("router_jitter_noise") or 0) or None,
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), moe_load_balancing_type="aux_loss")


def to_hf(c: ModelConfig, out: dict[str, Any]) -> None:
    """Add the family fields of ``c`` to ``out`` (config_map wrote the shared ones; ``NEEDS`` was checked)."""
    moe = [c.is_moe_layer(i) for i in range(c.num_layers)]
    gqa = {"num_key_value_heads": c.kv_heads, "head_dim": c.attention_head_dim}
    if c.family == "glm4_moe":
        first_k, shared = first_k_dense(c, "GLM-4.5"), n_shared_experts(c)
        # None: Megatron's top topk // group_topk (a Megatron import); one group: no group is ever dropped
        score = c.moe_group_score_topk or (c.moe_topk // c.moe_group_topk if c.moe_group_topk else 2)
        if (c.moe_num_groups or 1) > 1 and score != 2:
            raise ValueError(f"{c.name}: groups scored by their top {score} experts (moe_group_score_topk="
                             f"{c.moe_group_score_topk}); HF GLM-4.5 ranks groups by their top 2")
        out.update(**gqa, attention_bias=c.attention_bias, use_qk_norm=c.qk_norm, intermediate_size=c.ffn_hidden_size,
                   moe_intermediate_size=c.moe_ffn_hidden_size, n_routed_experts=c.num_experts, n_shared_experts=shared,
                   routed_scaling_factor=c.moe_topk_scaling_factor, n_group=c.moe_num_groups or 1,
                   topk_group=c.moe_group_topk or 1, norm_topk_prob=c.moe_norm_topk_prob,
                   first_k_dense_replace=first_k, num_nextn_predict_layers=c.mtp_num_layers)
        return
    if not all(moe):
        raise ValueError(f"{FAMILY_ARCH[c.family]} export needs every layer to be MoE")
    if c.family == "gpt_oss":
        sliding = [c.layer_sliding_window(i) is not None for i in range(c.num_layers)]
        out.update(**gqa, attention_bias=c.attention_bias, intermediate_size=c.moe_ffn_hidden_size,
                   num_local_experts=c.num_experts, sliding_window=c.sliding_window,
                   layer_types=[SLIDING if s else FULL for s in sliding], swiglu_alpha=c.moe_swiglu_alpha,
                   swiglu_limit=c.moe_activation_clamp, router_aux_loss_coef=c.moe_aux_loss_coeff)
    elif c.family == "olmoe":
        out.update(**gqa, intermediate_size=c.moe_ffn_hidden_size, num_experts=c.num_experts,
                   norm_topk_prob=c.moe_norm_topk_prob, router_aux_loss_coef=c.moe_aux_loss_coeff, clip_qkv=None)
        if c.attention_head_dim != c.hidden_size // c.num_attention_heads:
            raise ValueError(f"OLMoE export: head_dim={c.attention_head_dim} must be hidden_size / heads (HF OLMoE "
                             "derives it)")
        del out["head_dim"]
    else:  # minimax_m2
        out.update(**gqa, intermediate_size=c.moe_ffn_hidden_size, num_local_experts=c.num_experts,
                   router_aux_loss_coef=c.moe_aux_loss_coeff, router_jitter_noise=c.moe_input_jitter_eps or 0.0)
        if c.partial_rotary_factor != 1.0:
            out["rotary_dim"] = c.rotary_dim
