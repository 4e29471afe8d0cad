"""Expert capacity and token dropping: per expert (GShard / Switch Transformer capacity factor) and per
expert-parallel rank (Megatron's ``--moe-expert-rank-capacity-factor``).

Expert capacity is per expert and per rank: ``ceil(T * K / E * factor)`` for this rank's T tokens (as
Megatron-Core's ``get_capacity``). Local only; nothing crosses ranks.

Rank capacity (``rank_capacity_keep_mask``) bounds what each expert-parallel rank receives: its *share* is the
dispatch group's routed copies / ep (what it receives under balanced routing), its budget ``floor(C x share)``.
The ranks of the dispatch group (etp x ep: everyone sending to the same expert instances) all-gather their
per-expert counts (one ``[E]`` int64 per rank, on the device: no host synchronisation); a destination whose load
is within budget keeps everything; one above it keeps from each source ``floor(sent x budget / load)`` copies, the
source's best by the drop policy. So copies are dropped only above C x the share, every rank computes the same
quotas, and no destination receives more than its budget.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moefold.moe.router_config import DropPolicy
from moefold.parallel.comm import all_gather_single
from moefold.parallel.groups import Group, group_rank, group_size


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert capacity ``ceil(num_tokens * topk / num_experts * capacity_factor)``."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep_mask(probs_TK: Tensor, expert_ids_TK: Tensor, num_experts: int, capacity: int | Tensor,
                       policy: DropPolicy) -> Tensor:
    """bool [T, K]: which routed copies fit in their expert's ``capacity`` (one int, or int64 [num_experts]: each
    expert's own; ``expert_ids_TK`` may be any grouping of the copies, e.g. their destination rank).

    ``probs``: each expert keeps its ``capacity`` highest-probability copies (ties: earlier
    token first). ``position``: each expert keeps the earliest ``capacity`` copies in token
    order (then slot order). Deterministic: stable sorts instead of topk over a 0/1 map.
    """
    T, K = expert_ids_TK.shape
    ids_N = expert_ids_TK.reshape(-1)
    n = ids_N.numel()
    if DropPolicy(policy) is DropPolicy.PROBS:   # a DropPolicy (RouterConfig's), or its word
        order = torch.sort(probs_TK.detach().reshape(-1), descending=True, stable=True).indices
    else:
        order = torch.arange(n, device=ids_N.device)
    # stable sort by expert keeps the policy's priority order inside each expert's run
    by_expert = order[torch.sort(ids_N[order], stable=True).indices]
    sorted_ids = ids_N[by_expert]
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).scatter_add_(
        0, ids_N, torch.ones_like(ids_N))
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.arange(n, device=ids_N.device) - starts_E[sorted_ids]
    keep_N = torch.empty(n, dtype=torch.bool, device=ids_N.device)
    limit = capacity[sorted_ids] if isinstance(capacity, Tensor) else capacity
    keep_N[by_expert] = rank_in_expert < limit
    return keep_N.view(T, K)


def rank_capacity_keep_mask(probs_TK: Tensor, expert_ids_TK: Tensor, sent_E: Tensor, num_experts: int, ep: int,
                            factor: float, policy: DropPolicy, group: Group, keep_TK: Tensor | None = None) -> Tensor:
    """bool [T, K]: which of this rank's copies its destination's rank capacity keeps (module docstring).

    ``sent_E``: this rank's copies per expert (those ``keep_TK`` kept, if given); ``group``: the dispatch group
    (etp x ep; None alone); experts ``[d * E/ep, (d+1) * E/ep)`` live on expert-parallel rank ``d``.
    Collective over ``group`` (an all-gather of ``[E]`` counts)."""
    if not factor > 0:
        raise ValueError(f"--moe-expert-rank-capacity-factor={factor} must be > 0")
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}")
    sent_E = sent_E.to(torch.int64)
    n = group_size(group)
    counts_nE = sent_E.new_empty(n * num_experts)
    if n > 1:
        all_gather_single(counts_nE, sent_E.contiguous(), group)
    else:
        counts_nE.copy_(sent_E)
    counts_nE = counts_nE.view(n, num_experts)
    per_dest_nd = counts_nE.view(n, ep, num_experts // ep).sum(-1)     # copies each source sends each rank
    load_d = per_dest_nd.sum(0)
    budget = torch.floor(per_dest_nd.sum().double() * factor / ep).long()
    mine_d = per_dest_nd[group_rank(group)]
    quota_d = torch.where(load_d <= budget, mine_d, mine_d * budget // load_d.clamp(min=1))
    dest_TK = expert_ids_TK // (num_experts // ep)
    if keep_TK is not None:   # copies already dropped compete for nothing: an extra destination of capacity 0
        dest_TK = torch.where(keep_TK, dest_TK, torch.full_like(dest_TK, ep))
        quota_d = torch.cat([quota_d, quota_d.new_zeros(1)])
    return capacity_keep_mask(probs_TK, dest_TK, quota_d.numel(), quota_d, policy)
