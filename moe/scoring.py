"""Router scores and top-k selection (plain, group-limited, biased, forced-uniform).

All functions are pure and local to this rank's tokens: nothing here crosses ranks.

One path covers every score function. ``scores_TE`` is the distribution over all experts
(softmax of the logits, or the sigmoid of the logits); selection ranks ``scores_TE + bias``
(optionally group-limited); the combine weights are the *unbiased* scores of the selected
experts, renormalised over the k when ``norm_topk_prob`` and multiplied by the scaling factor.
Post-top-k softmax (Mixtral: softmax over the k selected logits) is exactly this path with
renormalisation, because softmax is monotonic and softmax(l_sel) = p_sel / sum(p_sel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moefold.moe.router_config import RouterConfig, RouterDtype, ScoreFunction

_NORM_EPS = 1e-20  # as DeepSeek-V3 / HF / Megatron: guards a sum of k sigmoids underflowing to 0


def router_dtype(config: RouterConfig) -> torch.dtype:
    """The dtype the router computes in (``--moe-router-dtype``: fp32 by default, or fp64), whatever the model's.

    An fp32 island of the bf16 path: the gating GEMM, the scores, the top-k selection and the combine
    weights all run in it, and ``Routing.probs_TK`` stays fp32 into the combine. Megatron-Core 0.16.1 does the
    same with ``moe_router_dtype="fp32"`` (``RouterGatingLinearFunction``: ``inp.to(router_dtype) @
    weight.to(router_dtype).t()``, then softmax/sigmoid and top-k on those logits). HF's Mixtral and Qwen3-MoE
    routers run their GEMM in the model dtype (only the softmax in fp32); its DeepSeek-V3 router in fp32.
    """
    return torch.float64 if config.router_dtype is RouterDtype.FP64 else torch.float32


class _GatingLinear(torch.autograd.Function):
    """``x @ W^T (+ b)`` in ``dtype``, keeping ``x`` for the backward in its own dtype and casting it again there,
    as Megatron-Core's ``RouterGatingLinearFunction`` does (``moe/moe_utils.py``: the cast inside,
    ``ctx.save_for_backward(inp, weight, bias)``): autograd through ``x.to(dtype)`` would keep an fp32 copy of a
    bf16 input (the router's input is the norm output, which the experts' dispatch holds anyway). The backward
    runs autograd's own formulas for ``linear`` (``addmm``/``mm``: ``g @ W``, ``g^T @ x``, ``sum(g)``), so the
    gradients are bit for bit autograd's."""

    @staticmethod
    def forward(ctx, x_TH: Tensor, weight_EH: Tensor, bias_E: Tensor | None, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x_TH, weight_EH, bias_E)
        ctx.dtype = dtype
        return torch.nn.functional.linear(x_TH.to(dtype), weight_EH.to(dtype),
                                          None if bias_E is None else bias_E.to(dtype))

    @staticmethod
    def backward(ctx, g_TE: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x_TH, weight_EH, bias_E = ctx.saved_tensors
        dtype = ctx.dtype
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = g_TE.mm(weight_EH.to(dtype)).to(x_TH.dtype)
        if ctx.needs_input_grad[1]:
            dw = g_TE.t().mm(x_TH.to(dtype)).to(weight_EH.dtype)
        if bias_E is not None and ctx.needs_input_grad[2]:
            db = g_TE.sum(0).to(bias_E.dtype)
        return dx, dw, db, None


def gating_logits(x_TH: Tensor, weight_EH: Tensor, dtype: torch.dtype, bias_E: Tensor | None = None) -> Tensor:
    """logits [T, E] = x @ W^T (+ b, GPT-OSS's router bias) computed in ``dtype`` (``router_dtype``: fp32/fp64)
    whatever the model dtype; ``x_TH`` [T, H] is kept for the backward as it is (``_GatingLinear``)."""
    return _GatingLinear.apply(x_TH, weight_EH, bias_E, dtype)


_SCORES = {
    ScoreFunction.SOFTMAX: lambda logits_TE: torch.softmax(logits_TE, dim=-1),
    ScoreFunction.SIGMOID: torch.sigmoid,
    ScoreFunction.SQRTSOFTPLUS: lambda logits_TE: torch.nn.functional.softplus(logits_TE).sqrt(),
}


def score_all(logits_TE: Tensor, score_function: ScoreFunction) -> Tensor:
    """Scores over all experts [T, E]: softmax (sums to 1), element-wise sigmoid, or element-wise
    sqrt(softplus(l)) (Megatron-Core 0.18's ``sqrtsoftplus``: positive, unbounded, ~sqrt(l) for large l)."""
    return _SCORES[ScoreFunction(score_function)](logits_TE)


def scores_for_aux_loss(scores_TE: Tensor, score_function: ScoreFunction) -> Tensor:
    """Per-token distribution over experts used by the balance losses (rows sum to 1).

    Softmax scores already sum to 1; sigmoid and sqrtsoftplus scores are normalised (DeepSeek-V3's s'_{i,t}).
    """
    if ScoreFunction(score_function) is not ScoreFunction.SOFTMAX:
        return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + _NORM_EPS)
    return scores_TE


def group_limited_mask(sel_TE: Tensor, num_groups: int, group_topk: int, group_score_topk: int) -> Tensor:
    """[T, E] bool: experts in each token's ``group_topk`` best groups.

    Experts are split into ``num_groups`` contiguous groups; a group's score is the sum of its
    ``group_score_topk`` highest selection scores (DeepSeek-V3 / HF DeepseekV3TopkRouter).
    """
    T, E = sel_TE.shape
    grouped = sel_TE.view(T, num_groups, E // num_groups)
    group_scores_TG = grouped.topk(group_score_topk, dim=-1).values.sum(dim=-1)
    group_idx = group_scores_TG.topk(group_topk, dim=-1, sorted=False).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask_TG.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)


def select_topk(scores_TE: Tensor, config: RouterConfig, expert_bias_E: Tensor | None = None) -> Tensor:
    """Expert ids [T, K] (int64): top-k of ``scores + bias`` (group-limited if configured)."""
    sel = scores_TE.detach()
    if expert_bias_E is not None:
        sel = sel + expert_bias_E.to(sel.dtype)
    if config.num_groups is not None:
        mask = group_limited_mask(sel, config.num_groups, config.group_topk, config.resolved_group_score_topk)
        sel = sel.masked_fill(~mask, float("-inf"))
    return sel.topk(config.topk, dim=-1).indices


def forced_uniform_ids(num_tokens: int, topk: int, num_experts: int, device: torch.device) -> Tensor:
    """Round-robin expert ids [T, K]: token t gets experts (t*K + j) mod E, j < K.

    Each expert receives floor or ceil of T*K/E copies, and a token's K experts are distinct
    (K consecutive residues, K <= E). Deterministic, unlike Megatron's random logits.
    """
    t = torch.arange(num_tokens, device=device).unsqueeze(1)
    j = torch.arange(topk, device=device).unsqueeze(0)
    return (t * topk + j) % num_experts


def combine_weights(scores_TE: Tensor, expert_ids_TK: Tensor, config: RouterConfig) -> Tensor:
    """Combine weights [T, K] from the unbiased scores of the selected experts (differentiable)."""
    probs_TK = scores_TE.gather(1, expert_ids_TK)
    if config.resolved_norm_topk_prob:
        probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + _NORM_EPS)
    if config.topk_scaling_factor is not None:
        probs_TK = probs_TK * config.topk_scaling_factor
    return probs_TK


def route_scores(logits_TE: Tensor, config: RouterConfig, expert_bias_E: Tensor | None = None,
                 ids_TK: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """From logits [T, E] to (scores_TE, expert_ids_TK, probs_TK) before any capacity drop.

    ``ids_TK``: int64 [T, K] ids chosen elsewhere: by an earlier forward (routing replay, ``moe.routing_replay``)
    or by quantile balancing (``moe.quantile_balancing``). They replace the selection (bias, group limit and
    forced balancing play no part) and the combine weights are the current scores at those ids, as Megatron-Core's
    ``RouterReplay.get_replay_topk`` and ``precomputed_indices`` (``scores.gather``)."""
    scores_TE = score_all(logits_TE, config.score_function)
    if ids_TK is None and config.force_load_balancing:
        ids_TK = forced_uniform_ids(logits_TE.shape[0], config.topk, config.num_experts, logits_TE.device)
    elif ids_TK is None:
        ids_TK = select_topk(scores_TE, config, expert_bias_E)
    return scores_TE, ids_TK, combine_weights(scores_TE, ids_TK, config)


def count_per_expert(expert_ids_TK: Tensor, num_experts: int, keep_TK: Tensor | None = None) -> Tensor:
    """int64 [E]: copies routed to each expert (only kept copies when ``keep_TK`` is given)."""
    ids = expert_ids_TK.reshape(-1)
    # scatter_add rather than bincount: bincount reads max(ids) back to the host on GPUs
    ones = torch.ones_like(ids) if keep_TK is None else keep_TK.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, ones)
