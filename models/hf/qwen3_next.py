"""Qwen3-Next (HF ``qwen3_next``) <-> moefold: its config fields, tensor names and the convolution's layout.

What differs from the other families, all of it read from transformers 5.24's ``modeling_qwen3_next``:

- ``layer_types`` (or the older ``full_attention_interval``, default 4): ``linear_attention`` layers are
  Gated DeltaNet (``dense.gated_deltanet``), ``full_attention`` layers gated GQA with partial RoPE
  (``partial_rotary_factor``, default 0.25, in ``rope_parameters`` or top level) and zero-centred q/k norms;
  every RMSNorm of the model stores ``gamma - 1`` (``Qwen3NextRMSNorm``) except the gated one inside DeltaNet.
- the MoE block is Qwen3-MoE's router (softmax over all experts, optional renormalisation) plus one shared
  expert behind a sigmoid gate (``shared_expert``, ``shared_expert_gate``).
- names: moefold keeps every token mixer in the block's ``self_attn`` slot; HF calls DeltaNet's
  ``linear_attn``. ``mlp.shared_experts.*`` is HF's ``mlp.shared_expert.*``, the gate ``[1, H]`` is
  ``mlp.shared_expert_gate.weight``.
- ``linear_attn.conv1d.weight``: HF ``[2 hk dk + hv dv, 1, K]`` with channels (all q, all k, all v); moefold
  ``[hk, 2dk + r dv, K]`` per key head (see ``dense.gated_deltanet``). ``ConvLayout`` converts both ways.
- HF checkpoints of Qwen3-Next carry ``mtp.*`` tensors that transformers does not model (it ignores them on
  load); moefold ignores them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.models.config import LinearAttentionDims, ModelConfig
from moefold.models.hf.config_families import partial_rotary_factor

ARCHITECTURE = "Qwen3NextForCausalLM"
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = int(hf.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(int(hf["num_hidden_layers"])))


def moe_layers(hf: dict[str, Any]) -> list[bool]:
    """HF ``Qwen3NextDecoderLayer``: sparse unless in ``mlp_only_layers``, every ``decoder_sparse_step``-th."""
    mlp_only, step = set(hf.get("mlp_only_layers") or ()), int(hf.get("decoder_sparse_step", 1))
    experts = int(hf.get("num_experts", 0))
    return [i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(int(hf["num_hidden_layers"]))]


def linear_attention_dims(hf: dict[str, Any]) -> LinearAttentionDims:
    d = LinearAttentionDims()   # HF Qwen3NextConfig's defaults are the 80B model's, as are moefold's
    return LinearAttentionDims(
        num_key_heads=int(hf.get("linear_num_key_heads", d.num_key_heads)),
        num_value_heads=int(hf.get("linear_num_value_heads", d.num_value_heads)),
        key_head_dim=int(hf.get("linear_key_head_dim", d.key_head_dim)),
        value_head_dim=int(hf.get("linear_value_head_dim", d.value_head_dim)),
        conv_kernel_size=int(hf.get("linear_conv_kernel_dim", d.conv_kernel_size)))


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` of a ``qwen3_next`` config.json (``common``: the fields every family reads alike)."""
    moe = moe_layers(hf)
    experts = int(hf.get("num_experts", 0)) if any(moe) else 0
    shared = int(hf.get("shared_expert_intermediate_size", 0)) if experts else 0
    router = dict(moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), moe_topk=int(hf["num_experts_per_tok"]),
                  moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)), moe_shared_expert_ffn_size=shared,
                  moe_shared_expert_gate=shared > 0,
                  moe_layer_freq=1 if all(moe) else tuple(int(m) for m in moe)) if experts else {}
    return ModelConfig(
        **common, num_query_groups=int(hf.get("num_key_value_heads", hf["num_attention_heads"])),
        head_dim=int(hf.get("head_dim", 256)), qk_norm=True, ffn_hidden_size=int(hf.get("intermediate_size", 0)),
        num_experts=experts, **router, moe_score_function="softmax", moe_pre_softmax=True,
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 1e-3)), moe_load_balancing_type="global_aux_loss",
        layer_types=layer_types(hf),
        linear_attention=linear_attention_dims(hf),
        attention_output_gate=True, partial_rotary_factor=partial_rotary_factor(hf, "qwen3_next"),
        norm_zero_centered_gamma=True)


def required(c: ModelConfig) -> dict[str, Any]:
    """Field values HF's Qwen3-Next hard-codes."""
    return {"attention": "gqa", "qk_norm": True, "attention_output_gate": True, "norm_zero_centered_gamma": True,
            "sliding_window": None, "moe_score_function": "softmax", "moe_pre_softmax": True,
            "moe_expert_bias": False, "moe_topk_scaling_factor": 1.0, "moe_num_groups": None,
            "moe_shared_expert_gate": c.moe_shared_expert_ffn_size > 0}


def hf_fields(c: ModelConfig) -> dict[str, Any]:
    """The qwen3_next-specific HF fields of ``c``."""
    la = c.linear_attention or LinearAttentionDims()
    out: dict[str, Any] = {
        "num_key_value_heads": c.kv_heads, "head_dim": c.attention_head_dim, "attention_bias": c.attention_bias,
        "intermediate_size": c.ffn_hidden_size, "layer_types": [c.layer_type(i) for i in range(c.num_layers)],
        "linear_num_key_heads": la.num_key_heads, "linear_num_value_heads": la.num_value_heads,
        "linear_key_head_dim": la.key_head_dim, "linear_value_head_dim": la.value_head_dim,
        "linear_conv_kernel_dim": la.conv_kernel_size}
    moe = [c.is_moe_layer(i) for i in range(c.num_layers)]
    out.update(num_experts=c.num_experts, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(c.num_layers) if not moe[i]])
    if c.num_experts:
        out.update(moe_intermediate_size=c.moe_ffn_hidden_size, norm_topk_prob=c.moe_norm_topk_prob,
                   shared_expert_intermediate_size=c.moe_shared_expert_ffn_size,
                   router_aux_loss_coef=c.moe_aux_loss_coeff)
    return out


def respell(own: dict[str, Any], original: dict[str, Any], c: ModelConfig) -> dict[str, Any]:
    """Keep the original's spelling of the layer pattern where it means the same."""
    if "layer_types" not in original and layer_types(original) == c.layer_types:
        own.pop("layer_types")                       # full_attention_interval says it
    if moe_layers(original) == [c.is_moe_layer(i) for i in range(c.num_layers)]:
        for k in ("decoder_sparse_step", "mlp_only_layers"):
            own.pop(k)
    return own


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def hf_layer_name(prefix: str, rest: str, config: ModelConfig) -> str:
    """HF name of block entry ``rest`` (moefold's name inside ``model.layers.j.``)."""
    j = int(_LAYER.fullmatch(prefix).group(1))
    if rest.startswith("self_attn.") and config.layer_type(j) == "linear_attention":
        return f"{prefix}linear_attn.{rest[len('self_attn.'):]}"
    if rest == "mlp.shared_experts.gate":
        return f"{prefix}mlp.shared_expert_gate.weight"
    if rest.startswith("mlp.shared_experts."):
        return f"{prefix}mlp.shared_expert.{rest[len('mlp.shared_experts.'):]}"
    return prefix + rest


def is_ignorable(hf_name: str) -> bool:
    return hf_name.startswith("mtp.")


@dataclass(frozen=True)
class ConvLayout:
    """moefold ``[hk, 2dk + r dv, K]`` (per key head) <-> HF ``[2 hk dk + hv dv, 1, K]`` (all q, all k, all v)."""

    key_head_dim: int

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        hk, channels, K = shape
        return (hk * channels, 1, K)

    def to_hf(self, full: Tensor) -> Tensor:
        dk = self.key_head_dim
        K = full.shape[-1]
        q, k, v = full[:, :dk], full[:, dk:2 * dk], full[:, 2 * dk:]
        return torch.cat([t.reshape(-1, K) for t in (q, k, v)]).unsqueeze(1).contiguous()

    def from_hf(self, hf: Tensor, shape: tuple[int, ...]) -> Tensor:
        hk, _, K = shape
        dk = self.key_head_dim
        w = hf.reshape(-1, K)
        q, k, v = w[:hk * dk], w[hk * dk:2 * hk * dk], w[2 * hk * dk:]
        return torch.cat([q.view(hk, dk, K), k.view(hk, dk, K), v.view(hk, -1, K)], dim=1).contiguous()


def conv_layout(rest: str, config: ModelConfig) -> ConvLayout | None:
    """The layout conversion of block entry ``rest`` of ``config`` (None: the same layout as HF)."""
    if rest.endswith("self_attn.conv1d.weight") and config.linear_attention is not None:
        return ConvLayout(config.linear_attention.key_head_dim)
    return None
