"""Names and layouts: moefold state-dict entries <-> Megatron-Core GPTModel ``torch_dist`` checkpoint tensors.

Megatron's distributed checkpoints hold every tensor in its global (unsharded) shape under its
``sharded_state_dict`` key, whatever tp/pp/ep/etp saved it, so one mapping serves every layout:

==========================================  ===================================================================
moefold                                     Megatron-Core (``decoder.layers.i.`` / MTP ``mtp.layers.k.``)
==========================================  ===================================================================
embed_tokens.weight / norm.weight           embedding.word_embeddings.weight / decoder.final_layernorm.weight
output_head.proj.weight                     output_layer.weight (absent when tied)
layers.i.input_layernorm.weight             self_attention.linear_qkv.layer_norm_weight (TE and local spec; or
                                            input_layernorm.weight)
layers.i.self_attn.{q,k,v}_proj.weight      self_attention.linear_qkv.weight [G * (q/G + 2) * d, H]: per query
                                            group g its q heads, then its k, then its v rows
layers.i.self_attn.o_proj.weight / .bias    self_attention.linear_proj.weight / .bias
layers.i.self_attn.sinks [h]                self_attention.core_attention.softmax_offset (--softmax-type learnable)
layers.i.self_attn.{q,k}_norm.weight        self_attention.{q,k}_layernorm.weight
layers.i.post_attention_layernorm.weight    mlp.linear_fc1.layer_norm_weight (dense layers; local spec: all) or
                                            pre_mlp_layernorm.weight (TE spec MoE layers)
layers.i.mlp.{gate,up}_proj / down_proj     mlp.linear_fc1.weight [2F, H] (gate rows, then up) / linear_fc2
layers.i.mlp.router.weight / bias           mlp.router.weight / mlp.router.bias (--add-bias-linear)
layers.i.mlp.router.expert_bias             mlp.router.expert_bias
layers.i.mlp.experts.w13 [E, 2, F, H]       mlp.experts.experts.linear_fc1.weight [E, 2F, H] (SequentialMLP,
                                            TEGroupedMLP and GroupedMLP save the same key and layout)
layers.i.mlp.experts.w2 [E, H, F]           mlp.experts.experts.linear_fc2.weight [E, H, F]
layers.i.mlp.experts.w13_bias [E, 2, F]     mlp.experts.experts.linear_fc1.bias [E, 2F] (--add-bias-linear)
layers.i.mlp.experts.w2_bias [E, H]         mlp.experts.experts.linear_fc2.bias [E, H]
layers.i.mlp.shared_experts.*               mlp.shared_experts.linear_fc1 [2F, H] / linear_fc2 / gate_weight
mtp.k.{enorm,hnorm,eh_proj,final_layernorm} mtp.layers.k.{enorm,hnorm,eh_proj,final_layernorm}.weight
mtp.k.block.<X>                             mtp.layers.k.transformer_layer.<X as for a decoder layer>
==========================================  ===================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moefold.models.config import ModelConfig
from moefold.models.layer_factory import is_moe_block


@dataclass(frozen=True)
class Source:
    """Where a moefold tensor lives in a Megatron checkpoint.

    kind: "plain" (same layout), "qkv" (rows of the fused projection: part q/k/v), "half" (rows
    ``part * F ...`` of a fused [2F, H] gate/up projection), "experts13" (w13 [E, 2, F, H] from [E, 2F, H], its
    bias [E, 2, F] from [E, 2F]).
    keys: candidate Megatron keys, the first written on export.
    """

    kind: str
    keys: tuple[str, ...]
    part: int = 0


def _layer(name: str, config: ModelConfig) -> tuple[str, str, int] | None:
    """(Megatron prefix, rest, layer index) for layer and MTP-block names."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return f"decoder.layers.{m.group(1)}.", m.group(2), int(m.group(1))
    m = re.fullmatch(r"mtp\.(\d+)\.block\.(.+)", name)
    if m:
        return f"mtp.layers.{m.group(1)}.transformer_layer.", m.group(2), config.num_layers + int(m.group(1))
    return None


_ATTENTION = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def source(name: str, config: ModelConfig) -> Source:
    """The Megatron source of moefold entry ``name`` (ValueError for an entry with none)."""
    plain = {"embed_tokens.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
             "output_head.proj.weight": "output_layer.weight"}
    if name in plain:
        return Source("plain", (plain[name],))
    m = re.fullmatch(r"mtp\.(\d+)\.(enorm|hnorm|eh_proj|final_layernorm)\.weight", name)
    if m:
        return Source("plain", (f"mtp.layers.{m.group(1)}.{m.group(2)}.weight",))
    split = _layer(name, config)
    if split is None:
        raise ValueError(f"no Megatron name for moefold tensor {name!r}")
    p, rest, index = split
    moe = is_moe_block(config, index)
    if rest == "input_layernorm.weight":
        return Source("plain", (f"{p}self_attention.linear_qkv.layer_norm_weight", f"{p}input_layernorm.weight"))
    m = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)
    if m:
        return Source("qkv", (f"{p}self_attention.linear_qkv.{m.group(2)}",), _ATTENTION[f"{m.group(1)}_proj"])
    att = {"self_attn.o_proj.weight": "self_attention.linear_proj.weight",
           "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
           "self_attn.sinks": "self_attention.core_attention.softmax_offset",
           "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
           "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
    if rest in att:
        return Source("plain", (p + att[rest],))
    if rest == "post_attention_layernorm.weight":
        keys = (f"{p}mlp.linear_fc1.layer_norm_weight", f"{p}pre_mlp_layernorm.weight")
        return Source("plain", keys if not moe else keys[::-1])
    m = re.fullmatch(r"mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight", rest)
    if m:
        block = f"{p}mlp.{m.group(1) or ''}"
        if m.group(2) == "down":
            return Source("plain", (f"{block}linear_fc2.weight",))
        return Source("half", (f"{block}linear_fc1.weight",), 0 if m.group(2) == "gate" else 1)
    tail = {"mlp.router.weight": "mlp.router.weight", "mlp.router.expert_bias": "mlp.router.expert_bias",
            "mlp.router.bias": "mlp.router.bias", "mlp.experts.w2_bias": "mlp.experts.experts.linear_fc2.bias",
            "mlp.shared_experts.gate": "mlp.shared_experts.gate_weight",
            "mlp.experts.w2": "mlp.experts.experts.linear_fc2.weight"}
    if rest in tail:
        return Source("plain", (p + tail[rest],))
    if rest in ("mlp.experts.w13", "mlp.experts.w13_bias"):
        which = "weight" if rest.endswith("w13") else "bias"
        return Source("experts13", (f"{p}mlp.experts.experts.linear_fc1.{which}",))
    raise ValueError(f"no Megatron name for moefold tensor {name!r}")


def qkv_rows(part: int, config: ModelConfig) -> list[int]:
    """Rows of Megatron's fused ``linear_qkv`` [G * (q/G + 2) * d] holding moefold's q (0), k (1) or v (2)
    projection, in moefold's (HF's) head order."""
    G, heads, d = config.kv_heads, config.num_attention_heads, config.attention_head_dim
    per = heads // G
    rows: list[int] = []
    for g in range(G):
        base = g * (per + 2) * d
        if part == 0:
            rows += range(base, base + per * d)
        else:
            start = base + (per + part - 1) * d
            rows += range(start, start + d)
    return rows


def is_transient(key: str) -> bool:
    """Megatron checkpoint entries that are not weights of the model: byte objects (``_extra_state``: Transformer
    Engine FP8 metadata; the fake ones of SequentialMLP), and everything outside the model (optimizer, RNG)."""
    return "_extra_state" in key or key.startswith(("optimizer.", "rng_state", "rerun_state"))
