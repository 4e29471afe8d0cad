"""Qwen3.5-MoE text (HF ``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``) <-> moefold.

Read from transformers 5.25's ``modeling_qwen3_5_moe``: Qwen3-Next's hybrid stack (``models.hf.qwen3_next``:
Gated DeltaNet and gated attention per ``layer_types``, zero-centred RMSNorms, a sigmoid-gated shared expert)
with these differences, each handled here:

- every layer is MoE (the config has no ``intermediate_size``, ``decoder_sparse_step`` nor ``mlp_only_layers``)
  and the router always renormalises its top-k (no ``norm_topk_prob``); the shared expert is always built.
- DeltaNet's input projections are four tensors, each in the (all heads of q, of k, of v) order of the
  convolution: ``in_proj_qkv [2 hk dk + hv dv, H]``, ``in_proj_z [hv dv, H]``, ``in_proj_b`` / ``in_proj_a
  [hv, H]``. moefold keeps Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` (what a tp shard
  needs: whole key heads, ``dense.gated_deltanet``); ``SplitLayout`` converts both ways. Value head ``j``
  belongs to key head ``j // r`` in both (transformers repeats q and k with ``repeat_interleave``).
- RoPE is multimodal (``mrope_section``, ``mrope_interleaved`` in ``rope_parameters``): each frequency takes
  the temporal, height or width position; a text-only sequence has the three equal, which is the plain 1-D
  rotary embedding. Both keys are therefore read and inert for text.
- the published checkpoints are ``Qwen3_5MoeForConditionalGeneration`` (vision tower, ``text_config``);
  this module reads the text model's config (``Qwen3_5MoeTextConfig``), as ``Qwen3_5MoeForCausalLM`` does.
  ``mtp.*`` tensors are ignored, as transformers ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.hf import qwen3_next

ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MODEL_TYPE = "qwen3_5_moe_text"


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` of a ``qwen3_5_moe_text`` config.json: Qwen3-Next's reading with every layer MoE and
    the top-k renormalised."""
    fixed = {k: v for k, v in hf.items() if k not in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")}
    return qwen3_next.config_from_hf({**fixed, "num_experts": int(hf.get("num_experts", 256)),
                                   "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
                                   "moe_intermediate_size": int(hf.get("moe_intermediate_size", 512)),
                                   "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size",
                                                                                 512)),
                                   "norm_topk_prob": True, "intermediate_size": 0}, common)


def required(c: ModelConfig) -> dict[str, Any]:
    """Field values HF's Qwen3.5-MoE hard-codes (Qwen3-Next's, a renormalised top-k and a shared expert)."""
    return {**qwen3_next.required(c), "moe_norm_topk_prob": True, "moe_shared_expert_gate": True}


def check_exportable(c: ModelConfig) -> list[str]:
    """What ``c`` has that ``Qwen3_5MoeForCausalLM`` cannot express (empty: nothing)."""
    why = []
    if not c.num_experts or not all(c.is_moe_layer(i) for i in range(c.num_layers)):
        why.append("every layer must be MoE (HF Qwen3.5-MoE has no dense layers)")
    if c.num_experts and c.moe_shared_expert_ffn_size <= 0:
        why.append("a shared expert is required (HF shared_expert_intermediate_size > 0)")
    return why


def hf_fields(c: ModelConfig) -> dict[str, Any]:
    """The qwen3_5_moe_text-specific HF fields of ``c``."""
    out = qwen3_next.hf_fields(c)
    for key in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
        out.pop(key, None)
    return out


def respell(own: dict[str, Any], original: dict[str, Any], c: ModelConfig) -> dict[str, Any]:
    """Keep the original's ``full_attention_interval`` spelling when it says the same layer pattern."""
    if "layer_types" not in original and qwen3_next.layer_types(original) == c.layer_types:
        own.pop("layer_types")
    return own


# moefold's fused DeltaNet projections -> the HF tensors they are stored as
_SPLIT = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


@dataclass(frozen=True)
class SplitLayout:
    """moefold's per-key-head ``in_proj_qkvz [hk (2dk + 2 r dv), H]`` or ``in_proj_ba [hk 2r, H]`` <-> HF's
    ``(in_proj_qkv [2 hk dk + hk r dv, H], in_proj_z [hk r dv, H])`` or ``(in_proj_b, in_proj_a) [hk r, H]``,
    whose rows are head-major over all heads of each part."""

    hf_names: tuple[str, ...]        # the HF tensors, in order
    widths: tuple[int, ...]          # per key head: the rows of each of moefold's parts (q, k, v, z or b, a)
    groups: tuple[tuple[int, ...], ...]   # which of those parts each HF tensor holds
    num_key_heads: int

    def hf_parts(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        hk, H = self.num_key_heads, shape[1]
        return [(n, (hk * sum(self.widths[i] for i in g), H)) for n, g in zip(self.hf_names, self.groups)]

    def to_hf(self, full: Tensor) -> list[Tensor]:
        parts = full.view(self.num_key_heads, -1, full.shape[-1]).split(list(self.widths), dim=1)
        return [torch.cat([parts[i].reshape(-1, full.shape[-1]) for i in g]).contiguous() for g in self.groups]

    def from_hf(self, tensors: list[Tensor], shape: tuple[int, ...]) -> Tensor:
        hk, H = self.num_key_heads, shape[1]
        parts: dict[int, Tensor] = {}
        for t, g in zip(tensors, self.groups):
            for i, piece in zip(g, t.split([hk * self.widths[i] for i in g])):
                parts[i] = piece.view(hk, self.widths[i], H)
        return torch.cat([parts[i] for i in range(len(self.widths))], dim=1).reshape(shape).contiguous()


def split_layout(hf_name: str, rest: str, config: ModelConfig) -> SplitLayout | None:
    """The layout of block entry ``rest`` (HF name ``hf_name`` of its fused form), None unless it is one of
    DeltaNet's fused projections."""
    la = config.linear_attention
    for fused, parts in _SPLIT.items():
        if rest == f"self_attn.{fused}.weight" and la is not None:
            r = la.num_value_heads // la.num_key_heads
            base = hf_name[: -len(f"{fused}.weight")]
            if fused == "in_proj_qkvz":
                widths, groups = (la.key_head_dim, la.key_head_dim, r * la.value_head_dim,
                                  r * la.value_head_dim), ((0, 1, 2), (3,))
            else:
                widths, groups = (r, r), ((0,), (1,))
            return SplitLayout(tuple(f"{base}{p}.weight" for p in parts), widths, groups, la.num_key_heads)
    return None
