"""Fine-grained activation offloading's choices (Megatron's ``--fine-grained-activation-offloading
--offload-modules M [M ...]``): the module names, the size floor, and the checks of a choice. The mechanism (the
host copies, the regions and the prefetch) is ``moefold.execution.offloader``; which region of which layer each
name means is ``moefold.execution.activation_offload``. These stay here, below ``models``, because ``ModelOptions``
validates them.

============== ======================================================= ==========================
module          the tensors its forward saves for backward                region
============== ======================================================= ==========================
attn_norm       the input RMSNorm's input, inverse RMS, normalised value  ``TransformerBlock``
qkv_linear      the q/k/v projections' (gathered) input, q/k norms, RoPE  ``GQAAttention``/``MLAttention``
                (MLA: down-projections, latent norms, up-projections)
core_attn       q, k, v, the attention output and its log-sum-exp         attention modules
attn_proj       the output projection's input (with ``core_attn`` only)   attention modules
mlp_norm        the post-attention RMSNorm's tensors                      ``TransformerBlock``
expert_fc1      the routed experts' input rows (the gate/up GEMM's input) ``GroupedExperts``
moe_act         the gate/up output and the SiLU the activation keeps      ``GroupedExperts``
shared_experts  every tensor of the shared experts                        ``MoELayer``
============== ======================================================= ==========================

A module is recomputed or offloaded, not both (``check_offload``): offloading what a recompute frees (or a
recompute of what is offloaded) is refused with one line, and so is full recompute. Nothing crosses ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                   "shared_experts")
# offload module -> the recompute modules (dense.recompute) that recompute (or free) the same tensors
RECOMPUTE_CONFLICTS = {"attn_norm": ("layernorm",), "mlp_norm": ("layernorm",), "core_attn": ("core_attn",),
                       "qkv_linear": ("mla_up_proj",), "expert_fc1": ("moe",), "moe_act": ("moe_act", "moe"),
                       "shared_experts": ("shared_experts", "moe")}
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024   # Megatron's --min-offloaded-tensor-size default (elements)


def check_offload_modules(modules: Sequence[str], where: str = "--offload-modules") -> tuple[str, ...]:
    """The modules as a tuple (duplicates removed, order kept); ValueError naming an unknown one."""
    bad = [m for m in modules if m not in OFFLOAD_MODULES]
    if bad:
        raise ValueError(f"{where}: {', '.join(map(repr, bad))} not among {', '.join(OFFLOAD_MODULES)}")
    return tuple(dict.fromkeys(modules))


def check_offload(modules: Sequence[str], recompute: str, recompute_modules: Sequence[str]) -> None:
    """ValueError (one line) when an offloaded module is also recomputed, with full recompute, or ``attn_proj``
    without ``core_attn`` (Megatron's rule: the projection's input is core attention's output, which core
    attention keeps too, so offloading it alone frees nothing)."""
    if not modules:
        return
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ValueError("--offload-modules attn_proj needs core_attn as well: the output projection's input is "
                         "core attention's output, which core attention keeps for its own backward")
    if recompute == "full":
        raise ValueError(f"--offload-modules {' '.join(modules)} with --recompute-granularity full: a fully "
                         "recomputed layer keeps only its input, there is nothing to offload; use selective "
                         "recompute or no recompute")
    if recompute != "selective":
        return
    for m in modules:
        both = [r for r in RECOMPUTE_CONFLICTS.get(m, ()) if r in recompute_modules]
        if both:
            raise ValueError(f"--offload-modules {m} and --recompute-modules {both[0]}: a module is recomputed or "
                             "offloaded, not both; drop one of them")

__all__ = ["MIN_OFFLOADED_TENSOR_SIZE", "OFFLOAD_MODULES", "RECOMPUTE_CONFLICTS", "check_offload",
           "check_offload_modules"]
