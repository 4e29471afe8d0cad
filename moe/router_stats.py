"""Per-layer load-balance diagnostics of one router call (feed training logs and the load report).

Every field is a tensor on the router's device (0-dim unless noted), so computing them never
waits for the host; read them (``.item()`` / ``as_dict()``) on logging steps only. By default
they describe this rank's tokens; with ``reduce=True`` the counts are summed over the balancing
group first (one all-reduce of [2E + 2] values), so every rank reports the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.parallel.comm import all_reduce_sum
from moefold.parallel.groups import Group


@dataclass(frozen=True)
class RouterStats:
    """Load-balance statistics of one micro-batch for one layer.

    tokens_per_expert_E: fp32 [E] routed copies that selected each expert (before capacity)
    max_over_mean:       max_e load / mean_e load (1 is perfect balance)
    cv:                  coefficient of variation of the loads (population std / mean)
    dropped_fraction:    share of routed copies dropped by capacity (0 when dropless)
    entropy:             mean over tokens of the router entropy -sum_e p_te log p_te (nats)
    num_empty_experts:   experts that no token selected
    bias_min, bias_max:  expert-bias range (0 without expert bias)
    reduced:             True when summed over the balancing group
    """

    tokens_per_expert_E: Tensor
    max_over_mean: Tensor
    cv: Tensor
    dropped_fraction: Tensor
    entropy: Tensor
    num_empty_experts: Tensor
    bias_min: Tensor
    bias_max: Tensor
    reduced: bool = False

    def as_dict(self) -> dict[str, float]:
        """Host floats for logging (synchronises: logging steps only)."""
        return {name: float(getattr(self, name)) for name in
                ("max_over_mean", "cv", "dropped_fraction", "entropy", "num_empty_experts", "bias_min", "bias_max")}


def router_entropy_sum(aux_probs_TE: Tensor) -> Tensor:
    """Sum over tokens of -sum_e p log p (0 log 0 = 0)."""
    p = aux_probs_TE.detach().to(torch.float32)
    return -(p * torch.log(p.clamp(min=1e-30))).sum()


def compute_router_stats(selected_E: Tensor, kept_E: Tensor, entropy_sum: Tensor, num_tokens: int,
                         expert_bias_E: Tensor | None, group: Group = None, reduce: bool = False) -> RouterStats:
    """Statistics from this rank's counts; summed over ``group`` first when ``reduce``.

    selected_E: [E] copies that selected each expert; kept_E: [E] copies kept after capacity;
    entropy_sum: summed token entropies; num_tokens: this rank's T.
    Collective over ``group`` only when ``reduce`` is True.
    """
    E = selected_E.shape[0]
    packed = torch.cat([selected_E.to(torch.float32), kept_E.to(torch.float32),
                        entropy_sum.reshape(1).to(torch.float32),
                        torch.full((1,), float(num_tokens), device=selected_E.device)])  # a fill, not a copy
    if reduce:
        packed = all_reduce_sum(packed, group)
    load_E, kept, ent, tokens = packed[:E], packed[E:2 * E], packed[2 * E], packed[2 * E + 1]
    mean = load_E.mean().clamp(min=1e-12)
    total = load_E.sum().clamp(min=1e-12)
    if expert_bias_E is None:
        bias_min = bias_max = torch.zeros((), device=selected_E.device)
    else:
        bias_min, bias_max = expert_bias_E.detach().min().float(), expert_bias_E.detach().max().float()
    return RouterStats(
        tokens_per_expert_E=load_E,
        max_over_mean=load_E.max() / mean,
        cv=load_E.std(unbiased=False) / mean,
        dropped_fraction=(load_E.sum() - kept.sum()) / total,
        entropy=ent / tokens.clamp(min=1),
        num_empty_experts=(load_E == 0).sum(),
        bias_min=bias_min, bias_max=bias_max, reduced=reduce,
    )
