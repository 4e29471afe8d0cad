"""The top-k router of one MoE layer: this rank's tokens -> Routing, balance losses, statistics.

    router = Router(config, hidden_size, RouterGroups.from_dims(dims))
    out = router(x_TH)                        # x_TH: this rank's tokens (the SP shard when tp > 1)
    loss = lm_loss + out.aux_loss             # one backward trains through the balance losses
    ... dispatch with out.routing ...

What crosses ranks (all plain all-reduces, none on the autograd path):
  aux_loss: selection counts [E] over tp x cp; seq_aux_loss: per-sequence counts over tp x cp;
  global_aux_loss: counts [E] over tp x cp x dp; statistics only when ``reduce_stats=True``.
The differentiable part is local, so the router weight's gradient is a partial sum over tp x cp:
the weight is marked sequence-parallel (summed over tp) and cp sums like every dense weight.
See moe.balance_losses for the exact loss convention and formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from moefold.dispatch.routing import Routing
from moefold.moe.balance_losses import (
    GlobalLoadState,
    batch_first_seq_ids,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from moefold.moe.capacity import capacity_keep_mask, expert_capacity, rank_capacity_keep_mask
from moefold.moe.quantile_balancing import quantile_route
from moefold.moe.router_config import AuxLossCounts, RouterConfig
from moefold.moe.router_stats import RouterStats, compute_router_stats, router_entropy_sum
from moefold.moe.scoring import count_per_expert, gating_logits, route_scores, router_dtype, scores_for_aux_loss
from moefold.parallel.comm import all_reduce_sum
from moefold.parallel.groups import Group, group_size
from moefold.parallel.sharding import mark_sequence_parallel, normal_init, set_init

if TYPE_CHECKING:
    from moefold.parallel.dims import ParallelDims


@dataclass(frozen=True)
class RouterGroups:
    """Process groups the router's statistics need (None = alone).

    tp_cp:    ranks holding pieces of the same sequences (per-micro-batch statistics and losses)
    tp_cp_dp: every rank that sees different tokens of the step (global counts, expert bias)
    dispatch: the token dispatcher's group (etp x ep) and ``ep`` its expert-parallel size (rank capacity)
    """

    tp_cp: Group = None
    tp_cp_dp: Group = None
    dispatch: Group = None
    ep: int = 1

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> RouterGroups:
        """From a parallel.ParallelDims."""
        return cls(tp_cp=dims.tp_cp_group, tp_cp_dp=dims.tp_cp_dp_group, dispatch=dims.etp_ep_group, ep=dims.ep)


@dataclass(frozen=True)
class RouterOutput:
    """One router call.

    routing:      what the dispatcher consumes (probs [T, K] fp32 with zeros for dropped copies)
    aux_loss:     fp32 scalar on the graph: sum of coefficient * loss share over the enabled
                  balance losses and the z-loss (zero tensor when none is enabled)
    losses:       {name: detached, unweighted share}; sum over tp x cp for the micro-batch value
    stats:        RouterStats
    load_E:       int64 [E] this rank's copies that selected each expert, before capacity (sum it
                  over the step's micro-batches and pass it to update_expert_bias)
    global_state: GlobalLoadState to pass into the next micro-batch (None without global_aux_loss)
    logits_TE:    router logits (router dtype; for parity tests and logging)
    """

    routing: Routing
    aux_loss: Tensor
    losses: dict[str, Tensor]
    stats: RouterStats
    load_E: Tensor
    global_state: GlobalLoadState | None = None
    logits_TE: Tensor | None = None


class Router(nn.Module):
    """Gating weight [E, H] (fp32, replicated over tp/cp), with ``config.bias`` a learned logit bias
    ``bias`` [E] (fp32, zero-initialised, trained like the weight: GPT-OSS) and, with expert bias, the
    buffer ``expert_bias`` [E] fp32 (model state, used for selection only; see moe.expert_bias).

    ``stats_group``: the group ``reduce_stats=True`` sums the statistics over (tp x cp x dp with the
    global loss or expert bias, else tp x cp). ``device``: where the weight, bias and expert bias are created
    (None: the default device); they stay fp32 whatever the model's dtype."""

    def __init__(self, config: RouterConfig, hidden_size: int, groups: RouterGroups = RouterGroups(), *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"Router: hidden_size={hidden_size!r} must be a positive integer")
        self.config = config
        self.hidden_size = hidden_size
        self.groups = groups
        self._loss_coeffs = config.loss_coeffs()
        # the statistics describe the group the balancing acts over: the whole step's tokens when the
        # global loss or the expert bias balance them, else the micro-batch (tp x cp)
        balances_globally = ("global_aux_loss" in self._loss_coeffs or config.enable_expert_bias
                             or config.quantile_balancing)
        self.stats_group = groups.tp_cp_dp if balances_globally else groups.tp_cp
        weight = torch.empty(config.num_experts, hidden_size, dtype=torch.float32, device=device)
        if not weight.is_meta:
            # The weight is replicated: its constructor value must be the same on every rank and
            # device, so draw it from a seeded CPU generator (a CPU generator cannot fill a CUDA
            # tensor) and copy it in. init_parameters() overwrites it layout-independently.
            cpu_draw = torch.empty(weight.shape, dtype=torch.float32, device="cpu")
            weight.copy_(cpu_draw.normal_(0.0, config.init_std, generator=torch.Generator().manual_seed(0)))
        self.weight = nn.Parameter(weight)
        mark_sequence_parallel(self.weight)
        set_init(self.weight, normal_init(config.init_std))
        if config.bias:
            self.bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32, device=device))
            mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        if config.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        if config.quantile_balancing:   # the bias is model state; the step's quantile sums are not
            self.register_buffer("qb_beta", torch.zeros(config.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("qb_beta_accum", torch.zeros(config.num_experts, dtype=torch.float32,
                                                              device=device), persistent=False)
            self.register_buffer("qb_beta_count", torch.zeros((), dtype=torch.int64, device=device),
                                 persistent=False)
        else:
            self.qb_beta = self.qb_beta_accum = self.qb_beta_count = None

    def forward(self, x_TH: Tensor, *, seq_ids_T: Tensor | None = None, num_seqs: int | None = None,
                global_state: GlobalLoadState | None = None, generator: torch.Generator | None = None,
                reduce_stats: bool = False, replayed_ids_TK: Tensor | None = None) -> RouterOutput:
        """Route this rank's tokens.

        x_TH:         [T, H] any float dtype; the gating GEMM runs in the router dtype (fp32/fp64)
        seq_ids_T, num_seqs: for seq_aux_loss: the sequence (0..num_seqs-1 within this dp rank's
                      micro-batch, same numbering on all tp/cp ranks) of each token; with only
                      ``num_seqs`` the tokens are taken as batch-first ``[num_seqs, T/num_seqs]``
        global_state: for global_aux_loss: the state returned by the previous micro-batch of this
                      step for this layer (None on the first)
        generator:    RNG of the training-only input jitter (None: torch's default generator;
                      each rank then draws from its own default stream)
        reduce_stats: sum the statistics over the balancing group (tp x cp x dp with
                      global_aux_loss or expert bias, else tp x cp); a collective: logging steps
        replayed_ids_TK: routing replay (``moe.routing_replay``): int64 [T, K] global expert ids an earlier
                      forward chose for these tokens; they replace the top-k selection, the probs are the current
                      scores at them (so the router still learns), and capacity drops them by the same rule
        """
        cfg = self.config
        if x_TH.dim() != 2 or x_TH.shape[1] != self.hidden_size:
            raise ValueError(f"Router: x_TH has shape {tuple(x_TH.shape)}, expected [T, {self.hidden_size}]")
        T, E, K = x_TH.shape[0], cfg.num_experts, cfg.topk
        dtype = router_dtype(cfg)
        x = x_TH   # cast to the router dtype inside the gating GEMM, which keeps x as it is for its backward
        if self.training and cfg.input_jitter_eps is not None:
            x = x.to(dtype)
            # multiplicative uniform noise on the router input only (Switch Transformer, Megatron)
            eps = cfg.input_jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps, generator=generator)
        logits_TE = gating_logits(x, self.weight, dtype, self.bias)
        bias_E = self.expert_bias.to(torch.float32) if self.expert_bias is not None else None
        if replayed_ids_TK is not None and (replayed_ids_TK.shape != (T, K) or replayed_ids_TK.dtype != torch.int64):
            raise ValueError(f"Router: replayed_ids_TK is {replayed_ids_TK.dtype} {tuple(replayed_ids_TK.shape)}, "
                             f"expected torch.int64 ({T}, {K})")
        chosen_TK = replayed_ids_TK   # a replayed routing wins over quantile balancing's (which then learns nothing)
        if chosen_TK is None and cfg.quantile_balancing:
            chosen_TK = self._quantile_ids(logits_TE)
        scores_TE, ids_TK, probs_TK = route_scores(logits_TE, cfg, bias_E, chosen_TK)
        load_E = count_per_expert(ids_TK, E)

        keep_TK, capacity, kept_E = None, None, load_E
        if cfg.expert_capacity_factor is not None:
            capacity = expert_capacity(T, K, E, cfg.expert_capacity_factor)
            keep_TK = capacity_keep_mask(probs_TK, ids_TK, E, capacity, cfg.token_drop_policy)
            probs_TK = probs_TK * keep_TK
            kept_E = count_per_expert(ids_TK, E, keep_TK)
        if cfg.expert_rank_capacity_factor is not None:   # at most C x its share per expert-parallel rank
            keep_TK = rank_capacity_keep_mask(probs_TK, ids_TK, kept_E, E, self.groups.ep,
                                              cfg.expert_rank_capacity_factor, cfg.token_drop_policy,
                                              self.groups.dispatch, keep_TK)
            probs_TK = probs_TK * keep_TK
            kept_E = count_per_expert(ids_TK, E, keep_TK)
        routing = Routing(probs_TK=probs_TK.to(torch.float32), expert_ids_TK=ids_TK, tokens_per_expert_E=kept_E,
                          keep_TK=keep_TK, capacity=capacity, pad_to_capacity=cfg.pad_expert_input_to_capacity)

        aux_probs_TE = scores_for_aux_loss(scores_TE, cfg.score_function)
        aux_ids_TK, aux_load_E = ids_TK, load_E
        if cfg.aux_loss_counts is AuxLossCounts.TOPK and self._loss_coeffs and (replayed_ids_TK is not None or
                bias_E is not None or cfg.num_groups is not None or cfg.force_load_balancing):
            # Megatron-Core (router.py -> compute_routing_scores_for_aux_loss): the losses count a plain top-k of
            # the scores; it differs from the dispatched selection only with bias, group limit, forced routing or
            # replayed ids
            aux_ids_TK = scores_TE.detach().topk(K, dim=-1).indices
            aux_load_E = count_per_expert(aux_ids_TK, E)
        aux_loss, losses, global_state = self._losses(logits_TE, aux_probs_TE, aux_ids_TK, aux_load_E, seq_ids_T,
                                                      num_seqs, global_state)
        stats = compute_router_stats(load_E, kept_E, router_entropy_sum(aux_probs_TE), T, bias_E,
                                     group=self.stats_group, reduce=reduce_stats)
        return RouterOutput(routing=routing, aux_loss=aux_loss, losses=losses, stats=stats, load_E=load_E,
                            global_state=global_state, logits_TE=logits_TE)

    def _quantile_ids(self, logits_TE: Tensor) -> Tensor:
        """Quantile balancing's ids [T, K]; in training (grad enabled) also adds this micro-batch's quantile to
        the sums ``update_quantile_biases`` turns into the next step's bias (all-gathers logits over tp x cp)."""
        update = self.training and torch.is_grad_enabled()
        ids_TK, quantile_E = quantile_route(logits_TE, self.config.topk, self.qb_beta, self.groups.tp_cp, update)
        if quantile_E is not None:
            self.qb_beta_accum.add_(quantile_E)
            self.qb_beta_count.add_(1)
        return ids_TK

    def _losses(self, logits_TE: Tensor, aux_probs_TE: Tensor, ids_TK: Tensor, load_E: Tensor,
                seq_ids_T: Tensor | None, num_seqs: int | None, global_state: GlobalLoadState | None,
                ) -> tuple[Tensor, dict[str, Tensor], GlobalLoadState | None]:
        cfg, groups = self.config, self.groups
        T, K = ids_TK.shape
        # SP and CP shards hold equal token counts; max(.., 1): an empty shard's share is 0, not NaN
        tokens_tp_cp = max(T * group_size(groups.tp_cp), 1)
        shares: dict[str, tuple[float, Tensor]] = {}
        coeffs = self._loss_coeffs
        if "aux_loss" in coeffs:
            counts_E = _all_reduce_counts(load_E, groups.tp_cp)
            shares["aux_loss"] = coeffs["aux_loss"], switch_aux_loss(aux_probs_TE, counts_E, tokens_tp_cp, K)
        if "seq_aux_loss" in coeffs:
            seq_ids_T, num_seqs = _resolve_sequences(seq_ids_T, num_seqs, T, logits_TE.device)
            shares["seq_aux_loss"] = coeffs["seq_aux_loss"], seq_aux_loss(aux_probs_TE, ids_TK, seq_ids_T,
                                                                          num_seqs, groups.tp_cp)
        new_state = None
        if "global_aux_loss" in coeffs:
            loss, new_state = global_aux_loss(aux_probs_TE, load_E, global_state, tokens_tp_cp, K, groups.tp_cp_dp)
            shares["global_aux_loss"] = coeffs["global_aux_loss"], loss
        if cfg.z_loss_coeff:
            shares["z_loss"] = cfg.z_loss_coeff, z_loss(logits_TE, tokens_tp_cp)
        total = torch.zeros((), dtype=torch.float32, device=logits_TE.device)
        for coeff, value in shares.values():
            total = total + coeff * value.to(torch.float32)
        losses = {name: value.detach().to(torch.float32) for name, (_, value) in shares.items()}
        return total, losses, new_state


def _all_reduce_counts(counts_E: Tensor, group: Group) -> Tensor:
    return all_reduce_sum(counts_E.to(torch.int64), group)


def _resolve_sequences(seq_ids_T: Tensor | None, num_seqs: int | None, num_tokens: int,
                       device: torch.device) -> tuple[Tensor, int]:
    if num_seqs is None or (not isinstance(num_seqs, int)) or num_seqs < 1:
        raise ValueError(f"Router: seq_aux_loss needs num_seqs (a positive int, the sequences in this rank's "
                         f"micro-batch), got {num_seqs!r}")
    if seq_ids_T is None:
        if num_tokens % num_seqs:
            raise ValueError(f"Router: {num_tokens} tokens are not divisible by num_seqs={num_seqs}; pass seq_ids_T "
                             "for a non batch-first layout")
        return batch_first_seq_ids(num_seqs, num_tokens // num_seqs, device), num_seqs
    if seq_ids_T.shape != (num_tokens,):
        raise ValueError(f"Router: seq_ids_T has shape {tuple(seq_ids_T.shape)}, expected [{num_tokens}]")
    return seq_ids_T, num_seqs
