"""Expert capacity and token dropping (GShard / Switch Transformer capacity factor).

Capacity is per expert and per rank: ``ceil(T * K / E * factor)`` for this rank's T tokens
(as Megatron-Core's ``get_capacity``). Local only; nothing crosses ranks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert capacity ``ceil(num_tokens * topk / num_experts * capacity_factor)``."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep_mask(probs_TK: Tensor, expert_ids_TK: Tensor, num_experts: int, capacity: int,
                       policy: str) -> Tensor:
    """bool [T, K]: which routed copies fit in their expert's ``capacity``.

    ``probs``: each expert keeps its ``capacity`` highest-probability copies (ties: earlier
    token first). ``position``: each expert keeps the earliest ``capacity`` copies in token
    order (then slot order). Deterministic: stable sorts instead of topk over a 0/1 map.
    """
    T, K = expert_ids_TK.shape
    ids_N = expert_ids_TK.reshape(-1)
    n = ids_N.numel()
    if policy == "probs":
        order = torch.sort(probs_TK.detach().reshape(-1), descending=True, stable=True).indices
    elif policy == "position":
        order = torch.arange(n, device=ids_N.device)
    else:
        raise ValueError(f"token drop policy={policy!r}; valid: probs, position")
    # stable sort by expert keeps the policy's priority order inside each expert's run
    by_expert = order[torch.sort(ids_N[order], stable=True).indices]
    sorted_ids = ids_N[by_expert]
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).scatter_add_(
        0, ids_N, torch.ones_like(ids_N))
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.arange(n, device=ids_N.device) - starts_E[sorted_ids]
    keep_N = torch.empty(n, dtype=torch.bool, device=ids_N.device)
    keep_N[by_expert] = rank_in_expert < capacity
    return keep_N.view(T, K)
