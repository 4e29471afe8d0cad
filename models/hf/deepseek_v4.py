"""DeepSeek-V4 (HF ``deepseek_v4``, ``DeepseekV4ForCausalLM``, transformers 5.25) <-> moefold.

``config_from_hf`` reads every field of a ``DeepseekV4Config`` (``READ`` / ``FIXED`` / ``INERT``: each either becomes a
``ModelConfig`` / ``V4Dims`` value, is checked to hold the one value the HF class computes with, or is named inert
and why) without importing transformers (not a runtime dependency): ``read_fields`` transcribes the class's
defaults and its folding of DeepSeek's legacy field names;
``hf_config`` writes one back. ``hf_name`` maps moefold's parameter names to HF's (the same tree but for the
``model.`` prefix, the router's name ``gate``, the correction bias, the fused expert tensors and the head), and
``to_hf_tensor`` / ``from_hf_tensor`` convert the experts' ``[E, 2F, H]`` <-> moefold's ``[E, 2, F, H]``.

``num_nextn_predict_layers`` is read and dropped: the HF class builds no MTP layer (its ``mtp.*`` tensors are not
loaded by transformers either), so a V4 model here has ``mtp_num_layers=0``.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace
from typing import Any

from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.hf.config_fields import INERT as COMMON_INERT
from moefold.models.model_sections import YarnScaling
from moefold.models.v4_dims import V4Dims

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_TYPE = "deepseek_v4"

# every DeepseekV4Config field: read into the config / checked to hold the HF class's only value / inert (why)
READ = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "scoring_func", "routed_scaling_factor",
        "max_position_embeddings", "rope_theta", "layer_types",
        "compress_rates", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types",
        "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
        "index_topk", "rms_norm_eps", "rope_parameters", "partial_rotary_factor", "qk_rope_head_dim",
        "num_nextn_predict_layers")
FIXED = {"num_key_value_heads": 1, "router_jitter_noise": 0.0, "hidden_act": "silu", "tie_word_embeddings": False,
         "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
         # the HF class always renormalises the k weights and builds one shared expert of moe_intermediate_size
         "norm_topk_prob": True, "n_shared_experts": 1}
# DeepSeek's spellings (the published config.json's) that transformers folds into the fields above
LEGACY = ("compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "rope_scaling")
SCORE_FUNCTIONS = ("sqrtsoftplus", "sigmoid")   # HF applies ACT2FN[scoring_func] elementwise
INERT = {**COMMON_INERT, "output_router_logits": "inference output switch",
         "initializer_range": "init of new weights only",
         "use_cache": "inference cache", "pad_token_id": "tokenizer id", "bos_token_id": "tokenizer id",
         "eos_token_id": "tokenizer id", "transformers_version": "writer's version", "model_type": "this module's",
         "architectures": "this module's", "_name_or_path": "where it was read from",
         "torch_dtype": "the weights' storage dtype",
         "dtype": "the weights' storage dtype", "quantization_config": "the weights' storage format (read by "
         "models.hf.fp8_blocks.quant_format)", "expert_dtype": "the routed experts' storage format (read by "
         "models.hf.fp8_blocks.quant_format, as transformers folds it into quantization_config)",
         "router_aux_loss_coef": "HF's loss only with output_router_logits; moefold's balancing is its own flags"}
_KIND_RATE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _yarn(rope: dict[str, Any]) -> YarnScaling | None:
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    if rope.get("rope_type", rope.get("type")) != "yarn":
        raise ValueError(f"deepseek_v4: rope_parameters.compress rope_type={rope.get('rope_type')!r}; moefold reads "
                         "default or yarn")
    return YarnScaling(factor=float(rope["factor"]), original_max_position_embeddings=int(
        rope.get("original_max_position_embeddings", 4096)), beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)), mscale=float(rope.get("mscale", 1.0) or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0) or 0.0), truncate=bool(rope.get("truncate", True)),
        attention_factor=float(rope.get("attention_factor", 1.0)))


# DeepseekV4Config's defaults (transformers 5.25, models/deepseek_v4/configuration_deepseek_v4.py: its dataclass
# fields) of the fields read or fixed here; layer_types, mlp_layer_types, compress_rates, partial_rotary_factor and
# rope_parameters are derived in ``read_fields`` as its ``__post_init__`` derives them
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "router_jitter_noise": 0.0, "hidden_act": "silu",
    "rms_norm_eps": 1.0e-6, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "attention_dropout": 0.0}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_DEFAULT_HASH_LAYERS = 3
_DEFAULT_ROTARY = 64 / 512   # DeepSeek-V4's qk_rope_head_dim / head_dim
_MLP_KINDS = ("hash_moe", "moe")


def _rope_parameters(hf: dict[str, Any], f: SimpleNamespace) -> dict[str, dict[str, Any]]:
    """``{"main", "compress"}`` RoPE parameters as transformers 5.25 builds them: ``PreTrainedConfig``'s
    ``convert_rope_params_to_dict`` + ``standardize_rope_params`` (modeling_rope_utils.py: a legacy ``rope_scaling``
    replaces ``rope_parameters``; ``rope_theta`` / a given ``partial_rotary_factor`` / YaRN's
    ``original_max_position_embeddings`` filled in where absent), then ``DeepseekV4Config.__post_init__`` (a flat
    dict is YaRN for the compressed layers only, with ``attention_factor`` 1.0; the sliding layers' RoPE is plain).
    ``f.partial_rotary_factor`` is the final one; ``given_rotary`` the field as given (``None`` when absent)."""
    rp = copy.deepcopy(hf.get("rope_scaling") or hf.get("rope_parameters")) or {}
    nested = [key for key in rp if key in ("main", "compress")]
    for params in [rp[key] for key in nested] or [rp]:
        if params is None:
            continue
        params.setdefault("rope_theta", f.rope_theta)
        if f.given_rotary is not None:
            params.setdefault("partial_rotary_factor", f.given_rotary)
        params.setdefault("rope_type", params.get("type", "default"))
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings", f.max_position_embeddings)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return {"main": rp["main"], "compress": rp["compress"]}
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": f.rope_theta, "partial_rotary_factor": f.partial_rotary_factor}
    compress = {**yarn, "rope_theta": f.compress_rope_theta, "partial_rotary_factor": f.partial_rotary_factor}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def read_fields(hf: dict[str, Any], name: str = "deepseek_v4") -> SimpleNamespace:
    """The fields of ``DeepseekV4Config(**hf)`` that moefold reads (same names, same values), without transformers:
    the defaults of ``DEFAULTS`` where a key is absent, DeepSeek's legacy spellings (``compress_ratios``,
    ``compress_rate_csa`` / ``_hca``, ``num_hash_layers``, ``qk_rope_head_dim``, a top-level ``rope_scaling``)
    folded in as ``DeepseekV4Config.__post_init__`` (transformers 5.25) folds them. ``hf`` is not modified."""
    f = SimpleNamespace(**{key: hf.get(key, default) for key, default in DEFAULTS.items()})
    n = f.num_hidden_layers
    rates = hf.get("compress_rates")
    f.compress_rates = dict(_DEFAULT_RATES if rates is None else rates)
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):
        if hf.get(legacy) is not None:
            f.compress_rates[kind] = hf[legacy]
    for kind in _DEFAULT_RATES:
        if kind not in f.compress_rates:
            raise ValueError(f"{name}: compress_rates={f.compress_rates} has no rate for {kind!r}")
    kinds = hf.get("layer_types")
    if kinds is None and hf.get("compress_ratios") is not None:
        bad = [r for r in hf["compress_ratios"] if r not in _KIND_RATE]
        if bad:
            raise ValueError(f"{name}: compress_ratios entries {bad}; each is one of {sorted(_KIND_RATE)}")
        kinds = [_KIND_RATE[r] for r in hf["compress_ratios"]]
    if kinds is None:   # DeepSeek-V4-Pro's: two HCA layers, then HCA / CSA alternating
        kinds = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    f.layer_types = list(kinds[:n])
    mlp = hf.get("mlp_layer_types")
    if mlp is None:
        n_hash = hf.get("num_hash_layers")
        n_hash = _DEFAULT_HASH_LAYERS if n_hash is None else n_hash
        mlp = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    f.mlp_layer_types = list(mlp[:n])
    for key, types, allowed in (("layer_types", f.layer_types, tuple(_KIND_RATE.values())),
                                ("mlp_layer_types", f.mlp_layer_types, _MLP_KINDS)):
        if len(types) != n:
            raise ValueError(f"{name}: num_hidden_layers={n} but {key} has {len(types)} entries")
        bad = [t for t in types if t not in allowed]
        if bad:
            raise ValueError(f"{name}: {key} entries {bad}; each is one of {allowed}")
    f.given_rotary = hf.get("partial_rotary_factor")
    f.partial_rotary_factor = f.given_rotary
    if f.partial_rotary_factor is None:
        legacy = hf.get("qk_rope_head_dim")
        f.partial_rotary_factor = legacy / f.head_dim if legacy is not None else _DEFAULT_ROTARY
    f.rope_parameters = _rope_parameters(hf, f)
    for label, params in f.rope_parameters.items():   # DeepseekV4Config.validate_rope names the type of each
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        if params["rope_type"] == "yarn" and "factor" not in params:
            raise ValueError(f"{name}: rope_parameters.{label}={params} is YaRN without a factor")
    del f.given_rotary
    return f


def config_from_hf(hf: dict[str, Any], name: str = "deepseek_v4") -> ModelConfig:
    """``ModelConfig`` of a DeepSeek-V4 ``config.json`` (``hf``: its mapping; ``read_fields`` gives HF's defaults
    where a key is absent and folds the legacy ``compress_ratios`` / ``num_hash_layers`` spellings in as
    transformers does; transformers is not imported)."""
    unknown = sorted(set(hf) - set(READ) - set(FIXED) - set(INERT) - set(LEGACY) - {"topk_method"})
    if unknown:
        raise ValueError(f"{name}: DeepSeek-V4 config fields {unknown} are not read by moefold (known: "
                         f"{sorted(READ + tuple(FIXED) + tuple(INERT) + LEGACY + ('topk_method',))})")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":   # DeepSeek's name for the bias-corrected top-k HF computes
        raise ValueError(f"{name}: topk_method={hf['topk_method']!r}; DeepseekV4ForCausalLM selects with the "
                         "correction bias (noaux_tc)")
    return model_config(read_fields(hf, name), name)


def model_config(cfg: Any, name: str) -> ModelConfig:
    """``ModelConfig`` of ``cfg``: ``read_fields``' namespace (or, in the tests, a ``DeepseekV4Config``)."""
    for key, want in FIXED.items():
        if getattr(cfg, key) != want:
            raise ValueError(f"{name}: {key}={getattr(cfg, key)!r}; DeepseekV4ForCausalLM computes with {want!r}")
    if cfg.scoring_func not in SCORE_FUNCTIONS:
        raise ValueError(f"{name}: scoring_func={cfg.scoring_func!r}; DeepseekV4ForCausalLM scores elementwise with "
                         f"one of {SCORE_FUNCTIONS}")
    mlp = list(cfg.mlp_layer_types)
    n_hash = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * n_hash + ["moe"] * (len(mlp) - n_hash):
        raise ValueError(f"{name}: mlp_layer_types={mlp}: moefold reads the hash_moe layers first, then moe")
    rope = cfg.rope_parameters
    if rope["main"].get("rope_type", "default") != "default":
        raise ValueError(f"{name}: rope_parameters.main={rope['main']}: the sliding layers' RoPE is plain in HF V4")
    L, D = cfg.num_hidden_layers, cfg.head_dim
    v4 = V4Dims(attention_kinds=tuple(cfg.layer_types), num_hash_layers=n_hash,
                csa_rate=int(cfg.compress_rates["compressed_sparse_attention"]),
                hca_rate=int(cfg.compress_rates["heavily_compressed_attention"]), q_lora_rank=cfg.q_lora_rank,
                o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, rope_head_dim=int(D * cfg.partial_rotary_factor),
                sliding_window=cfg.sliding_window, compress_rope_theta=float(rope["compress"]["rope_theta"]),
                compress_yarn=_yarn(rope["compress"]), index_n_heads=cfg.index_n_heads,
                index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, hc_mult=cfg.hc_mult,
                hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=float(cfg.hc_eps))
    return ModelConfig(
        name=name, family="deepseek_v4", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=L,
        norm_eps=float(cfg.rms_norm_eps), max_position_embeddings=cfg.max_position_embeddings,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=1, head_dim=D,
        rope_theta=float(rope["main"]["rope_theta"]), num_experts=cfg.n_routed_experts,
        moe_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_ffn_size=cfg.moe_intermediate_size, moe_score_function=cfg.scoring_func,
        moe_norm_topk_prob=True,
        moe_topk_scaling_factor=float(cfg.routed_scaling_factor), moe_expert_bias=n_hash < L,
        moe_activation_clamp=float(cfg.swiglu_limit), moe_aux_loss_coeff=0.0, v4=v4)


def hf_config(c: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``c`` (``config_from_hf`` reads it back to ``c``)."""
    v4 = c.v4
    compress = {"rope_type": "default", "rope_theta": v4.compress_rope_theta,
                "partial_rotary_factor": v4.rope_head_dim / c.head_dim}
    if v4.compress_yarn is not None:
        y = v4.compress_yarn
        compress.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=(
            y.original_max_position_embeddings), beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
            mscale_all_dim=y.mscale_all_dim, truncate=y.truncate, attention_factor=y.attention_factor)
    if c.moe_shared_expert_ffn_size != c.moe_ffn_hidden_size or not c.moe_norm_topk_prob:
        raise ValueError(f"{c.name}: HF DeepSeek-V4 has one shared expert of moe_ffn_hidden_size="
                         f"{c.moe_ffn_hidden_size} (got {c.moe_shared_expert_ffn_size}) and renormalised top-k weights"
                         f" (moe_norm_topk_prob={c.moe_norm_topk_prob})")
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "moe_intermediate_size": c.moe_ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads, "num_key_value_heads": 1,
        "head_dim": c.head_dim, "q_lora_rank": v4.q_lora_rank, "num_experts_per_tok": c.moe_topk,
        "n_routed_experts": c.num_experts, "scoring_func": c.moe_score_function,
        "routed_scaling_factor": c.moe_topk_scaling_factor,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "layer_types": list(v4.attention_kinds),
        "compress_rates": {"compressed_sparse_attention": v4.csa_rate, "heavily_compressed_attention": v4.hca_rate},
        "compress_rope_theta": v4.compress_rope_theta, "hc_mult": v4.hc_mult,
        "hc_sinkhorn_iters": v4.hc_sinkhorn_iters, "hc_eps": v4.hc_eps,
        "mlp_layer_types": ["hash_moe" if v4.is_hash_layer(i) else "moe" for i in range(c.num_layers)],
        "swiglu_limit": c.moe_activation_clamp, "sliding_window": v4.sliding_window, "o_groups": v4.o_groups,
        "o_lora_rank": v4.o_lora_rank, "index_n_heads": v4.index_n_heads, "index_head_dim": v4.index_head_dim,
        "index_topk": v4.index_topk, "rms_norm_eps": c.norm_eps, "num_nextn_predict_layers": 0,
        "partial_rotary_factor": v4.rope_head_dim / c.head_dim,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": c.rope_theta,
                                     "partial_rotary_factor": v4.rope_head_dim / c.head_dim}, "compress": compress},
        **FIXED}


# moefold's names -> the checkpoint's (DeepSeek's, which transformers' conversion_mapping renames on load and
# save_pretrained writes back): applied in order to the name's part after ``layers.i.``
_DISK = ((r"^self_attn\.compressor\.indexer\.scorer\.", "attn.indexer."),
         (r"^self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
         (r"^self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
         (r"^self_attn\.", "attn."), (r"^input_layernorm\.", "attn_norm."),
         (r"^post_attention_layernorm\.", "ffn_norm."),
         (r"^attn_hc\.", "hc_attn_"), (r"^ffn_hc\.", "hc_ffn_"), (r"^mlp\.router\.expert_bias$", "ffn.gate.bias"),
         (r"^mlp\.router\.", "ffn.gate."), (r"^mlp\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
         (r"^mlp\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
         (r"^mlp\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
         (r"\.sinks$", ".attn_sink"), (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."),
         (r"\.q_a_norm\.", ".q_norm."), (r"\.kv_proj\.", ".wkv."), (r"\.kv_norm\.", ".norm."),
         (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
         (r"\.position_bias$", ".ape"))
_DISK_TOP = {"embed_tokens.weight": "embed.weight", "output_head.proj.weight": "head.weight",
             "norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
             "hc_head.hc_scale": "hc_head_scale"}


def disk_names(name: str) -> list[str]:
    """Candidate checkpoint names of moefold's (non-expert) ``name``: DeepSeek's (written on export), the
    ``model.``-prefixed spelling transformers' ``save_pretrained`` writes, and (for the tensors outside the layers,
    whose anchored renames ``save_pretrained`` does not undo) the HF module's name."""
    if name in _DISK_TOP:
        out = _DISK_TOP[name]
        return [out, "model." + out, hf_name(name)]
    else:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"no DeepSeek-V4 checkpoint name for moefold tensor {name!r}")
        rest = m.group(2)
        for pattern, repl in _DISK:
            rest = re.sub(pattern, repl, rest)
        out = f"layers.{m.group(1)}.{rest}"
    return [out, "model." + out]


def expert_prefixes(layer: int) -> tuple[str, str]:
    """The checkpoint's per-expert prefixes of layer ``layer`` (``.E.w1/w3/w2.weight`` follow)."""
    return f"layers.{layer}.ffn.experts", f"model.layers.{layer}.ffn.experts"


def is_ignorable(hf_name: str) -> bool:
    """DeepSeek's MTP layer (``mtp.0.*``, published beside the model): transformers' V4 class builds none and loads
    none of it, and neither does moefold (``mtp_num_layers=0``)."""
    return hf_name.startswith(("mtp.", "model.mtp."))


def hf_name(name: str) -> str:
    """moefold's parameter name -> the HF module tree's (``DeepseekV4ForCausalLM.state_dict()``)."""
    if name == "output_head.proj.weight":
        return "lm_head.weight"
    for ours, theirs in ((".mlp.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
                         (".mlp.router.", ".mlp.gate."), (".mlp.experts.w13", ".mlp.experts.gate_up_proj"),
                         (".mlp.experts.w2", ".mlp.experts.down_proj")):
        name = name.replace(ours, theirs)
    return "model." + name


def to_hf_tensor(name: str, t: Tensor) -> Tensor:
    """moefold's tensor ``name`` in HF's layout (``w13 [E, 2, F, H]`` -> ``gate_up_proj [E, 2F, H]``)."""
    return t.flatten(1, 2) if name.endswith(".mlp.experts.w13") else t


def from_hf_tensor(name: str, t: Tensor, like: Tensor) -> Tensor:
    """HF's tensor for moefold's ``name``, shaped as moefold's ``like``."""
    return t.view(like.shape) if name.endswith(".mlp.experts.w13") else t


__all__ = ["ARCHITECTURE", "DEFAULTS", "MODEL_TYPE", "config_from_hf", "disk_names", "expert_prefixes",
           "from_hf_tensor", "hf_config", "hf_name", "is_ignorable", "model_config", "read_fields", "to_hf_tensor"]
