"""The model-definition flags of ``moefold train``, with Megatron-LM's names: any model of the three families
without code.

    moefold train --recipe qwen3_moe_tiny --hidden-size 512 --num-layers 8 --num-attention-heads 8 \\
        --num-query-groups 4 --kv-channels 64 --num-experts 16 --moe-ffn-hidden-size 256 --moe-router-topk 4 \\
        --moe-layer-freq "([0]*1+[1]*7)" --vocab-size 32000

The recipe gives the family and every value not set; each flag replaces one ``ModelConfig`` field
(``ARCH_FLAGS``). Flags that do not exist in a family fail naming it (``--q-lora-rank`` on GQA,
``--kv-channels`` on MLA). ``--moe-layer-freq`` takes Megatron's int (layer i is MoE when i % N == 0) or
its pattern syntax (``"([0]*3+[1]*58)"``: one 0/1 per layer), and then alone decides which layers are
MoE (``first_k_dense_replace`` becomes 0). ``--window-size`` takes the HF sliding window N (a query
sees N keys, itself included) or Megatron's ``"L,0"`` (L keys to the left: N = L + 1);
``--window-attn-skip-freq N`` makes every N-th layer (1-based, Megatron's count) full attention and the
others windowed (GPT-OSS: 2).

With ``--load-hf DIR`` the architecture is DIR's ``config.json``: these flags are refused, except with
``--moe-use-upcycling``, where ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size`` and
``--moe-layer-freq`` choose the MoE the dense model becomes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from moefold.models.config import ModelConfig

GQA, MLA = "gqa", "mla"


def parse_layer_pattern(text: str | int) -> int | tuple[int, ...]:
    """Megatron's ``moe_freq_type``: ``"4"`` -> 4, ``"([0]*3+[1]*5)"`` -> (0, 0, 0, 1, 1, 1, 1, 1).

    The pattern is a list expression of 0/1 integers with ``+``, ``*`` and parentheses, evaluated without
    ``eval``."""
    if isinstance(text, int):
        return text
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a pattern like ([0]*3+[1]*58)") from None

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        result = None
    if not isinstance(result, list) or not result or any(v not in (0, 1) for v in result):
        raise argparse.ArgumentTypeError(f"{text!r} is not a pattern of 0/1 layers like ([0]*3+[1]*58)")
    return tuple(result)


def parse_window(text: str) -> int:
    """``--window-size``: ``"4096"`` (HF sliding_window) or Megatron's ``"4095,0"`` / ``"(4095,0)"`` -> 4096."""
    parts = [p for p in str(text).strip("() ").split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1 and values[0] >= 1:
        return values[0]
    if len(values) == 2 and values[0] >= 0 and values[1] == 0:
        return values[0] + 1
    raise argparse.ArgumentTypeError(f"{text!r}: give the window N (keys a query sees, itself included) or "
                                     "Megatron's (left, 0)")


NONE = "none"   # a flag given as "none" (unset flags are None)


def _int_or_none(text: str) -> int | str:
    return NONE if text.lower() == NONE else int(text)


Current = Callable[[str], Any]   # a field's value with the changes made so far


def _mla(field: str) -> Callable[[Current, Any], dict]:
    def apply(current: Current, v: Any) -> dict:
        return {"mla": dataclasses.replace(current("mla"), **{field: None if v == NONE else v})}
    return apply


def _latent_eps(current: Current, v: float) -> dict:
    """Megatron's --norm-epsilon is every norm's eps, MLA's latent norms included (HF fixes those at 1e-6)."""
    return {"mla": dataclasses.replace(current("mla"), latent_norm_eps=v)} if current("attention") == "mla" else {}


# flag, argparse type, attention kinds it applies to, the ModelConfig fields it sets
ARCH_FLAGS: tuple[tuple[str, Callable[[str], Any], tuple[str, ...], Callable[[Current, Any], dict]], ...] = (
    ("--num-layers", int, (GQA, MLA), lambda c, v: {"num_layers": v}),
    ("--hidden-size", int, (GQA, MLA), lambda c, v: {"hidden_size": v}),
    ("--ffn-hidden-size", int, (GQA, MLA), lambda c, v: {"ffn_hidden_size": v}),
    ("--num-attention-heads", int, (GQA, MLA), lambda c, v: {"num_attention_heads": v}),
    ("--num-query-groups", int, (GQA,), lambda c, v: {"num_query_groups": v}),
    ("--kv-channels", int, (GQA,), lambda c, v: {"head_dim": v}),
    ("--num-experts", int, (GQA, MLA), lambda c, v: {"num_experts": v}),
    ("--moe-ffn-hidden-size", int, (GQA, MLA), lambda c, v: {"moe_ffn_hidden_size": v}),
    ("--moe-router-topk", int, (GQA, MLA), lambda c, v: {"moe_topk": v}),
    ("--moe-shared-expert-intermediate-size", int, (GQA, MLA), lambda c, v: {"moe_shared_expert_ffn_size": v}),
    ("--moe-layer-freq", parse_layer_pattern, (GQA, MLA),
     lambda c, v: {"moe_layer_freq": v, "first_k_dense_replace": 0}),
    ("--mtp-num-layers", int, (GQA, MLA), lambda c, v: {"mtp_num_layers": v}),
    ("--q-lora-rank", _int_or_none, (MLA,), _mla("q_lora_rank")),
    ("--kv-lora-rank", int, (MLA,), _mla("kv_lora_rank")),
    ("--qk-head-dim", int, (MLA,), _mla("qk_nope_head_dim")),
    ("--qk-pos-emb-head-dim", int, (MLA,), _mla("qk_rope_head_dim")),
    ("--v-head-dim", int, (MLA,), _mla("v_head_dim")),
    ("--rotary-base", float, (GQA, MLA), lambda c, v: {"rope_theta": v}),
    ("--max-position-embeddings", int, (GQA, MLA), lambda c, v: {"max_position_embeddings": v}),
    ("--norm-epsilon", float, (GQA, MLA), lambda c, v: {"norm_eps": v, **_latent_eps(c, v)}),
    ("--untie-embeddings-and-output-weights", bool, (GQA, MLA), lambda c, v: {"tie_word_embeddings": not v}),
    ("--qk-layernorm", bool, (GQA,), lambda c, v: {"qk_norm": v}),
    ("--window-size", parse_window, (GQA,), lambda c, v: {"sliding_window": v}),
    ("--window-attn-skip-freq", int, (GQA,),
     lambda c, v: {"sliding_window_pattern": tuple(int((i + 1) % v != 0) for i in range(c("num_layers")))}),
    ("--softmax-type", str, (GQA,), lambda c, v: {"attention_sinks": _softmax_type(v)}),
    ("--rotary-percent", float, (GQA,), lambda c, v: {"partial_rotary_factor": v}),
    ("--activation-func-clamp-value", float, (GQA, MLA), lambda c, v: {"moe_activation_clamp": v}),
    ("--glu-linear-offset", float, (GQA, MLA), lambda c, v: {"moe_glu_linear_offset": v}),
)
# what --moe-use-upcycling lets a user choose about the MoE the dense model becomes
UPCYCLING_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq")
HELP = {
    "--num-layers": "decoder layers (without MTP)", "--hidden-size": "model width",
    "--num-attention-heads": "query heads", "--num-experts": "routed experts per MoE layer (0: a dense model)",
    "--moe-router-topk": "experts per token", "--kv-lora-rank": "MLA compressed K/V latent size",
    "--v-head-dim": "MLA value head dim", "--max-position-embeddings": "longest sequence the RoPE setup allows",
    "--norm-epsilon": "RMSNorm epsilon",
    "--ffn-hidden-size": "dense MLP size", "--moe-ffn-hidden-size": "routed expert size",
    "--num-query-groups": "kv heads", "--kv-channels": "attention head dim",
    "--moe-shared-expert-intermediate-size": "shared experts' total size (0: none)",
    "--moe-layer-freq": 'MoE layers: N (every N-th) or a 0/1 pattern such as "([0]*3+[1]*58)"',
    "--mtp-num-layers": "multi-token prediction depths", "--q-lora-rank": "MLA q compression (none: full q_proj)",
    "--qk-head-dim": "MLA q/k head dim without rope", "--qk-pos-emb-head-dim": "MLA rope head dim",
    "--rotary-base": "RoPE theta", "--untie-embeddings-and-output-weights": "separate output head "
    "(--no-untie-...: tied)", "--qk-layernorm": "RMSNorm on q and k heads (Qwen3)",
    "--window-size": "sliding window: N, or Megatron's L,0",
    "--window-attn-skip-freq": "every N-th layer full attention, the others windowed (GPT-OSS: 2)",
    "--softmax-type": "vanilla, or learnable: attention sinks, a learned logit per head (GPT-OSS)",
    "--rotary-percent": "fraction of each head's dims RoPE rotates (GLM-4.5, MiniMax-M2: 0.5)",
    "--activation-func-clamp-value": "experts' SwiGLU: gate <= c, up in [-c, c] (GPT-OSS: 7)",
    "--glu-linear-offset": "experts' SwiGLU: act(gate) * (up + offset) (GPT-OSS: 1)",
}


def _softmax_type(text: str) -> bool:
    if text not in ("vanilla", "learnable"):
        raise ValueError(f"--softmax-type {text!r}; valid: vanilla, learnable (Megatron's off-by-one is not "
                         "implemented)")
    return text == "learnable"


def dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def model_json(text: str) -> dict[str, Any]:
    """``--model-json``: a JSON mapping of ``ModelConfig`` fields (checked when the model is built from it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping of model fields, got a {type(value).__name__}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The architecture flags, as their own argument group."""
    g = parser.add_argument_group("model definition (Megatron-LM names; change the --recipe's model)")
    g.add_argument("--model-json", type=model_json, default=None, metavar="JSON",
                   help="the whole model, every field of the recipe's replaced (a --config file's model: section, "
                        "which each run's config.yaml records); the flags below change it")
    for flag, typ, kinds, _ in ARCH_FLAGS:
        only = "" if len(kinds) > 1 else " (MLA only)" if kinds == (MLA,) else " (GQA only)"
        text = f"{HELP[flag]}{only}; default: the recipe's"
        if typ is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            g.add_argument(flag, type=typ, default=None, help=text)


def given_model_flags(args: argparse.Namespace) -> list[str]:
    """The architecture flags set on the command line."""
    return [flag for flag, *_ in ARCH_FLAGS if getattr(args, dest(flag), None) is not None]


def apply_model_flags(config: ModelConfig, args: argparse.Namespace, only: tuple[str, ...] | None = None,
                      ) -> ModelConfig:
    """``config`` with every given architecture flag (of ``only``, when given) applied; ValueError naming the
    flag when it does not apply to the family or the result is not a valid model."""
    changes: dict[str, Any] = {}
    for flag, _, kinds, apply in ARCH_FLAGS:
        value = getattr(args, dest(flag), None)
        if value is None or (only is not None and flag not in only):
            continue
        if config.attention not in kinds:
            kind = "multi-latent attention (DeepSeek-V3)" if config.attention == MLA else "GQA attention"
            raise ValueError(f"{flag} does not apply to {config.name} ({config.family}, {kind})")
        changes.update(apply(lambda name: changes.get(name, getattr(config, name)), value))
    if not changes:
        return config
    try:
        return config.with_(**changes)
    except ValueError as exc:
        flags = " ".join(f for f in given_model_flags(args) if only is None or f in only)
        raise ValueError(f"{exc} (model flags: {flags})") from exc
