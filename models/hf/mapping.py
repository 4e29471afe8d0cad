"""Names and layouts: moefold state-dict entries <-> HF checkpoint tensors, per family.

moefold names mirror HF's module names where they exist, so most entries map 1:1
(``layers.3.self_attn.kv_b_proj.weight`` <-> ``model.layers.3.self_attn.kv_b_proj.weight``). The rest:

=====================================  ==========================================================
moefold                                HF
=====================================  ==========================================================
embed_tokens.weight / norm.weight      model.embed_tokens.weight / model.norm.weight
output_head.proj.weight                lm_head.weight (absent with tie_word_embeddings)
layers.i.mlp.router.weight             model.layers.i.mlp.gate.weight (Mixtral on disk: block_sparse_moe.gate)
layers.i.mlp.router.expert_bias        model.layers.i.mlp.gate.e_score_correction_bias (DeepSeek-V3)
layers.i.mlp.experts.w13 [E,2,F,H]     per expert (what ``save_pretrained`` writes):
                                         experts.e.gate_proj / up_proj (Mixtral: block_sparse_moe.experts.e.w1 / w3)
                                       fused (transformers' in-memory layout): experts.gate_up_proj [E, 2F, H]
layers.i.mlp.experts.w2 [E,H,F]        experts.e.down_proj (Mixtral: w2) / fused experts.down_proj [E, H, F]
mtp.k.{enorm,hnorm,eh_proj}            model.layers.{L+k}.{enorm,hnorm,eh_proj} (DeepSeek MTP, L = num_layers)
mtp.k.final_layernorm                  model.layers.{L+k}.shared_head.norm
mtp.k.block.<X>                        model.layers.{L+k}.<X>
(shared copies, ignored on import)     model.layers.{L+k}.embed_tokens / shared_head.head
=====================================  ==========================================================

Qwen3-Next renames its DeltaNet layers' ``self_attn`` to ``linear_attn`` and its shared expert, and stores the
convolution in another channel order (``hf_layout``); see ``models.hf.qwen3_next``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moefold.models.config import ModelConfig
from moefold.models.hf import qwen3_next

EXPERT_FORMATS = ("per_expert", "fused")


@dataclass(frozen=True)
class ExpertNames:
    """HF names of one MoE layer's routed experts."""

    per_expert_prefixes: tuple[str, ...]    # candidates, e.g. "model.layers.3.mlp.experts"
    gate: str                              # per-expert projection names: gate, up, down
    up: str
    down: str
    fused_prefix: str                      # "<...>.mlp.experts" holding gate_up_proj / down_proj

    def per_expert(self, prefix: str, e: int, which: str) -> str:
        return f"{prefix}.{e}.{getattr(self, which)}.weight"

    def fused(self, which: str) -> str:
        return f"{self.fused_prefix}.{'gate_up_proj' if which == 'w13' else 'down_proj'}"


def _layer_prefix(name: str, config: ModelConfig) -> tuple[str, str] | None:
    """('model.layers.j.', rest) for layer and MTP-block names, None otherwise."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return f"model.layers.{m.group(1)}.", m.group(2)
    m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if m:
        j, rest = config.num_layers + int(m.group(1)), m.group(2)
        if rest == "final_layernorm.weight":
            rest = "shared_head.norm.weight"
        elif rest.startswith("block."):
            rest = rest[len("block."):]
        return f"model.layers.{j}.", rest
    return None


def hf_names(name: str, config: ModelConfig, expert_format: str = "per_expert") -> list[str]:
    """Candidate HF names of a plain (non-expert) moefold entry; the first is the one written on export."""
    if name == "embed_tokens.weight":
        return ["model.embed_tokens.weight"]
    if name == "norm.weight":
        return ["model.norm.weight"]
    if name == "output_head.proj.weight":
        return ["lm_head.weight"]
    split = _layer_prefix(name, config)
    if split is None:
        raise ValueError(f"no HF name for moefold tensor {name!r}")
    prefix, rest = split
    moe_blocks = ["mlp", "block_sparse_moe"]
    if config.family == "mixtral" and expert_format == "per_expert":
        moe_blocks.reverse()  # what save_pretrained writes for Mixtral
    if rest == "mlp.router.weight":
        return [f"{prefix}{b}.gate.weight" for b in moe_blocks]
    if rest == "mlp.router.expert_bias":
        return [f"{prefix}mlp.gate.e_score_correction_bias"]
    if config.family == "qwen3_next":
        return [qwen3_next.hf_layer_name(prefix, rest, config)]
    return [prefix + rest]


def hf_layout(name: str, config: ModelConfig) -> qwen3_next.ConvLayout | None:
    """How the HF tensor of moefold entry ``name`` is laid out differently (``hf_shape(shape)``,
    ``to_hf(full)``, ``from_hf(hf_full, shape)``); None when it holds the same full tensor."""
    return qwen3_next.conv_layout(name, config) if config.family == "qwen3_next" else None


def expert_names(name: str, config: ModelConfig) -> ExpertNames | None:
    """HF names for ``...mlp.experts.w13`` / ``...mlp.experts.w2``; None for any other entry."""
    if not re.search(r"\.mlp\.experts\.w(13|2)$", name):
        return None
    prefix, _ = _layer_prefix(name, config)
    if config.family == "mixtral":
        return ExpertNames((f"{prefix}block_sparse_moe.experts", f"{prefix}mlp.experts"), "w1", "w3", "w2",
                           f"{prefix}mlp.experts")
    return ExpertNames((f"{prefix}mlp.experts",), "gate_proj", "up_proj", "down_proj", f"{prefix}mlp.experts")


def ignored_hf_names(config: ModelConfig) -> list[str]:
    """HF tensors read by nobody: DeepSeek's per-MTP copies of the shared embedding and head."""
    out = []
    for k in range(config.mtp_num_layers):
        j = config.num_layers + k
        out += [f"model.layers.{j}.embed_tokens.weight", f"model.layers.{j}.shared_head.head.weight"]
    return out


def is_ignorable(hf_name: str, config: ModelConfig | None = None) -> bool:
    """Non-weights some checkpoints carry (rotary caches), and what transformers does not model either
    (Qwen3-Next's ``mtp.*``)."""
    if config is not None and config.family == "qwen3_next" and qwen3_next.is_ignorable(hf_name):
        return True
    return hf_name.endswith("rotary_emb.inv_freq")
