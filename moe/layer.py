"""The MoE layer: router -> dispatch (shared experts meanwhile) -> experts -> combine (+ shared).

The shared experts run between ``dispatch_start`` and ``wait``: they overlap the token exchange
where the dispatcher leaves it in flight (alltoall's asynchronous all-to-all, flex's DeepEP
kernel on its communication stream), not allgather's gathers, which finish inside dispatch_start.
Host synchronisations per layer (forward + backward, bf16 grouped_mm experts): local 0 (dropless
or padded; 1 in unpadded capacity mode), alltoall 1 (dropless or unpadded capacity; 0 padded),
allgather 1, flex 0 of moefold's own plus the one DeepEP's dispatch makes for its received counts
(tests/dispatch/test_host_sync.py, tests/dispatch/test_flex.py).

Routing probs: applied in the combine, ``y[t] = sum_k p[t, k] * FFN_k(x_t)`` (on the token's home
rank for local/alltoall: they never travel; see ``dispatch.base``), or, with
``apply_probs_on_input`` (top-1), to the token before the experts (Megatron's
``--moe-apply-probs-on-input``).

Drops into the transformer block's FFN slot: ``forward(x [S, B, H]) -> (y [S, B, H], MoEOutputInfo)``.

Tokens and tensor parallelism. With attention TP (tp > 1) and sequence parallelism, ``x`` is this
rank's sequence shard: its tokens are its own and go straight to the router. Without SP, ``x`` is
replicated across tp; rather than route every token tp times (Megatron instead refuses this
case), each tp rank takes a 1/tp slice of the tokens (``scatter_along_dim``: backward all-gathers
the input gradient) and the outputs are all-gathered afterwards (backward keeps the slice).
Either way each tp rank routes distinct tokens, so the router's weight gradient is a partial sum
over tp and is marked ``mark_sequence_parallel`` (the trainer all-reduces it over tp).

What crosses ranks: the dispatcher's exchange over the expert groups (etp x ep), the shared
experts' tp collectives, the router's statistics (its own groups); expert weight gradients are
reduced over edp by the trainer (parameters flagged ``moefold_expert``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moefold.dense.recompute import checkpointed
from moefold.dispatch import build_dispatcher
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.config import MoEConfig
from moefold.moe.experts import GroupedExperts
from moefold.moe.router import Router, RouterGroups
from moefold.moe.router_stats import RouterStats
from moefold.moe.shared_experts import SharedExperts
from moefold.parallel.comm import gather_along_dim, scatter_along_dim
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_rank


@dataclass(frozen=True)
class MoEOutputInfo:
    """Side outputs of one MoE layer call.

    aux_loss: graph-attached scalar to add to the training loss (already scaled by its coefficients)
    losses:   detached named loss values, for logging
    stats:    the router's statistics (tokens per expert, ...)
    load_E:   int64 [E] this rank's copies per expert before capacity (for the expert-bias update)
    global_state: pass back as ``forward(..., global_state=...)`` for the next micro-batch (global_aux_loss)
    """

    aux_loss: Tensor
    losses: dict[str, Tensor] = field(default_factory=dict)
    stats: RouterStats | None = None
    load_E: Tensor | None = None
    global_state: GlobalLoadState | None = None


class MoELayer(nn.Module):
    """A mixture-of-experts FFN over the layout ``dims`` (attention tp for tokens, etp x ep for experts)."""

    def __init__(self, config: MoEConfig, hidden_size: int, dims: ParallelDims, *, sequence_parallel: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"MoELayer: hidden_size={hidden_size!r} must be a positive integer")
        config.check_layout(tp=dims.tp, ep=dims.ep, etp=dims.etp)
        self.config, self.hidden_size = config, hidden_size
        self.tp_group = dims.tp_group
        self.tp, self.sequence_parallel = dims.tp, sequence_parallel and dims.tp > 1
        # the per-sequence balancing loss needs each token's sequence id (fixed by the config)
        self.needs_seq_ids = "seq_aux_loss" in config.router.loss_coeffs()

        # The router marks its weight sequence-parallel itself: every tp rank routes distinct tokens.
        self.router = Router(config.router, hidden_size, RouterGroups.from_dims(dims))
        options = {"num_sms": config.deepep_num_sms} if config.dispatcher == "flex" else {}
        fp8_dispatch = config.fp8 is not None and config.fp8.dispatch
        self.dispatcher = build_dispatcher(config.dispatcher, config.num_experts, dims, fp8=fp8_dispatch, **options)
        self.experts = GroupedExperts(
            config.num_experts, hidden_size, config.moe_ffn_hidden_size, ep_group=dims.ep_group,
            etp_group=dims.etp_group, activation=config.activation, gemm_backend=config.gemm_backend,
            init_std=config.init_std, output_init_std=config.output_init_std, fp8=config.fp8,
            fp8_token_group=dims.expert_token_group, glu=config.glu, bias=config.linear_bias,
            row_layout=config.expert_row_layout, dtype=dtype, device=device)
        self.shared_experts = None
        self.recompute_shared_experts = False   # selective recompute (``dense.recompute``), set by the model
        if config.has_shared_experts:
            self.shared_experts = SharedExperts(
                hidden_size, config.shared_expert_ffn_size, tp_group=dims.tp_group,
                sequence_parallel=self.sequence_parallel, gate=config.shared_expert_gate,
                init_std=config.init_std, output_init_std=config.output_init_std, dtype=dtype, device=device)

    def forward(self, x_SBH: Tensor, *, global_state: GlobalLoadState | None = None,
                generator: torch.Generator | None = None) -> tuple[Tensor, MoEOutputInfo]:
        """x [S, B, H] (SP shard or replicated over tp) -> (y like x, MoEOutputInfo).

        ``global_state``/``generator`` go to the router (global_aux_loss, input jitter).
        """
        S, B, H = x_SBH.shape
        if self.hidden_size != H:
            raise ValueError(f"MoELayer: input hidden size {H} != hidden_size={self.hidden_size}")
        x_TH = x_SBH.reshape(S * B, H)
        split_tokens = self.tp > 1 and not self.sequence_parallel
        if split_tokens:
            if x_TH.shape[0] % self.tp:
                raise ValueError(f"MoELayer: without sequence parallelism the S*B={S * B} tokens are split "
                                 f"over tp={self.tp} and must be divisible by it")
            x_TH = scatter_along_dim(x_TH, self.tp_group, dim=0)
        router_kw = {}
        if self.needs_seq_ids:
            # sequence-first [S, B] tokens: token t belongs to sequence t % B (also in every SP shard)
            seq_ids_T = torch.arange(S * B, device=x_SBH.device) % B
            if split_tokens:
                seq_ids_T = seq_ids_T.chunk(self.tp)[group_rank(self.tp_group)]
            router_kw = {"seq_ids_T": seq_ids_T, "num_seqs": B}

        # 1. route: the same Routing feeds the dispatch and the balancing losses
        routed = self.router(x_TH, global_state=global_state, generator=generator, **router_kw)
        # 2. start moving token copies to their experts ...
        routing = routed.routing
        if self.config.apply_probs_on_input:  # top-1: scale the token, sum the copy unweighted
            x_in = (x_TH * routing.probs_TK.to(x_TH.dtype)).to(x_TH.dtype)
            pending = self.dispatcher.dispatch_start(x_in, routing, weighted_combine=False)
        else:  # the combine weights each returned copy by its prob
            pending = self.dispatcher.dispatch_start(x_TH, routing)
        # 3. ... and compute the shared experts while they travel (alltoall, flex: the exchange is in
        # flight until wait(); allgather has finished its gathers already)
        shared_SBH = None
        if self.shared_experts is not None:
            shared_SBH = checkpointed(self.shared_experts, x_SBH, enabled=self.recompute_shared_experts)
        dispatched = pending.wait()
        # 4. routed experts: plain FFN_g(rows) (partial sums over etp)
        expert_out_NH = self.experts(dispatched.tokens_NH, dispatched.tokens_per_expert_e,
                                     dispatched.tokens_per_expert_host)
        # 5. bring the outputs home, reduce over etp and add up each token's k copies times their probs
        y_TH = self.dispatcher.combine(expert_out_NH, dispatched.handle)

        if split_tokens:
            y_TH = gather_along_dim(y_TH, self.tp_group, dim=0)
        y_SBH = y_TH.view(S, B, H).to(x_SBH.dtype)
        if shared_SBH is not None:
            y_SBH = y_SBH + shared_SBH
        return y_SBH, MoEOutputInfo(aux_loss=routed.aux_loss, losses=routed.losses, stats=routed.stats,
                                    load_E=routed.load_E, global_state=routed.global_state)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, dispatcher={self.config.dispatcher}, sp={self.sequence_parallel}"
