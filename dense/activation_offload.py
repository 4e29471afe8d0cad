"""Fine-grained activation offloading's choices (Megatron's ``--fine-grained-activation-offloading
--offload-modules M [M ...]``): the module names, the size floor, and the checks of a choice. The mechanism (the
host copies, the regions and the prefetch) is ``moefold.execution.offloader``; which region of which layer each
name means is ``moefold.execution.activation_offload``. The names and checks are
``dense.choices`` (torch-free: ``ModelOptions`` validates them before torch is imported), re-exported here.

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

from moefold.dense.choices import (
    MIN_OFFLOADED_TENSOR_SIZE,
    OFFLOAD_MODULES,
    RECOMPUTE_CONFLICTS,
    check_offload,
    check_offload_modules,
)

__all__ = ["MIN_OFFLOADED_TENSOR_SIZE", "OFFLOAD_MODULES", "RECOMPUTE_CONFLICTS", "check_offload",
           "check_offload_modules"]
