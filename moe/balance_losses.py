"""Load-balancing losses and the router z-loss, each as this rank's *share*.

Loss convention (the same as the LM loss): a micro-batch's loss is the SUM of the shares of the
ranks that hold pieces of its sequences (the tp x cp group: sequence-parallel and context-parallel
shards), so gradients are summed over tp (the router weight is marked sequence-parallel) and cp;
the trainer then AVERAGES micro-batch losses over dp ranks and over the micro-batches of a step.
Under that convention every loss below has the same value and gradient whatever the tp/cp/dp
split (tested against world 1).

Notation: T_g = tokens of the micro-batch over the tp x cp group (T_local * |tp_cp|, the shards
are equal under SP and CP), E experts, k = topk, p_te the per-token distribution over all experts
(softmax, or sigmoid normalised over E), c_e the number of copies that select expert e in a plain top-k
of the scores (before any capacity drop, without expert bias and group limit: Megatron-Core's counts and the
DeepSeek-V3 report's indicator; ``RouterConfig.aux_loss_counts="dispatched"`` counts the dispatched selection,
with group limits and expert bias, instead).

- aux_loss (Switch Transformer eq. 4-6, GShard; Megatron-Core's form for top-k):
      L = E * sum_e f_e P_e,  f_e = c_e / (k T_g),  P_e = (1/T_g) sum_t p_te
  c_e is reduced over tp x cp; the share sums p over local tokens only.
- seq_aux_loss (DeepSeek-V3 eq. 17-20), per sequence s of length L_s, averaged over sequences:
      L = (1/B) sum_s sum_e f_se P_se,  f_se = E c_se / (k L_s),  P_se = (1/L_s) sum_{t in s} p_te
  c_se and L_s are reduced over tp x cp.
- global_aux_loss (Qwen "Demons in the detail", global-batch balance): aux_loss with c_e
  replaced by the running mean over this step's micro-batches of the counts reduced over
  tp x cp x dp (see GlobalLoadState): at micro-batch m (1-based) f_e = cbar_e / (k Tbar) with
  cbar = (C_1 + ... + C_m) / m and Tbar = sum_e cbar_e / k. P_e stays local to the micro-batch
  (normalised by T_g, not by the tp x cp x dp token count, so the dp average of the shares is the
  world-1 value).
- z_loss (ST-MoE eq. 5):  L = (1/T_g) sum_t (logsumexp_e logits_te)^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.parallel.comm import all_reduce_sum
from moefold.parallel.groups import Group


@dataclass(frozen=True)
class GlobalLoadState:
    """Explicit state of the global-batch loss across the micro-batches of one step, per layer.

    counts_E:          fp64 [E], sum over the micro-batches seen so far of the selection counts
                       reduced over tp x cp x dp (identical on every rank)
    num_micro_batches: how many micro-batches ``counts_E`` sums

    Pass None for the first micro-batch of a step; pass the state returned with micro-batch m
    into micro-batch m+1 of the same layer; drop it after the step. Activation recompute must
    pass the same input state again (the function is pure, so that is safe).
    """

    counts_E: Tensor
    num_micro_batches: int

    def add(self, counts_E: Tensor) -> GlobalLoadState:
        return GlobalLoadState(self.counts_E + counts_E.to(self.counts_E.dtype), self.num_micro_batches + 1)


def switch_aux_loss(aux_probs_TE: Tensor, counts_E: Tensor, num_tokens: float, topk: int) -> Tensor:
    """Share of ``E * sum_e f_e P_e`` with ``f_e = counts_e / (k T)``, ``P_e = sum_local p_te / T``.

    aux_probs_TE: [T_local, E] per-token distribution (differentiable)
    counts_E:     [E] selection counts over the tokens the loss is about (already reduced)
    num_tokens:   T, the number of tokens ``counts_E`` counts
    """
    E = aux_probs_TE.shape[1]
    p_sum_E = aux_probs_TE.sum(dim=0)
    return (p_sum_E * counts_E.to(p_sum_E.dtype)).sum() * (E / (topk * num_tokens * num_tokens))


def global_aux_loss(aux_probs_TE: Tensor, local_counts_E: Tensor, state: GlobalLoadState | None,
                    num_tokens_tp_cp: float, topk: int, tp_cp_dp_group: Group,
                    ) -> tuple[Tensor, GlobalLoadState]:
    """Global-batch share and the state to pass to the next micro-batch (see module docstring).

    Collective over ``tp_cp_dp_group`` (one all-reduce of [E]).
    """
    # int64 over the wire, fp64 in the state: exact far beyond fp32's 2**24 tokens per expert
    counts_E = all_reduce_sum(local_counts_E.to(torch.int64), tp_cp_dp_group).to(torch.float64)
    if state is None:
        state = GlobalLoadState(torch.zeros_like(counts_E), 0)
    state = state.add(counts_E)
    mean_counts_E = state.counts_E / state.num_micro_batches
    mean_tokens = (mean_counts_E.sum() / topk).clamp(min=1)
    E = aux_probs_TE.shape[1]
    f_E = mean_counts_E / (topk * mean_tokens)
    p_share_E = aux_probs_TE.sum(dim=0) / num_tokens_tp_cp
    return E * (f_E.to(p_share_E.dtype) * p_share_E).sum(), state


def seq_aux_loss(aux_probs_TE: Tensor, expert_ids_TK: Tensor, seq_ids_T: Tensor, num_seqs: int,
                 tp_cp_group: Group) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss share, averaged over the ``num_seqs`` sequences.

    seq_ids_T: int64 [T_local], the sequence (0..num_seqs-1, numbered within this dp rank's
    micro-batch, the same numbering on every tp/cp rank) of each local token.
    Collective over ``tp_cp_group`` (one all-reduce of [num_seqs, E + 1]).
    """
    T, E = aux_probs_TE.shape
    K = expert_ids_TK.shape[1]
    seq_ids_T = seq_ids_T.to(expert_ids_TK.device, torch.int64)
    stats_SX = torch.zeros(num_seqs, E + 1, dtype=torch.float32, device=aux_probs_TE.device)
    flat = (seq_ids_T.unsqueeze(1) * (E + 1) + expert_ids_TK).reshape(-1)
    stats_SX.view(-1).scatter_add_(0, flat, torch.ones(T * K, dtype=torch.float32, device=flat.device))
    stats_SX[:, E].scatter_add_(0, seq_ids_T, torch.ones(T, dtype=torch.float32, device=flat.device))
    stats_SX = all_reduce_sum(stats_SX, tp_cp_group)
    counts_SE, lengths_S = stats_SX[:, :E], stats_SX[:, E].clamp(min=1)
    p_sum_SE = torch.zeros(num_seqs, E, dtype=aux_probs_TE.dtype, device=aux_probs_TE.device)
    p_sum_SE = p_sum_SE.index_add(0, seq_ids_T, aux_probs_TE)
    f_SE = counts_SE * (E / K) / lengths_S.unsqueeze(1)
    P_SE = p_sum_SE / lengths_S.unsqueeze(1).to(p_sum_SE.dtype)
    return (f_SE.to(P_SE.dtype) * P_SE).sum() / num_seqs


def z_loss(logits_TE: Tensor, num_tokens_tp_cp: float) -> Tensor:
    """ST-MoE router z-loss share: ``sum_local logsumexp(logits)^2 / T_g``."""
    return torch.logsumexp(logits_TE, dim=-1).square().sum() / num_tokens_tp_cp


def batch_first_seq_ids(batch: int, local_seq_len: int, device: torch.device | None = None) -> Tensor:
    """seq_ids_T for local tokens laid out batch-first, ``[batch, local_seq_len]`` flattened."""
    return torch.arange(batch, device=device).repeat_interleave(local_seq_len)
