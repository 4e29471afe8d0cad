"""HF ``config.json`` <-> ``ModelConfig`` for DeepSeek-V3 (and Kimi-K2, which is DeepSeek-V3's architecture),
Qwen3-MoE, Mixtral, Qwen3-Next and Qwen3.5-MoE (their own fields in ``models.hf.qwen3_next`` and
``models.hf.qwen3_5_moe``; no transformers needed), and their
dense relatives Qwen3 and Mistral (read as the family with ``num_experts=0``: what upcycling starts from).
GPT-OSS, GLM-4.5, OLMoE and MiniMax-M2 are read and written by ``models.hf.config_families``.

Reads both the transformers-5 layout (``rope_parameters``) and the older one (``rope_theta`` +
``rope_scaling``). Unknown architectures and unsupported features fail naming the value.

Round trip: ``from_hf_config`` keeps the dict it read in ``ModelConfig.extra["hf_config"]``, and
``to_hf_config`` starts from it, so every field moefold does not model (``bos/eos/pad_token_id``,
``initializer_range``, ``use_cache``, ``transformers_version``, ...) is written back unchanged, and a
field whose meaning did not change keeps its original spelling (Qwen3's ``num_experts`` or
``num_local_experts``, ``rope_parameters`` or ``rope_theta`` + ``rope_scaling``, ``dtype`` or
``torch_dtype``, ``decoder_sparse_step``).
"""

from __future__ import annotations

from typing import Any

from moefold.models.config import DSADims, MLADims, ModelConfig, YarnScaling
from moefold.models.hf import config_families as more
from moefold.models.hf import deepseek_v4, nemotron_h, qwen3_5_moe, qwen3_next
from moefold.models.hf.config_fields import READ, check_fields, config_class

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v32",
                 "GlmMoeDsaForCausalLM": "glm_moe_dsa",
                 "Qwen3MoeForCausalLM": "qwen3_moe",
                 "MixtralForCausalLM": "mixtral", "Qwen3ForCausalLM": "qwen3_moe", "MistralForCausalLM": "mixtral",
                 qwen3_next.ARCHITECTURE: "qwen3_next", qwen3_5_moe.ARCHITECTURE: "qwen3_5_moe",
                 nemotron_h.ARCHITECTURE: "nemotron_h", **more.ARCHITECTURES,
                 deepseek_v4.ARCHITECTURE: "deepseek_v4"}
MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm_moe_dsa",
               "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "qwen3": "qwen3_moe",
               "mistral": "mixtral", "qwen3_next": "qwen3_next", qwen3_5_moe.MODEL_TYPE: "qwen3_5_moe",
               nemotron_h.MODEL_TYPE: "nemotron_h", **more.MODEL_TYPES,
               deepseek_v4.MODEL_TYPE: "deepseek_v4"}
FAMILY_ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
               "glm_moe_dsa": "GlmMoeDsaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "mixtral": "MixtralForCausalLM", "qwen3_next": qwen3_next.ARCHITECTURE,
               "qwen3_5_moe": qwen3_5_moe.ARCHITECTURE, "nemotron_h": nemotron_h.ARCHITECTURE, **more.FAMILY_ARCH,
               "deepseek_v4": deepseek_v4.ARCHITECTURE}
FAMILY_MODEL_TYPE = {"qwen3_5_moe": qwen3_5_moe.MODEL_TYPE}   # where the HF model_type is not the family's name
# the dense model of a family (no experts): what upcycling turns into the family's MoE
DENSE_ARCH = {"qwen3_moe": ("Qwen3ForCausalLM", "qwen3"), "mixtral": ("MistralForCausalLM", "mistral")}
DENSE_MODEL_TYPES = {"qwen3", "mistral"}
# the DeepSeek sparse attention families (DeepSeek-V3.2's reading of DeepSeek-V3's fields, plus the indexer)
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
# transformers' defaults of a GLM-5 config.json that leaves them out, where config_map's differ
_DSA_DEFAULTS = {"glm_moe_dsa": {"rms_norm_eps": 1e-5, "index_n_heads": 32}}


def is_dense_hf(hf: dict[str, Any]) -> bool:
    """The HF config describes a dense model (Qwen3, Mistral): no experts anywhere."""
    archs = [a for a in hf.get("architectures") or () if a in ARCHITECTURES]
    if archs:
        return archs[0] in {a for a, _ in DENSE_ARCH.values()}
    return hf.get("model_type") in DENSE_MODEL_TYPES


def family_of(hf: dict[str, Any]) -> str:
    """The moefold family of an HF config dict, from ``architectures`` or ``model_type``."""
    for arch in hf.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    raise ValueError(f"unknown architecture: architectures={hf.get('architectures')}, model_type="
                     f"{hf.get('model_type')!r}; supported: {', '.join(ARCHITECTURES)}")


def _rope(hf: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) as transformers reads them (``_compute_yarn_parameters``): ``factor`` defaults to
    max_position_embeddings / original_max_position_embeddings, which defaults to max_position_embeddings; a zero
    or missing beta to 32 / 1; a missing mscale or mscale_all_dim is no term (0); ``attention_factor`` overrides
    the inferred cos/sin scale. Rope types other than default and yarn are refused, naming the type."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope = {**scaling, **params}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise ValueError(f"rope_type={kind!r} is not supported (supported: default, yarn)")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    original = int(rope.get("original_max_position_embeddings") or max_pos)
    factor = rope.get("factor")
    attention_factor = rope.get("attention_factor")
    return theta, YarnScaling(factor=float(max_pos / original if factor is None else factor),
                              original_max_position_embeddings=original,
                              beta_fast=float(rope.get("beta_fast") or 32.0),
                              beta_slow=float(rope.get("beta_slow") or 1.0),
                              mscale=float(rope.get("mscale") or 0.0),
                              mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                              truncate=bool(rope.get("truncate", True)),
                              attention_factor=None if attention_factor is None else float(attention_factor))


def _pattern(num_layers: int, moe: list[bool]) -> int | tuple[int, ...]:
    return 1 if all(moe) else tuple(int(m) for m in moe)


def from_hf_config(hf: dict[str, Any], name: str | None = None) -> ModelConfig:
    """``ModelConfig`` from a parsed HF ``config.json`` (kept in ``extra["hf_config"]`` for the export)."""
    family = family_of(hf)
    if family == "deepseek_v4":   # its own reading of every field (models.hf.deepseek_v4)
        config = deepseek_v4.config_from_hf(hf, name or hf.get("_name_or_path") or family)
        return config.with_(extra={"hf_config": dict(hf)})
    check_fields(hf)
    if family == "nemotron_h":   # its own reading: one-sublayer layers, no num_hidden_layers needed
        return nemotron_h.config_from_hf(hf, name or hf.get("_name_or_path") or family)
    original, hf = hf, {**_DSA_DEFAULTS.get(family, {}), **hf}
    theta, yarn = _rope(hf)
    L = int(hf["num_hidden_layers"])
    common = dict(name=name or hf.get("_name_or_path") or family, family=family, vocab_size=int(hf["vocab_size"]),
                  hidden_size=int(hf["hidden_size"]), num_layers=L, num_attention_heads=int(hf["num_attention_heads"]),
                  rope_theta=theta, yarn=yarn, max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                                                                              False)),
                  attention_bias=bool(hf.get("attention_bias", False)) and "attention_bias" in READ.get(
                      config_class(hf), ()), extra={"hf_config": dict(original)})
    if family in more.NEEDS:
        return more.from_hf(family, hf, common)
    if family == "qwen3_next":
        return qwen3_next.config_from_hf(hf, common)
    if family == "qwen3_5_moe":
        return qwen3_5_moe.config_from_hf(hf, common)
    if family == "deepseek_v3" or family in DSA_FAMILIES:
        kv_heads = hf.get("num_key_value_heads")
        if kv_heads is not None and int(kv_heads) != common["num_attention_heads"]:
            raise ValueError(f"deepseek_v3: num_key_value_heads={kv_heads} is not supported (MLA has a key and value "
                             f"per head: transformers needs num_attention_heads={common['num_attention_heads']})")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"DeepSeek-V3 with scoring_func={hf.get('scoring_func')!r}, topk_method="
                             f"{hf.get('topk_method')!r} is not supported (sigmoid / noaux_tc)")
        E, first_k, freq = int(hf["n_routed_experts"]), int(hf.get("first_k_dense_replace", 0)), \
            int(hf.get("moe_layer_freq", 1))
        moe_ffn = int(hf["moe_intermediate_size"])
        q_lora = hf.get("q_lora_rank")
        v32 = _deepseek_v32(hf, L, family) if family in DSA_FAMILIES else {}
        config = ModelConfig(
            **common, num_query_groups=None, attention="mla",
            mla=MLADims(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(hf["kv_lora_rank"]),
                        qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                        v_head_dim=int(hf["v_head_dim"]),
                        # DeepSeek-V3.2's class has no rope_interleave: always interleaved
                        rope_interleave=bool(hf.get("rope_interleave", True)) or family in DSA_FAMILIES),
            ffn_hidden_size=int(hf["intermediate_size"]), num_experts=E, moe_ffn_hidden_size=moe_ffn,
            moe_topk=int(hf["num_experts_per_tok"]), moe_score_function="sigmoid",
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            moe_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_num_groups=hf.get("n_group"), moe_group_topk=hf.get("topk_group"),
            moe_group_score_topk=2 if hf.get("n_group") else None, moe_expert_bias=True,
            moe_shared_expert_ffn_size=moe_ffn * int(hf.get("n_shared_experts") or 0), first_k_dense_replace=first_k,
            moe_layer_freq=_pattern(L, [i >= first_k and i % freq == 0 for i in range(L)]) if freq != 1 else 1,
            moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 1e-4)), moe_load_balancing_type="seq_aux_loss",
            mtp_num_layers=int(hf.get("num_nextn_predict_layers", 0)))
        return config.with_(**v32) if v32 else config
    gqa = dict(num_query_groups=int(hf.get("num_key_value_heads", hf["num_attention_heads"])),
               head_dim=hf.get("head_dim"))
    dense = is_dense_hf(hf)
    if family == "qwen3_moe":
        # transformers' Qwen3-MoE: every layer windowed when use_sliding_window (the dense Qwen3's is refused)
        gqa["sliding_window"] = int(hf["sliding_window"]) if hf.get("use_sliding_window") and not dense \
            and hf.get("sliding_window") else None
        # a dense Qwen3 keeps Qwen3-MoE's router semantics for upcycling (softmax over all experts, renormalised)
        moe = dict(num_experts=0, moe_ffn_hidden_size=0, moe_norm_topk_prob=True) if dense else dict(
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), moe_topk=int(hf["num_experts_per_tok"]),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layer_freq=_pattern(L, [i not in set(hf.get("mlp_only_layers") or ())
                                        and (i + 1) % int(hf.get("decoder_sparse_step", 1)) == 0 for i in range(L)]))
        return ModelConfig(
            **common, **gqa, **moe, qk_norm=True, ffn_hidden_size=int(hf.get("intermediate_size", 0)),
            moe_score_function="softmax", moe_pre_softmax=True,
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 1e-3)), moe_load_balancing_type="global_aux_loss")
    moe = dict(num_experts=0, ffn_hidden_size=int(hf["intermediate_size"])) if dense else dict(
        num_experts=int(hf["num_local_experts"]), moe_ffn_hidden_size=int(hf["intermediate_size"]),
        moe_topk=int(hf["num_experts_per_tok"]), moe_input_jitter_eps=float(hf.get("router_jitter_noise") or 0) or None)
    return ModelConfig(  # mixtral / mistral
        **common, **gqa, **moe, sliding_window=hf.get("sliding_window"), moe_score_function="softmax",
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)), moe_load_balancing_type="aux_loss")


def _indexer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """GLM-5's ``indexer_types`` as transformers derives it: given, else from ``index_topk_pattern`` ("F"/"S"), else
    from ``index_topk_freq`` / ``index_skip_topk_offset``."""
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _deepseek_v32(hf: dict[str, Any], num_layers: int, family: str) -> dict[str, Any]:
    """What DeepSeek-V3.2 (transformers' ``DeepseekV32Config``) and GLM-5 (``GlmMoeDsaConfig``, its subclass) change in
    the DeepSeek-V3 reading: the indexer of every layer (GLM-5's with interleaved RoPE, every layer its own:
    ``indexer_types`` all "full"), ``mlp_layer_types`` (else ``first_k_dense_replace``), MLA's RoPE always interleaved
    (the classes have no ``rope_interleave``) and no MTP (transformers skips the checkpoint's last layer)."""
    types = hf.get("layer_types")
    if types is not None and (len(types) != num_layers or set(types) != {"indexed_attention"}):
        raise ValueError(f"{family}: layer_types={types} is not supported (every layer 'indexed_attention')")
    if hf.get("q_lora_rank") is None:
        raise ValueError(f"{family}: q_lora_rank=None is not supported (the indexer reads the query latent)")
    if family == "glm_moe_dsa" and set(_indexer_types(hf, num_layers)) != {"full"}:
        raise ValueError(f"glm_moe_dsa: indexer_types={_indexer_types(hf, num_layers)} is not supported (a 'shared' "
                         "layer reuses another layer's top-k; moefold runs every layer's own indexer: all 'full')")
    out: dict[str, Any] = {
        "dsa": DSADims(index_n_heads=int(hf.get("index_n_heads", 64)),
                       index_head_dim=int(hf.get("index_head_dim", 128)), index_topk=int(hf.get("index_topk", 2048)),
                       rope_interleave=family == "glm_moe_dsa"),
        "mtp_num_layers": 0}
    mlp = hf.get("mlp_layer_types")
    if mlp is not None:
        if len(mlp) != num_layers or not set(mlp) <= {"dense", "sparse"}:
            raise ValueError(f"{family}: mlp_layer_types={mlp} must hold 'dense' or 'sparse' for each of "
                             f"{num_layers} layers")
        k = mlp.index("sparse") if "sparse" in mlp else num_layers
        if mlp == ["dense"] * k + ["sparse"] * (num_layers - k):   # what first_k_dense_replace=k makes
            out.update(first_k_dense_replace=k, moe_layer_freq=1)
        else:
            out.update(first_k_dense_replace=0, moe_layer_freq=_pattern(num_layers, [t == "sparse" for t in mlp]))
    return out


def _rope_out(c: ModelConfig) -> dict[str, Any]:
    # the families whose HF default is not 1 (GLM-4.5, Qwen3-Next) always say it
    partial = ({"partial_rotary_factor": c.partial_rotary_factor}
               if c.partial_rotary_factor != 1.0 or c.family in more.PARTIAL_ROTARY_DEFAULTS else {})
    if c.yarn is None:
        return {"rope_type": "default", "rope_theta": c.rope_theta, **partial}
    y = c.yarn
    return {"rope_type": "yarn", "rope_theta": c.rope_theta, "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
            **({} if y.truncate else {"truncate": False}),
            **({} if y.attention_factor is None else {"attention_factor": y.attention_factor}), **partial}


def _check_exportable(c: ModelConfig) -> None:
    """Raise unless the HF class of ``c.family`` computes exactly what ``c`` describes."""
    need = {  # field: value the HF implementation hard-codes
        "deepseek_v3": {"attention": "mla", "moe_score_function": "sigmoid", "moe_expert_bias": True,
                        "qk_norm": False, "sliding_window": None, "moe_shared_expert_gate": False},
        "qwen3_moe": {"attention": "gqa", "moe_score_function": "softmax", "moe_pre_softmax": True, "qk_norm": True,
                      "moe_expert_bias": False, "moe_shared_expert_ffn_size": 0, "moe_topk_scaling_factor": 1.0,
                      "moe_num_groups": None, **({} if c.num_experts else {"sliding_window": None})},
        "mixtral": {"attention": "gqa", "moe_score_function": "softmax", "qk_norm": False, "moe_expert_bias": False,
                    "moe_shared_expert_ffn_size": 0, "moe_topk_scaling_factor": 1.0, "moe_num_groups": None,
                    "attention_bias": False},
        "qwen3_next": qwen3_next.required(c),
        "qwen3_5_moe": qwen3_5_moe.required(c),
    }.get(c.family, {})
    if c.family in DSA_FAMILIES:   # DeepSeek-V3's, an indexer with relu, interleaved MLA rope, no MTP
        need = {**need, "attention": "mla", "moe_score_function": "sigmoid", "moe_expert_bias": True, "qk_norm": False,
                "sliding_window": None, "moe_shared_expert_gate": False, "mtp_num_layers": 0}
        glm = c.family == "glm_moe_dsa"   # GLM-5's indexer: interleaved RoPE
        if c.dsa is None or not c.dsa.relu or c.dsa.rope_interleave != glm or not c.mla.rope_interleave or \
                c.mla.q_lora_rank is None:
            raise ValueError(f"{c.name}: an HF {FAMILY_ARCH[c.family]} config needs dsa with relu=True and "
                             f"rope_interleave={glm}, mla.rope_interleave=True and mla.q_lora_rank (got dsa={c.dsa}, "
                             f"mla={c.mla})")
    elif c.dsa is not None:
        raise ValueError(f"{c.name}: the {c.family} HF class has no sparse attention (dsa); families {DSA_FAMILIES} "
                         "have")
    need = more.needs(c.family, need)   # + the families' features, off unless the family's HF class has them
    need.setdefault("moe_latent_size", None)   # no HF MoE class of these families projects to a latent width
    if c.family not in ("qwen3_next", "qwen3_5_moe"):   # the hybrid-stack features only these HF classes have
        need.update(layer_types=c.layer_types if set(c.layer_types or ()) <= {"full_attention"} else None,
                    attention_output_gate=False, norm_zero_centered_gamma=False)
    if c.num_experts == 0:  # the dense relative: router choices are irrelevant
        need = {k: v for k, v in need.items() if not k.startswith("moe_")}
    bad = {k: getattr(c, k) for k, v in need.items() if getattr(c, k) != v}
    # HF ranks groups by the sum of their top 2 scores
    group_score = (c.moe_group_score_topk or c.moe_topk // c.moe_group_topk) if c.moe_num_groups else 2
    if (c.family == "deepseek_v3" or c.family in DSA_FAMILIES) and group_score != 2:
        bad["moe_group_score_topk"] = c.moe_group_score_topk
    if c.attention == "mla" and c.mla.latent_norm_eps != 1e-6:   # q_a_layernorm / kv_a_layernorm: eps fixed at 1e-6
        bad["mla.latent_norm_eps"] = c.mla.latent_norm_eps
    if bad:
        fixed = {"moe_group_score_topk": 2, "mla.latent_norm_eps": 1e-6}
        raise ValueError(f"{c.name}: cannot be expressed as an HF {_architecture(c)} config: {bad} "
                         f"(HF needs {({k: need.get(k, fixed.get(k)) for k in bad})})")
    why = "; ".join(qwen3_5_moe.check_exportable(c)) if c.family == "qwen3_5_moe" else None
    why = why or more.out_bias_error(c) or (c.family == "gpt_oss" and c.moe_activation_clamp is None
                                     and "GPT-OSS's swiglu_limit cannot be None (moe_activation_clamp)")
    if why:
        raise ValueError(f"{c.name}: cannot be expressed as an HF {_architecture(c)} config: {why}")


def _architecture(c: ModelConfig) -> str:
    # HF Qwen3-Next without experts is all dense MLPs; Qwen3.5-MoE without them is refused (_check_exportable)
    if c.num_experts == 0 and c.family not in ("qwen3_next", "qwen3_5_moe"):
        if c.family not in DENSE_ARCH:
            raise ValueError(f"{c.name}: a {c.family} model without experts has no HF architecture "
                             f"(dense export exists for {', '.join(DENSE_ARCH)})")
        return DENSE_ARCH[c.family][0]
    return FAMILY_ARCH[c.family]


def _own_fields(c: ModelConfig, dtype: str) -> dict[str, Any]:
    """The HF fields moefold's config determines, in transformers' current spelling."""
    _check_exportable(c)
    arch = _architecture(c)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": FAMILY_MODEL_TYPE.get(c.family, c.family) if arch == FAMILY_ARCH[c.family]
        else DENSE_ARCH[c.family][1],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu",
        "rope_parameters": _rope_out(c), "dtype": dtype,
    }
    if c.num_experts:
        out["num_experts_per_tok"] = c.moe_topk
    if c.family in more.NEEDS:
        more.to_hf(c, out)
        return out
    moe = [c.is_moe_layer(i) for i in range(c.num_layers)]
    if c.family == "deepseek_v3" or c.family in DSA_FAMILIES:
        m = c.mla
        # HF: dense layers first, then MoE ones (DeepSeek-V3.2: any pattern, through mlp_layer_types)
        first_k = (moe.index(True) if any(moe) else c.num_layers) if c.family in DSA_FAMILIES else \
            more.first_k_dense(c, "DeepSeek-V3")
        out.update(num_key_value_heads=c.num_attention_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                   qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                   head_dim=m.qk_rope_head_dim, rope_interleave=m.rope_interleave, attention_bias=c.attention_bias,
                   intermediate_size=c.ffn_hidden_size, moe_intermediate_size=c.moe_ffn_hidden_size,
                   n_routed_experts=c.num_experts,
                   n_shared_experts=more.n_shared_experts(c),
                   routed_scaling_factor=c.moe_topk_scaling_factor, n_group=c.moe_num_groups,
                   topk_group=c.moe_group_topk, norm_topk_prob=c.moe_norm_topk_prob, first_k_dense_replace=first_k,
                   num_nextn_predict_layers=c.mtp_num_layers, aux_loss_alpha=c.moe_aux_loss_coeff)
        if c.family in DSA_FAMILIES:
            for key in ("rope_interleave", "num_nextn_predict_layers", "aux_loss_alpha"):   # no such fields
                out.pop(key)
            out.update(index_n_heads=c.dsa.index_n_heads, index_head_dim=c.dsa.index_head_dim,
                       index_topk=c.dsa.index_topk, mlp_layer_types=["sparse" if m else "dense" for m in moe])
            if c.family == "glm_moe_dsa":
                out["indexer_types"] = ["full"] * c.num_layers
    elif c.family == "qwen3_moe":
        out.update(num_key_value_heads=c.kv_heads, head_dim=c.attention_head_dim, attention_bias=c.attention_bias,
                   intermediate_size=c.ffn_hidden_size, use_sliding_window=c.sliding_window is not None,
                   **({} if c.sliding_window is None else {"sliding_window": c.sliding_window}))
        if c.num_experts:
            out.update(moe_intermediate_size=c.moe_ffn_hidden_size, num_experts=c.num_experts,
                       norm_topk_prob=c.moe_norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(c.num_layers) if not moe[i]],
                       router_aux_loss_coef=c.moe_aux_loss_coeff)
    elif c.family == "qwen3_next":
        out.update(qwen3_next.hf_fields(c))
    elif c.family == "qwen3_5_moe":
        out.update(qwen3_5_moe.hf_fields(c))
    elif c.num_experts:
        if not all(moe):
            raise ValueError("Mixtral export needs every layer to be MoE")
        out.update(num_key_value_heads=c.kv_heads, head_dim=c.head_dim, intermediate_size=c.moe_ffn_hidden_size,
                   num_local_experts=c.num_experts, sliding_window=c.sliding_window,
                   router_aux_loss_coef=c.moe_aux_loss_coeff, router_jitter_noise=c.moe_input_jitter_eps or 0.0)
    else:
        out.update(num_key_value_heads=c.kv_heads, head_dim=c.head_dim, intermediate_size=c.ffn_hidden_size,
                   sliding_window=c.sliding_window)
    return out


def _respell(own: dict[str, Any], original: dict[str, Any], c: ModelConfig) -> dict[str, Any]:
    """``own`` rewritten in the spelling ``original`` used wherever the meaning is unchanged."""
    own = dict(own)
    if "torch_dtype" in original and "dtype" not in original:
        own["torch_dtype"] = own.pop("dtype")
    same_partial = more.partial_rotary_factor(original, c.family) == c.partial_rotary_factor
    if _rope(original) == (c.rope_theta, c.yarn) and same_partial:   # same rotary embedding: keep its keys
        del own["rope_parameters"]
        own.pop("rotary_dim", None)
    elif "rope_parameters" not in original:          # older layout: rope_theta + rope_scaling
        params = own.pop("rope_parameters")
        own["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:
            own["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        own["rope_scaling"] = None if params["rope_type"] == "default" else params
    if c.family == "deepseek_v3" and "aux_loss_alpha" not in original and \
            from_hf_config(original).moe_aux_loss_coeff == c.moe_aux_loss_coeff:
        own.pop("aux_loss_alpha")   # transformers' DeepseekV3Config has no such field: write it only when it changed
    if c.family in ("deepseek_v3", "glm4_moe") and c.mtp_num_layers == 0 and original.get("num_nextn_predict_layers"):
        # announced but absent (what save_pretrained writes): the export holds no MTP tensors either, and a
        # reader drops the announcement again (importer.load_config)
        own.pop("num_nextn_predict_layers")
    if c.family == "qwen3_moe" and c.num_experts and not is_dense_hf(original):
        keys = [k for k in ("num_experts", "num_local_experts") if k in original] or ["num_experts"]
        count = own.pop("num_experts")
        own.update(dict.fromkeys(keys, count))
        if from_hf_config(original).moe_layer_freq == c.moe_layer_freq:
            # the same MoE layers, e.g. decoder_sparse_step=2 rather than an explicit mlp_only_layers list
            for k in ("decoder_sparse_step", "mlp_only_layers"):
                own.pop(k)
    if c.family == "qwen3_next":
        own = qwen3_next.respell(own, original, c)
    if c.family == "qwen3_5_moe":
        own = qwen3_5_moe.respell(own, original, c)
    same_arch = own["architectures"] == original.get("architectures")
    if MODEL_TYPES.get(original.get("model_type")) == c.family and same_arch:
        own["model_type"] = original["model_type"]   # Kimi-K2's kimi_k2: read as DeepSeek-V3, written as it was
    return _unadded(own, original)


def _unadded(own: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """``own`` less the fields ``original`` leaves out whose absence reads the same (DeepSeek's head_dim and
    rope_interleave, GPT-OSS's swiglu_alpha: the defaults moefold and transformers read); the dtype of the written
    tensors stays."""
    merged = {**original, **own}
    config = from_hf_config(merged)
    for key in [k for k in own if k not in original and k not in ("dtype", "torch_dtype")]:
        without = {k: v for k, v in merged.items() if k != key}
        try:
            same = from_hf_config(without) == config
        except (KeyError, ValueError, TypeError):   # a field the reader needs
            same = False
        if same:
            del own[key]
            merged = without
    return own


def to_hf_config(c: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` dict for ``c`` (fails for features the HF class cannot express).

    Starts from the config ``c`` was imported from (``c.extra["hf_config"]``), when there is one, so
    fields moefold does not model survive; the fields it does model are overwritten with ``c``'s values.
    """
    if c.family == "nemotron_h":
        return nemotron_h.to_hf_config(c, dtype)
    original = c.extra.get("hf_config") if c.extra else None
    if c.family == "deepseek_v4":   # every field it models is written; the rest of the imported config kept
        return {**(original or {}), **deepseek_v4.hf_config(c), "dtype": dtype}
    own = _own_fields(c, dtype)
    if not original:
        return own
    return {**original, **_respell(own, original, c)}
