"""Mixture-of-experts: router, load balancing, grouped experts, shared experts, the MoE layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.capacity import expert_capacity
from moefold.moe.config import MoEConfig
from moefold.moe.expert_bias import bias_update, update_expert_bias
from moefold.moe.experts import ACTIVATIONS, GroupedExperts, default_output_init_std, is_expert, mark_expert
from moefold.moe.gemm import GEMM_BACKENDS, check_gemm_backend, grouped_gemm
from moefold.moe.router import Router, RouterGroups, RouterOutput
from moefold.moe.router_config import DROP_POLICIES, LOAD_BALANCING_TYPES, ROUTER_DTYPES, SCORE_FUNCTIONS, RouterConfig
from moefold.moe.router_stats import RouterStats
from moefold.moe.routing import Routing
from moefold.moe.shared_experts import SharedExperts

if TYPE_CHECKING:
    from moefold.moe.layer import MoELayer, MoEOutputInfo

# moe.layer imports dispatch, and dispatch imports moe.routing: importing moe.layer here would make
# `import dispatch` in a fresh process fail half-way through. These two load on first use instead.
_LAZY = {"MoELayer": "moefold.moe.layer", "MoEOutputInfo": "moefold.moe.layer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe' has no attribute {name!r}")


__all__ = [
    # router and load balancing
    "Router", "RouterGroups", "RouterOutput", "RouterConfig", "Routing", "RouterStats", "GlobalLoadState",
    "update_expert_bias", "bias_update", "expert_capacity",
    "SCORE_FUNCTIONS", "LOAD_BALANCING_TYPES", "DROP_POLICIES", "ROUTER_DTYPES",
    # experts and the layer
    "MoEConfig", "GroupedExperts", "SharedExperts", "MoELayer", "MoEOutputInfo",
    "ACTIVATIONS", "mark_expert", "is_expert", "default_output_init_std",
    "GEMM_BACKENDS", "grouped_gemm", "check_gemm_backend",
]
