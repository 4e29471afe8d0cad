"""Quantile balancing (QB): top-k selection against a per-expert bias that is each expert's load quantile.

Megatron-Core 0.19's ``--moe-router-load-balancing-type quantile_balancing`` (``moe_utils.qb_dual_update``,
``TopKRouter.quantile_balancing``, ``finalize_model_grads._update_router_qb_beta``). One step of a dual
coordinate descent on the assignment problem "each token picks k experts, each expert takes T*k/E tokens":

    selection    ids_TK = top-k of (logits_TE - beta_E)                     (beta: the previous step's bias)
    token price  alpha_T = the (k+1)-th largest of (logits_TE - beta_E)    (what a token's next choice is worth)
    expert price q_E = the (T*k/E + 1)-th largest over tokens of (logits_TE - alpha_T)

``q_E`` is the bias that would give each expert exactly its share of this micro-batch. Each micro-batch adds
its ``q`` to the router's ``qb_beta_accum`` (and 1 to ``qb_beta_count``); once per global batch
``update_quantile_biases`` averages them over the step's micro-batches and the data-parallel ranks and sets

    beta = ema * beta + (1 - ema) * mean(q);    beta -= mean_E(beta)    (re-centred: selection ignores a shift)

Load balance comes from the bias alone: no loss, no gradient. The combine weights are the score function's
values at the selected ids (``moe.scoring.combine_weights``), so the router still learns from the LM loss.
The quantile uses the raw logits in fp32 (as Megatron does), whatever the score function.

What crosses ranks: the router all-gathers its logits [T, E] over tp x cp (no autograd) so that the quantile
sees the micro-batch's whole sequences; the step's update all-reduces [E + 1] per router over tp x cp x dp.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from moefold.parallel.comm import all_gather_single, all_reduce_sum
from moefold.parallel.groups import Group, group_rank, group_size


def qb_select(logits_TE: Tensor, topk: int, beta_E: Tensor) -> tuple[Tensor, Tensor]:
    """(ids [T, K] int64, alpha [T, 1]): the top-k of ``logits - beta`` and each token's (k+1)-th value.

    ``logits_TE`` fp32 [T, E]; ``beta_E`` fp32 [E]. With k = E there is no (k+1)-th expert: alpha is then -inf
    (every expert is chosen whatever its price)."""
    shifted = logits_TE - beta_E
    E = logits_TE.shape[1]
    if topk == E:
        ids = shifted.topk(topk, dim=1).indices
        return ids, torch.full_like(shifted[:, :1], float("-inf"))
    top = shifted.topk(topk + 1, dim=1)
    return top.indices[:, :-1], top.values[:, -1:]


def expert_quantile(logits_TE: Tensor, alpha_T1: Tensor, topk: int) -> Tensor:
    """fp32 [E]: each expert's (T*k/E + 1)-th largest ``logits - alpha`` over the T tokens.

    Raises ValueError when T*k is not a multiple of E (the share T*k/E must be whole, as Megatron asserts)."""
    T, E = logits_TE.shape
    if (T * topk) % E:
        raise ValueError(f"quantile balancing: {T} tokens x top-{topk} = {T * topk} routed copies are not a "
                         f"multiple of num_experts={E}; choose a micro-batch (x sequence length) for which they are")
    share = T * topk // E
    return (logits_TE - alpha_T1).topk(min(share + 1, T), dim=0).values[-1].contiguous()


@torch.no_grad()
def quantile_route(logits_TE: Tensor, topk: int, beta_E: Tensor, group: Group,
                   update: bool) -> tuple[Tensor, Tensor | None]:
    """(this rank's ids [T, K], the micro-batch's quantile [E] or None when not ``update``).

    ``logits_TE``: this rank's logits [T, E] (any float dtype; used in fp32, detached). ``group``: tp x cp, the
    ranks holding the same sequences (all-gathered in rank order, equal T on every rank). The quantile is a
    column statistic and the selection is per row, so the gather's order does not change either."""
    logits = logits_TE.detach().to(torch.float32)
    n = group_size(group)
    full = logits
    if n > 1:
        full = torch.empty((logits.shape[0] * n, logits.shape[1]), dtype=logits.dtype, device=logits.device)
        all_gather_single(full, logits.contiguous(), group)
    ids, alpha = qb_select(full, topk, beta_E.to(torch.float32))
    quantile = expert_quantile(full, alpha, topk) if update else None
    if n > 1:
        T = logits.shape[0]
        ids = ids[group_rank(group) * T:(group_rank(group) + 1) * T].contiguous()
    return ids, quantile


@torch.no_grad()
def update_quantile_biases(routers: Iterable[nn.Module], group: Group) -> None:
    """Once per global batch: each router's ``qb_beta`` from the quantiles its micro-batches accumulated.

    ``routers``: this rank's routers with quantile balancing (their ``qb_beta``, ``qb_beta_accum``,
    ``qb_beta_count`` buffers); ``group``: tp x cp x dp, every rank that saw different tokens of the step (the
    routers of one pipeline stage are the same on all of them). One all-reduce of [n_routers, E + 1]; each bias
    keeps its router config's ``quantile_balancing_ema`` of the last one. Resets the accumulators."""
    routers = list(routers)
    if not routers:
        return
    packed = torch.stack([torch.cat([r.qb_beta_accum.to(torch.float32), r.qb_beta_count.to(torch.float32)[None]])
                          for r in routers])
    packed = all_reduce_sum(packed, group)
    for r, row in zip(routers, packed):
        decay = r.config.quantile_balancing_ema
        mean_q = row[:-1] / row[-1].clamp(min=1.0)
        beta = decay * r.qb_beta.to(torch.float32) + (1.0 - decay) * mean_q
        beta = beta - beta.mean()
        # a step whose router never ran in training mode keeps its bias (torch.where: no host sync)
        beta = torch.where(row[-1] > 0, beta, r.qb_beta.to(torch.float32))
        if r.qb_beta.dtype != torch.float32:   # a model-wide .to(bf16) cast the buffer; keep the bias exact
            r.qb_beta = beta
        else:
            r.qb_beta.copy_(beta)
        r.qb_beta_accum.zero_()
        r.qb_beta_count.zero_()
