"""Names and layouts: moefold state-dict entries <-> HF checkpoint tensors, per family.

moefold names mirror HF's module names where they exist, so most entries map 1:1
(``layers.3.self_attn.kv_b_proj.weight`` <-> ``model.layers.3.self_attn.kv_b_proj.weight``). The rest:

=====================================  ==========================================================
moefold                                HF
=====================================  ==========================================================
embed_tokens.weight / norm.weight      model.embed_tokens.weight / model.norm.weight
output_head.proj.weight                lm_head.weight (absent with tie_word_embeddings)
layers.i.mlp.router.weight             model.layers.i.mlp.gate.weight (Mixtral, MiniMax-M2 on disk:
                                       block_sparse_moe.gate; GPT-OSS: mlp.router.weight)
layers.i.mlp.router.bias               model.layers.i.mlp.router.bias (GPT-OSS)
layers.i.mlp.router.expert_bias        model.layers.i.mlp.gate.e_score_correction_bias (DeepSeek-V3, GLM-4.5);
                                       MiniMax-M2: block_sparse_moe.e_score_correction_bias (fused: mlp.)
layers.i.mlp.experts.w13 [E,2,F,H]     per expert (what ``save_pretrained`` writes):
                                         experts.e.gate_proj / up_proj (Mixtral, MiniMax-M2:
                                         block_sparse_moe.experts.e.w1 / w3)
                                       fused (transformers' in-memory layout): experts.gate_up_proj [E, 2F, H]
                                       GPT-OSS (its only layout): experts.gate_up_proj [E, H, 2F], gate and up
                                         interleaved along the last dim (gate = [..., ::2], up = [..., 1::2])
layers.i.mlp.experts.w2 [E,H,F]        experts.e.down_proj (Mixtral: w2) / fused experts.down_proj [E, H, F]
                                       GPT-OSS: experts.down_proj [E, F, H] (transposed)
layers.i.mlp.experts.w13_bias [E,2,F]  GPT-OSS: experts.gate_up_proj_bias [E, 2F] (interleaved like the weight)
layers.i.mlp.experts.w2_bias [E,H]     GPT-OSS: experts.down_proj_bias [E, H]
layers.i.self_attn.sinks [h]           model.layers.i.self_attn.sinks (GPT-OSS)
mtp.k.{enorm,hnorm,eh_proj}            model.layers.{L+k}.{enorm,hnorm,eh_proj} (DeepSeek MTP, L = num_layers)
mtp.k.final_layernorm                  model.layers.{L+k}.shared_head.norm
mtp.k.block.<X>                        model.layers.{L+k}.<X>
(shared copies, ignored on import)     model.layers.{L+k}.embed_tokens / shared_head.head
=====================================  ==========================================================

Qwen3-Next and Qwen3.5-MoE rename their DeltaNet layers' ``self_attn`` to ``linear_attn`` and their shared
expert, and store the convolution in another channel order; Qwen3.5-MoE also splits DeltaNet's fused input
projections in four tensors (``hf_layout``); see ``models.hf.qwen3_next`` and ``models.hf.qwen3_5_moe``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.hf import deepseek_v4, nemotron_h, qwen3_5_moe, qwen3_next
from moefold.models.hf.one_tensor import OneTensor

EXPERT_FORMATS = ("per_expert", "fused")


@dataclass(frozen=True)
class ExpertNames:
    """HF names of one MoE layer's routed experts."""

    per_expert_prefixes: tuple[str, ...]    # candidates, e.g. "model.layers.3.mlp.experts"
    gate: str                              # per-expert projection names: gate, up, down
    up: str
    down: str
    fused_prefix: str                      # "<...>.mlp.experts" holding gate_up_proj / down_proj
    gpt_oss: bool = False                  # GPT-OSS's layout (its only one): fused, transposed, interleaved

    def per_expert(self, prefix: str, e: int, which: str) -> str:
        return f"{prefix}.{e}.{getattr(self, which)}.weight"

    def fused(self, which: str) -> str:
        """``which``: w13, w2, w13_bias or w2_bias."""
        base = "gate_up_proj" if which.startswith("w13") else "down_proj"
        return f"{self.fused_prefix}.{base}{'_bias' if which.endswith('_bias') else ''}"


# GPT-OSS expert layouts <-> moefold's (every function takes and returns full or expert-sliced tensors)
def gpt_oss_w13_from_hf(gate_up_EHF2: Tensor) -> Tensor:
    """``gate_up_proj [E, H, 2F]`` (gate/up interleaved) -> ``w13 [E, 2, F, H]``."""
    E, H, F2 = gate_up_EHF2.shape
    return gate_up_EHF2.reshape(E, H, F2 // 2, 2).permute(0, 3, 2, 1)


def gpt_oss_w13_to_hf(w13_E2FH: Tensor) -> Tensor:
    E, _, F, H = w13_E2FH.shape
    return w13_E2FH.permute(0, 3, 2, 1).reshape(E, H, 2 * F)


def gpt_oss_b13_from_hf(bias_EF2: Tensor) -> Tensor:
    """``gate_up_proj_bias [E, 2F]`` (interleaved) -> ``w13_bias [E, 2, F]``."""
    E, F2 = bias_EF2.shape
    return bias_EF2.reshape(E, F2 // 2, 2).permute(0, 2, 1)


def gpt_oss_b13_to_hf(b13_E2F: Tensor) -> Tensor:
    E, _, F = b13_E2F.shape
    return b13_E2F.permute(0, 2, 1).reshape(E, 2 * F)


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
    if config.family == "nemotron_h":
        return nemotron_h.hf_names(name)
    if config.family == "deepseek_v4":   # DeepSeek's checkpoint names (models.hf.deepseek_v4)
        return deepseek_v4.disk_names(name)
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
    if config.family in ("mixtral", "minimax_m2") and expert_format == "per_expert":
        moe_blocks.reverse()  # what save_pretrained writes for Mixtral and MiniMax-M2
    if config.family == "gpt_oss" and rest.startswith("mlp.router."):
        return [prefix + rest]
    if rest == "mlp.router.weight":
        return [f"{prefix}{b}.gate.weight" for b in moe_blocks]
    if rest == "mlp.router.expert_bias":
        if config.family == "minimax_m2":
            return [f"{prefix}{b}.e_score_correction_bias" for b in moe_blocks]
        return [f"{prefix}mlp.gate.e_score_correction_bias"]
    if config.family in HYBRID_FAMILIES:
        return [qwen3_next.hf_layer_name(prefix, rest, config)]
    return [prefix + rest]


HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")   # Qwen3-Next's naming of DeltaNet and the shared expert


def hf_layout(name: str, config: ModelConfig) -> OneTensor | qwen3_5_moe.SplitLayout | nemotron_h.ExpertStack | None:
    """How moefold entry ``name`` is stored differently in HF: ``hf_parts(shape)`` (the HF tensors' names and
    full shapes), ``to_hf(full)`` (those tensors), ``from_hf(tensors, shape)`` (the full moefold tensor); None
    when it is the one HF tensor ``hf_names(name)[0]`` of the same full shape."""
    if config.family == "nemotron_h":   # its routed experts, per expert
        return nemotron_h.expert_layout(name, config)
    if config.family not in HYBRID_FAMILIES:
        return None
    conv = qwen3_next.conv_layout(name, config)
    if conv is not None:
        return OneTensor(hf_names(name, config)[0], conv)
    split = _layer_prefix(name, config)
    if config.family == "qwen3_5_moe" and split is not None:
        return qwen3_5_moe.split_layout(hf_names(name, config)[0], split[1], config)
    return None


def expert_names(name: str, config: ModelConfig) -> ExpertNames | None:
    """HF names for ``...mlp.experts.w13`` / ``w2`` (and GPT-OSS's ``w13_bias`` / ``w2_bias``); None for any
    other entry."""
    if not re.search(r"\.mlp\.experts\.w(13|2)(_bias)?$", name) or config.family == "nemotron_h":
        return None   # Nemotron-H's ungated experts: nemotron_h.ExpertStack (hf_layout)
    prefix, _ = _layer_prefix(name, config)
    if config.family == "gpt_oss":
        return ExpertNames((), "", "", "", f"{prefix}mlp.experts", gpt_oss=True)
    if name.endswith("_bias"):
        raise ValueError(f"no HF name for {name!r}: expert biases exist in HF GPT-OSS only, not {config.family}")
    if config.family == "deepseek_v4":   # DeepSeek's w1 (gate), w3 (up), w2 (down); fused: the HF module's names
        return ExpertNames(deepseek_v4.expert_prefixes(int(prefix.split(".")[2])), "w1", "w3", "w2",
                           f"{prefix}mlp.experts")
    if config.family in ("mixtral", "minimax_m2"):
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
    (Qwen3-Next's and DeepSeek-V4's ``mtp.*``)."""
    if config is not None and config.family in HYBRID_FAMILIES and qwen3_next.is_ignorable(hf_name):
        return True
    if config is not None and config.family == "nemotron_h" and nemotron_h.is_ignorable(hf_name):
        return True
    if config is not None and config.family == "deepseek_v4" and deepseek_v4.is_ignorable(hf_name):
        return True
    return hf_name.endswith("rotary_emb.inv_freq")
