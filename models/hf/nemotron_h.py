"""Nemotron-H (HF ``nemotron_h``, ``NemotronHForCausalLM``, Nemotron 3) <-> moefold: config fields, tensor names.

Read from transformers 5.25's ``modeling_nemotron_h``:

- each layer is ONE pre-norm sublayer, ``x + mixer(norm(x))``, its kind from ``layers_block_type`` (older
  configs: ``hybrid_override_pattern``, ``M`` mamba, ``*`` attention, ``E`` MoE, ``-`` MLP): moefold builds a
  ``TransformerBlock`` holding only its mixer (``mamba`` / ``full_attention``, in the ``self_attn`` slot with
  ``input_layernorm``) or only its FFN (``moe`` / ``mlp``, in the ``mlp`` slot with ``post_attention_layernorm``).
- Mamba-2 mixers (``dense.mamba2``, HF ``linear_attention``); attention without any positional encoding
  (``partial_rotary_factor=0``) and without biases; every MLP ungated squared ReLU (``mlp_hidden_act=relu2``).
- the MoE: DeepSeek-V3's router (sigmoid, ``e_score_correction_bias``, groups ranked by their top 2, scaling),
  ungated relu2 experts, one relu2 shared expert of ``moe_shared_expert_intermediate_size``, and with
  ``moe_latent_size`` the routed experts at that width between ``fc1_latent_proj`` / ``fc2_latent_proj``.
- names: transformers reads the hub's ``backbone.*`` as ``model.*`` and its per-expert ``experts.e.up_proj`` /
  ``down_proj`` fused; moefold reads both prefixes and writes the hub's form (``backbone.``, per expert). ``mtp.*``
  tensors are ignored, as transformers ignores them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.dense.mamba2_layout import conv_layout, in_proj_layout
from moefold.models.config import ModelConfig
from moefold.models.hf.one_tensor import OneTensor
from moefold.models.mamba_dims import MambaDims

ARCHITECTURE = "NemotronHForCausalLM"
MODEL_TYPE = "nemotron_h"
# HF layer type (and legacy names) -> moefold's; the pattern letters of hybrid_override_pattern
_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "full_attention",
          "attention": "full_attention", "moe": "moe", "mlp": "mlp"}
_LETTERS = {"M": "mamba", "*": "full_attention", "E": "moe", "-": "mlp"}
_HF_TYPES = {"mamba": "linear_attention", "full_attention": "full_attention", "moe": "moe", "mlp": "mlp"}
# fields whose value transformers' class computes with but moefold does not build: refused unless the default
REFUSED = {"mlp_hidden_act": ("relu2", "MLP and expert activations other than squared ReLU"),
           "mamba_hidden_act": ("silu", "a Mamba convolution activation other than SiLU"),
           "mlp_bias": (False, "biases on the MLPs, shared experts and latent projections"),
           "hidden_dropout": (0.0, "dropout"), "attention_dropout": (0.0, "attention dropout"),
           "sliding_window": (None, "sliding-window attention")}


def _float(value: Any) -> float:
    """A float of config.json: transformers writes an infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _json_float(value: float) -> Any:
    return {"__float__": "Infinity"} if value == math.inf else value


def layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """moefold's layer types of a nemotron_h config.json (``layers_block_type`` or ``hybrid_override_pattern``)."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            return ("mamba", "moe", "full_attention", "mlp")   # NemotronHConfig's default
        bad = sorted(set(pattern) - set(_LETTERS))
        if bad:
            raise ValueError(f"nemotron_h: hybrid_override_pattern={pattern!r} holds {bad}; valid letters: "
                             f"{', '.join(_LETTERS)}")
        return tuple(_LETTERS[ch] for ch in pattern)
    bad = sorted(set(types) - set(_TYPES))
    if bad:
        raise ValueError(f"nemotron_h: layers_block_type holds {bad}; valid: {', '.join(_TYPES)}")
    return tuple(_TYPES[t] for t in types)


def check_fields(hf: dict[str, Any]) -> None:
    """One line naming the field and its value for what moefold does not build."""
    for key, (default, what) in REFUSED.items():
        if key in hf and hf[key] != default and not (default == 0.0 and hf[key] == 0):
            raise ValueError(f"nemotron_h: {key}={hf[key]!r} is not supported ({what}; transformers computes a "
                             f"model moefold does not build; {default!r} is)")


def config_from_hf(hf: dict[str, Any], name: str) -> ModelConfig:
    """``ModelConfig`` of a ``nemotron_h`` config.json (``NemotronHConfig``'s defaults where a key is absent)."""
    check_fields(hf)
    types = layer_types(hf)
    moe = tuple(int(t == "moe") for t in types)
    E = int(hf.get("n_routed_experts", hf.get("num_local_experts", 8))) if any(moe) else 0
    n_group = int(hf.get("n_group") or 1)
    latent = hf.get("moe_latent_size")
    limit = hf.get("time_step_limit", (0.0, math.inf))
    router = dict(moe_ffn_hidden_size=int(hf.get("moe_intermediate_size", 7688)),
                  moe_topk=int(hf.get("num_experts_per_tok", 2)), moe_score_function="sigmoid",
                  moe_expert_bias=True, moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                  moe_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                  moe_num_groups=n_group if n_group > 1 else None,
                  moe_group_topk=int(hf.get("topk_group", 1)) if n_group > 1 else None,
                  moe_group_score_topk=2 if n_group > 1 else None,
                  moe_shared_expert_ffn_size=int(hf.get("moe_shared_expert_intermediate_size", 7688)),
                  moe_latent_size=None if latent is None else int(latent), moe_layer_freq=moe,
                  moe_aux_loss_coeff=1e-4, moe_load_balancing_type="seq_aux_loss") if E else {}
    return ModelConfig(
        name=name, family="nemotron_h", vocab_size=int(hf.get("vocab_size", 131072)),
        hidden_size=int(hf.get("hidden_size", 4096)), num_layers=len(types),
        num_attention_heads=int(hf.get("num_attention_heads", 32)),
        num_query_groups=int(hf.get("num_key_value_heads") or hf.get("num_attention_heads", 32)),
        head_dim=int(hf.get("head_dim", 128)), partial_rotary_factor=0.0,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=False,   # transformers' NemotronH ties nothing (_tied_weights_keys = {}), whatever the flag
        ffn_hidden_size=int(hf.get("intermediate_size", 21504)) if "mlp" in types else 0,
        ffn_activation="relu2", layer_types=types, num_experts=E, **router,
        mamba=MambaDims(num_heads=int(hf.get("mamba_num_heads", 128)), head_dim=int(hf.get("mamba_head_dim", 64)),
                        state_size=int(hf.get("ssm_state_size", 128)), num_groups=int(hf.get("n_groups", 8)),
                        conv_kernel=int(hf.get("conv_kernel", 4)), conv_bias=bool(hf.get("use_conv_bias", True)),
                        proj_bias=bool(hf.get("use_bias", False)), chunk_size=int(hf.get("chunk_size", 128)),
                        time_step_limit=(_float(limit[0]), _float(limit[1]))) if "mamba" in types else None,
        extra={"hf_config": dict(hf)})


def required(c: ModelConfig) -> dict[str, Any]:
    """Field values HF's NemotronH hard-codes (others are refused on export, naming them)."""
    return {"attention": "gqa", "qk_norm": False, "attention_output_gate": False, "partial_rotary_factor": 0.0,
            "attention_bias": False, "attention_sinks": False, "sliding_window": None, "ffn_activation": "relu2",
            "norm_zero_centered_gamma": False, "mtp_num_layers": 0,
            "tie_word_embeddings": False,
            **({"moe_score_function": "sigmoid", "moe_expert_bias": True, "moe_shared_expert_gate": False,
                "moe_pre_softmax": False} if c.num_experts else {})}


def to_hf_config(c: ModelConfig, dtype: str) -> dict[str, Any]:
    """The HF config.json of ``c``, starting from the one it was read from (fields moefold does not model kept)."""
    bad = {k: getattr(c, k) for k, v in required(c).items() if getattr(c, k) != v}
    if c.layer_types is None or not c.hybrid.one_sublayer:
        bad["layer_types"] = c.layer_types
    if c.num_experts and c.moe_num_groups and (c.moe_group_score_topk or 2) != 2:
        bad["moe_group_score_topk"] = c.moe_group_score_topk
    if bad:
        raise ValueError(f"{c.name}: cannot be expressed as an HF {ARCHITECTURE} config: {bad} "
                         f"(HF needs {({k: required(c).get(k) for k in bad})})")
    m = c.mamba or MambaDims()
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "layers_block_type": [_HF_TYPES[c.layer_type(i)] for i in range(c.num_layers)],
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.kv_heads,
        "head_dim": c.attention_head_dim, "max_position_embeddings": c.max_position_embeddings,
        "layer_norm_epsilon": c.norm_eps,
        "intermediate_size": c.ffn_hidden_size, "mlp_hidden_act": "relu2", "mlp_bias": False,
        "mamba_num_heads": m.num_heads, "mamba_head_dim": m.head_dim, "ssm_state_size": m.state_size,
        "n_groups": m.num_groups, "conv_kernel": m.conv_kernel, "use_conv_bias": m.conv_bias,
        "use_bias": m.proj_bias, "chunk_size": m.chunk_size,
        "time_step_limit": [_json_float(math.inf if v is None else v) for v in m.time_step_limit],
        "dtype": dtype}
    if c.num_experts:
        out.update(n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_topk,
                   moe_intermediate_size=c.moe_ffn_hidden_size,
                   moe_shared_expert_intermediate_size=c.moe_shared_expert_ffn_size,
                   moe_latent_size=c.moe_latent_size, routed_scaling_factor=c.moe_topk_scaling_factor,
                   n_group=c.moe_num_groups or 1, topk_group=c.moe_group_topk or 1,
                   norm_topk_prob=c.moe_norm_topk_prob)
    original = dict((c.extra or {}).get("hf_config") or {})
    for legacy in ("hybrid_override_pattern", "num_hidden_layers", "layer_types"):
        if legacy in original and "layers_block_type" not in original:
            original.pop(legacy)   # layers_block_type says it
    if "torch_dtype" in original:
        out["torch_dtype"] = out.pop("dtype")
    return {**original, **out}


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_RENAME = {"input_layernorm.weight": "norm.weight", "post_attention_layernorm.weight": "norm.weight",
           "mlp.router.weight": "mixer.gate.weight", "mlp.router.expert_bias": "mixer.gate.e_score_correction_bias",
           "mlp.latent_down.weight": "mixer.fc1_latent_proj.weight",
           "mlp.latent_up.weight": "mixer.fc2_latent_proj.weight"}


def hf_names(name: str) -> list[str]:
    """Candidate HF names of moefold entry ``name`` (the hub's ``backbone.`` first: what export writes)."""
    top = {"embed_tokens.weight": "embeddings.weight", "norm.weight": "norm_f.weight"}
    if name == "output_head.proj.weight":
        return ["lm_head.weight"]
    if name in top:
        return [f"backbone.{top[name]}", f"model.{top[name]}"]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise ValueError(f"no HF nemotron_h name for moefold tensor {name!r}")
    i, rest = m.groups()
    if rest in _RENAME:
        rest = _RENAME[rest]
    else:
        for slot in ("self_attn.", "mlp."):
            if rest.startswith(slot):
                rest = "mixer." + rest[len(slot):]
    return [f"backbone.layers.{i}.{rest}", f"model.layers.{i}.{rest}"]


@dataclass(frozen=True)
class ExpertStack:
    """moefold's ``w13 [E, 1, F, L]`` / ``w2 [E, L, F]`` <-> the hub's per-expert ``experts.e.up_proj.weight
    [F, L]`` / ``experts.e.down_proj.weight [L, F]`` (read whole, stacked)."""

    prefix: str      # "backbone.layers.i.mixer.experts"
    which: str       # "up_proj" or "down_proj"

    def hf_parts(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        per = shape[2:] if self.which == "up_proj" else shape[1:]
        return [(f"{self.prefix}.{e}.{self.which}.weight", tuple(per)) for e in range(shape[0])]

    def to_hf(self, full: Tensor) -> list[Tensor]:
        return [(t[0] if self.which == "up_proj" else t).contiguous() for t in full]

    def from_hf(self, tensors: list[Tensor], shape: tuple[int, ...]) -> Tensor:
        return torch.stack(tensors).reshape(shape)


def expert_layout(name: str, config: ModelConfig) -> ExpertStack | OneTensor | None:
    """How ``name`` is stored differently in HF: the routed experts per expert (``layers.i.mlp.experts.w13`` /
    ``w2``), a Mamba-2 layer's ``in_proj`` and convolution part-major (``dense.mamba2_layout``); None otherwise."""
    mixer = re.fullmatch(r"layers\.(\d+)\.self_attn\.(in_proj|conv1d)\.(weight|bias)", name)
    if mixer is not None and config.layer_type(int(mixer.group(1))) == "mamba":
        m = config.mamba
        make = in_proj_layout if mixer.group(2) == "in_proj" else conv_layout
        return OneTensor(hf_names(name)[0], make(m.num_heads, m.head_dim, m.state_size, m.num_groups))
    m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(w13|w2)", name)
    if m is None:
        return None
    return ExpertStack(f"backbone.layers.{m.group(1)}.mixer.experts", "up_proj" if m.group(2) == "w13" else "down_proj")


def is_ignorable(hf_name: str) -> bool:
    return hf_name.startswith("mtp.")
