"""DeepSeek-V4's MoE block, transformers' and moefold's: one builder and one weight copy for the parity tests."""

from __future__ import annotations

import torch
from torch import nn

from moefold.moe.activation import GatedActivation
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims


def v4_moe_layer(hf_block: nn.Module, hidden: int, vocab: int, limit: float, scale: float) -> MoELayer:
    """moefold's layer for ``DeepseekV4SparseMoeBlock`` ``hf_block`` (sqrtsoftplus; hash table or top-k with the
    correction bias; SwiGLU clamped at ``limit`` on the routed and the shared experts), holding its weights."""
    gate, experts = hf_block.gate, hf_block.experts
    e, ffn, topk, hashed = experts.num_experts, experts.intermediate_dim, gate.top_k, hasattr(gate, "tid2eid")
    rc = RouterConfig(num_experts=e, topk=topk, score_function="sqrtsoftplus", topk_scaling_factor=scale,
                      norm_topk_prob=True, enable_expert_bias=not hashed)
    cfg = MoEConfig(num_experts=e, router=rc, experts=ExpertsConfig(ffn, glu=GatedActivation(clamp=limit)),
                    shared=SharedExpertsConfig(ffn, clamp=limit))
    layer = build_moe_layer(cfg, hidden, ParallelDims.single(), hash_vocab_size=vocab if hashed else None)
    with torch.no_grad():
        layer.router.weight.copy_(gate.weight)
        if hashed:
            layer.router.tid2eid.copy_(gate.tid2eid)
        else:
            layer.router.expert_bias.copy_(gate.e_score_correction_bias)
        layer.experts.w13.copy_(experts.gate_up_proj.view(e, 2, ffn, hidden))
        layer.experts.w2.copy_(experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_experts, name).weight.copy_(getattr(hf_block.shared_experts, name).weight)
    return layer
