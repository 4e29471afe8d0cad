"""THE ONE PLACE that still switches the MoE modules' features by their attributes and methods.

Every dense layer takes its regions and GEMMs through its own ``configure(...)`` (``dense.regions``); the MoE
modules (``moe.layer.MoELayer``, ``moe.experts.GroupedExperts``) are being restructured on another branch and
still expose the old switches, so the execution pass reaches them only through the functions below. When those
classes take regions (``MoELayer.configure(shared_experts=Region)``, ``GroupedExperts.configure(fc1=Region,
act=OutputRegion)``) and their GEMM strategies (``GroupedExperts.configure(gemm=...)`` or methods of their expert
backend) this module goes, and its callers call ``configure``.

What is set here, and by which feature:

=========================================== ============================== =====================================
attribute / method                          of                             feature (module)
=========================================== ============================== =====================================
``recompute_shared_experts`` (bool)         ``MoELayer``                   selective recompute (``recompute``)
``offload_shared_experts`` (context)        ``MoELayer``                   activation offload (``activation_offload``)
``recompute_activation`` (bool)             ``GroupedExperts``             selective recompute ``moe_act``
``offload_expert_fc1``, ``offload_moe_act`` ``GroupedExperts``             activation offload
``use_weight_grad_store(store)``            ``GroupedExperts``             split backward (``split_backward``)
``use_grad_accumulation_fusion(enabled)``   ``GroupedExperts``             gradient-accumulation fusion
``use_fused_activation()``                  ``GroupedExperts``             compile (``compile``)
=========================================== ============================== =====================================
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn

from moefold.dense.split_backward import WeightGradStore
from moefold.moe.experts import GroupedExperts
from moefold.moe.layer import MoELayer

# offload module name -> the attribute of the MoE class that holds its region
MOE_OFFLOAD_ATTRS: dict[type, dict[str, str]] = {
    GroupedExperts: {"expert_fc1": "offload_expert_fc1", "moe_act": "offload_moe_act"},
    MoELayer: {"shared_experts": "offload_shared_experts"},
}


def moe_set_recompute(module: nn.Module, chosen: frozenset[str]) -> None:
    """Selective recompute of an MoE layer's shared experts and its routed experts' activation (``chosen``: the
    recompute module names in force); nothing for another module."""
    if isinstance(module, MoELayer):
        module.recompute_shared_experts = "shared_experts" in chosen
        module.experts.recompute_activation = "moe_act" in chosen


def moe_offload_names(module: nn.Module) -> dict[str, str]:
    """{offload module name: attribute} of an MoE module ({} for another module)."""
    return MOE_OFFLOAD_ATTRS.get(type(module), {})


def moe_set_offload(module: nn.Module, name: str, region: AbstractContextManager) -> None:
    """Run the MoE module's part ``name`` (one of ``moe_offload_names(module)``) in ``region``."""
    setattr(module, moe_offload_names(module)[name], region)


def moe_offload_region(module: nn.Module, name: str) -> object:
    """The region the MoE module's part ``name`` runs in."""
    return getattr(module, moe_offload_names(module)[name])


def moe_use_weight_grad_store(module: nn.Module, store: WeightGradStore) -> bool:
    """Split backward for the routed experts (ValueError for the TE backend); False for another module."""
    if not isinstance(module, GroupedExperts):
        return False
    module.use_weight_grad_store(store)
    return True


def moe_use_grad_accumulation_fusion(module: nn.Module, enabled: bool) -> bool:
    """Gradient-accumulation fusion for the routed experts; whether they fuse (False for another module)."""
    return isinstance(module, GroupedExperts) and module.use_grad_accumulation_fusion(enabled)


def moe_use_fused_activation(experts: GroupedExperts) -> None:
    """The routed experts' activation as one compiled kernel per direction (``--compile``)."""
    experts.use_fused_activation()


__all__ = ["moe_offload_names", "moe_offload_region", "moe_set_offload", "moe_set_recompute",
           "moe_use_fused_activation", "moe_use_grad_accumulation_fusion", "moe_use_weight_grad_store"]
