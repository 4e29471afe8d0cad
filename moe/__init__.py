"""Mixture-of-experts: router, load balancing, grouped experts and their GEMM backends, shared experts, the MoE layer.

``build_moe_layer`` (``moe.build``) turns a ``MoEConfig`` into the layer's parts and passes them in:
``MoELayer(router, dispatcher, experts, shared_experts)``. The execution pass changes the layer and its experts only
through their ``configure`` (regions and strategy objects, ``dense.regions``). ``moe.cpu`` holds the CPU-speed
machinery of the ``grouped_mm`` expert backend on a CPU (row layouts, the rows' GEMMs, the shortcuts' switch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.dispatch.routing import Routing
    from moefold.moe.activation import (
        BACKEND_ACTIVATION,
        COMPILED_ACTIVATION,
        ActivationKernel,
        ExpertActivation,
        GatedActivation,
        fused_activation,
    )
    from moefold.moe.balance_losses import GlobalLoadState
    from moefold.moe.build import build_expert_gemm, build_experts, build_moe_layer
    from moefold.moe.capacity import expert_capacity
    from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
    from moefold.moe.expert_bias import bias_update, update_expert_bias
    from moefold.moe.expert_gemm import ExpertGemm, GemmCall, Projection, WeightGrads
    from moefold.moe.experts import ExpertsRegions, GroupedExperts, default_output_init_std, is_expert, mark_expert
    from moefold.moe.gemm import check_gemm_backend, grouped_gemm
    from moefold.moe.gemm_backend import GemmBackend
    from moefold.moe.layer import MoEDispatchStart, MoEExpertsOut, MoELayer, MoEOutputInfo, MoERegions
    from moefold.moe.router import Router, RouterGroups, RouterOutput
    from moefold.moe.router_config import (
        DROP_POLICIES,
        LOAD_BALANCING_TYPES,
        ROUTER_DTYPES,
        SCORE_FUNCTIONS,
        RouterConfig,
    )
    from moefold.moe.router_stats import RouterStats
    from moefold.moe.routing_replay import LIVE_ROUTING, RoutingRecorder, RoutingReplayer, RoutingTap
    from moefold.moe.shared_experts import SharedExperts
    from moefold.moe.split_gemm import SplitGroupedGemm

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    "Routing": "moefold.dispatch.routing",
    **dict.fromkeys(["ExpertActivation", "GatedActivation", "fused_activation", "BACKEND_ACTIVATION",
                      "COMPILED_ACTIVATION", "ActivationKernel"], "moefold.moe.activation"),
    "GlobalLoadState": "moefold.moe.balance_losses",
    **dict.fromkeys(["build_expert_gemm", "build_experts", "build_moe_layer"], "moefold.moe.build"),
    "expert_capacity": "moefold.moe.capacity",
    **dict.fromkeys(["ExpertsConfig", "MoEConfig", "SharedExpertsConfig"], "moefold.moe.config"),
    **dict.fromkeys(["bias_update", "update_expert_bias"], "moefold.moe.expert_bias"),
    **dict.fromkeys(["ExpertGemm", "GemmCall", "Projection", "WeightGrads"], "moefold.moe.expert_gemm"),
    **dict.fromkeys(["GroupedExperts", "ExpertsRegions", "default_output_init_std", "is_expert",
                      "mark_expert"], "moefold.moe.experts"),
    **dict.fromkeys(["check_gemm_backend", "grouped_gemm"], "moefold.moe.gemm"),
    "GemmBackend": "moefold.moe.gemm_backend",
    **dict.fromkeys(["MoEDispatchStart", "MoEExpertsOut", "MoELayer", "MoEOutputInfo", "MoERegions"],
                    "moefold.moe.layer"),
    **dict.fromkeys(["Router", "RouterGroups", "RouterOutput"], "moefold.moe.router"),
    **dict.fromkeys(["DROP_POLICIES", "LOAD_BALANCING_TYPES", "ROUTER_DTYPES", "SCORE_FUNCTIONS", "RouterConfig"],
                    "moefold.moe.router_config"),
    "RouterStats": "moefold.moe.router_stats",
    **dict.fromkeys(["LIVE_ROUTING", "RoutingRecorder", "RoutingReplayer", "RoutingTap"], "moefold.moe.routing_replay"),
    "SharedExperts": "moefold.moe.shared_experts",
    "SplitGroupedGemm": "moefold.moe.split_gemm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # router and load balancing
    "Router", "RouterGroups", "RouterOutput", "RouterConfig", "Routing", "RouterStats", "GlobalLoadState",
    "update_expert_bias", "bias_update", "expert_capacity",
    "SCORE_FUNCTIONS", "LOAD_BALANCING_TYPES", "DROP_POLICIES", "ROUTER_DTYPES",
    # routing replay (record a forward's expert choices, replay them)
    "RoutingTap", "RoutingRecorder", "RoutingReplayer", "LIVE_ROUTING",
    # configs and the builder
    "MoEConfig", "ExpertsConfig", "SharedExpertsConfig", "build_moe_layer", "build_experts", "build_expert_gemm",
    # experts and the layer
    "GroupedExperts", "SharedExperts", "MoELayer", "MoEOutputInfo", "MoEDispatchStart", "MoEExpertsOut",
    "SplitGroupedGemm", "ExpertActivation", "GatedActivation", "fused_activation", "mark_expert", "is_expert",
    "default_output_init_std",
    "ExpertGemm", "GemmCall", "Projection", "GemmBackend", "grouped_gemm", "check_gemm_backend",
    # what the execution pass installs through configure
    "MoERegions", "ExpertsRegions", "WeightGrads", "ActivationKernel", "BACKEND_ACTIVATION", "COMPILED_ACTIVATION",
]
