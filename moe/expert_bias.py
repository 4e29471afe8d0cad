"""Aux-loss-free load balancing: the per-expert selection bias and its update.

Wang et al. 2024 ("Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"), used
by DeepSeek-V3: after each optimizer step,

    bias_e += rate * sign(mean_load - load_e)

with ``load`` the tokens each expert was selected for during the step, summed over every
micro-batch (by the trainer) and over the tp x cp x dp group (here). The bias only shifts
*selection*; combine weights come from the unbiased scores. Optional mean-centring subtracts
the mean of each update so the bias stays centred (the selection is invariant to a common
shift, but an uncentred bias drifts when E is odd or loads tie).

The bias lives on the router as the fp32 buffer ``expert_bias`` (checkpointed model state).
The update is a stateless function; it is identical on every rank because it is a function
of the all-reduced counts and of the bias, which starts identical.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moefold.parallel.comm import all_reduce_sum
from moefold.parallel.groups import Group


def bias_update(tokens_per_expert_E: Tensor, rate: float, center: bool = False) -> Tensor:
    """The additive update [E] fp32 for global loads ``tokens_per_expert_E`` (no communication)."""
    load_E = tokens_per_expert_E.to(torch.float32)
    delta_E = torch.sign(load_E.mean() - load_E) * rate
    if center:
        delta_E = delta_E - delta_E.mean()
    return delta_E


@torch.no_grad()
def update_expert_bias(router: nn.Module, tokens_per_expert_E: Tensor, group: Group, rate: float | None = None,
                       center: bool | None = None) -> Tensor:
    """Update ``router.expert_bias`` in place after an optimizer step; returns the global loads.

    tokens_per_expert_E: [E] this rank's selection counts summed over the step's micro-batches
                         (``RouterOutput.load_E``); all-reduced here over ``group`` (tp x cp x dp).
    rate / center:       default to the router config's bias_update_rate / bias_update_center.
    Collective over ``group``.
    """
    bias = getattr(router, "expert_bias", None)
    if bias is None:
        raise ValueError("update_expert_bias: the router has no expert_bias buffer "
                         "(RouterConfig.enable_expert_bias=False)")
    config = getattr(router, "config", None)
    rate = config.bias_update_rate if rate is None else rate
    center = config.bias_update_center if center is None else center
    if not rate >= 0:
        raise ValueError(f"update_expert_bias: rate={rate} must be >= 0")
    if tokens_per_expert_E.shape != bias.shape:
        raise ValueError(f"update_expert_bias: tokens_per_expert_E has shape {tuple(tokens_per_expert_E.shape)}, "
                         f"expected {tuple(bias.shape)}")
    load_E = all_reduce_sum(tokens_per_expert_E.to(device=bias.device, dtype=torch.float32), group)
    new_bias = bias.to(torch.float32) + bias_update(load_E, rate, center)
    if bias.dtype != torch.float32:  # a model-wide .to(bf16) cast the buffer; keep selection exact
        router.expert_bias = new_bias
    else:
        bias.copy_(new_bias)
    return load_E
