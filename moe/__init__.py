"""Mixture-of-experts: router, load balancing, grouped experts, shared experts, the MoE layer."""

from __future__ import annotations

from moefold.dispatch.routing import Routing
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.capacity import expert_capacity
from moefold.moe.config import MoEConfig
from moefold.moe.expert_bias import bias_update, update_expert_bias
from moefold.moe.experts import ACTIVATIONS, GroupedExperts, default_output_init_std, is_expert, mark_expert
from moefold.moe.gemm import GEMM_BACKENDS, check_gemm_backend, grouped_gemm
from moefold.moe.layer import MoEDispatchStart, MoELayer, MoEOutputInfo
from moefold.moe.router import Router, RouterGroups, RouterOutput
from moefold.moe.router_config import DROP_POLICIES, LOAD_BALANCING_TYPES, ROUTER_DTYPES, SCORE_FUNCTIONS, RouterConfig
from moefold.moe.router_stats import RouterStats
from moefold.moe.shared_experts import SharedExperts
from moefold.moe.split_gemm import SplitGroupedGemm

__all__ = [
    # router and load balancing
    "Router", "RouterGroups", "RouterOutput", "RouterConfig", "Routing", "RouterStats", "GlobalLoadState",
    "update_expert_bias", "bias_update", "expert_capacity",
    "SCORE_FUNCTIONS", "LOAD_BALANCING_TYPES", "DROP_POLICIES", "ROUTER_DTYPES",
    # experts and the layer
    "MoEConfig", "GroupedExperts", "SharedExperts", "MoELayer", "MoEOutputInfo", "MoEDispatchStart", "SplitGroupedGemm",
    "ACTIVATIONS", "mark_expert", "is_expert", "default_output_init_std",
    "GEMM_BACKENDS", "grouped_gemm", "check_gemm_backend",
]
