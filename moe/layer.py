"""The MoE layer: router -> dispatch (shared experts meanwhile) -> experts -> combine (+ shared).

The shared experts run between ``dispatch_start`` and ``wait``: they overlap the token exchange
where the dispatcher leaves it in flight (alltoall's asynchronous all-to-all, flex's DeepEP
kernel on its communication stream), not allgather's gathers, which finish inside dispatch_start.
Host synchronisations per layer (forward + backward, bf16 grouped_mm experts): local 0 (dropless
or padded; 1 in unpadded capacity mode), alltoall 1 (dropless or unpadded capacity; 0 padded),
allgather 1, flex on DeepEP V2 0 (sync-free: the received counts stay on the device), flex on the legacy
DeepEP 1 (its dispatch waits on the host for the received counts) (tests/dispatch/test_host_sync.py).

Routing probs: applied in the combine, ``y[t] = sum_k p[t, k] * FFN_k(x_t)`` (on the token's home
rank for local/alltoall: they never travel; see ``dispatch.base``), or, with
``apply_probs_on_input`` (top-1), to the token before the experts (Megatron's
``--moe-apply-probs-on-input``).

Drops into the transformer block's FFN slot: ``forward(x [S, B, H]) -> (y [S, B, H], MoEOutputInfo)``.
The batch-level overlap schedules (``pipeline.overlap``) run the same steps as separate nodes with the token
exchanges between them: ``route_and_prepare`` -> dispatch exchange -> ``experts_step`` -> combine exchange
-> ``combine_finish`` (the shared experts then run with the router, before the dispatch exchange).

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

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.activation_offload import NO_OFFLOAD
from moefold.dense.recompute import checkpointed
from moefold.dispatch import build_dispatcher
from moefold.dispatch.base import Dispatched, DispatchHandle
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.config import MoEConfig
from moefold.moe.experts import GroupedExperts
from moefold.moe.gemm import needs_host_counts
from moefold.moe.router import Router, RouterGroups, RouterOutput
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
    received_E: int32 [E] copies this rank's experts received (at their global index, zero elsewhere and on
              etp ranks other than 0, so a sum over all ranks counts each copy once), where the dispatcher
              counts them (flex on DeepEP V2), else None
    """

    aux_loss: Tensor
    losses: dict[str, Tensor] = field(default_factory=dict)
    stats: RouterStats | None = None
    load_E: Tensor | None = None
    global_state: GlobalLoadState | None = None
    received_E: Tensor | None = None


def flex_options(config: MoEConfig, hidden_size: int) -> dict[str, Any]:
    """The flex dispatcher's options for ``config`` (``dispatch.build_dispatcher``), its backend resolved from the
    installed DeepEP when ``auto``."""
    from moefold.dispatch.flex_backend import resolve_flex_backend

    backend = resolve_flex_backend(config.flex_backend)
    if backend == "deepep-legacy":
        return {"flex_backend": backend, "num_sms": config.deepep_num_sms}
    fp8_gemms = config.fp8 is not None and config.fp8.enabled
    return {"flex_backend": backend, "num_sms": config.deepep_num_sms, "hidden_size": hidden_size,
            "max_tokens_per_rank": config.deepep_max_tokens_per_rank, "cpu_sync": deepep_cpu_sync(config),
            "hybrid": config.deepep_hybrid, "expert_alignment": config.fp8.group_alignment if fp8_gemms else 1}


def deepep_cpu_sync(config: MoEConfig) -> bool:
    """V2's ``do_cpu_sync``: as configured, or (None) on exactly when the expert GEMMs read host counts anyway
    (``te``, ``grouped_gemm``, ``loop``; FP8 GEMMs' per-expert weight gradients), which DeepEP's wait then gives."""
    if config.deepep_cpu_sync is not None:
        return config.deepep_cpu_sync
    return needs_host_counts(config.gemm_backend) or (config.fp8 is not None and config.fp8.enabled)


@dataclass(frozen=True)
class MoEDispatchStart:
    """``route_and_prepare``'s result: the tensors the dispatch exchange sends, the dispatcher's ``prep`` (frozen;
    it may hold the routing probs on the graph), the shared experts' output, the router's info, and whether the
    tokens were split over tp."""

    sent: tuple[Tensor, ...]
    prep: Any
    shared_SBH: Tensor | None
    info: MoEOutputInfo
    split_tokens: bool


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
        self.router = Router(config.router, hidden_size, RouterGroups.from_dims(dims), device=device)
        options = flex_options(config, hidden_size) if config.dispatcher == "flex" else {}
        fp8_dispatch = config.fp8 is not None and config.fp8.dispatch
        padding = config.fp8 is not None and config.fp8.router_padding
        self._pad_multiple = config.fp8.align_size if padding else None
        if padding and config.router.expert_capacity_factor is not None:
            raise ValueError("--moe-router-padding-for-quantization pads dropless routing; with "
                             "--moe-expert-capacity-factor pad to capacity instead "
                             "(--moe-pad-expert-input-to-capacity)")
        if padding and config.dispatcher == "flex":
            raise ValueError("--moe-router-padding-for-quantization is laid out by the allgather / alltoall "
                             "dispatchers' row maps; the flex (DeepEP) dispatcher does not take it")
        self.dispatcher = build_dispatcher(config.dispatcher, config.num_experts, dims, fp8=fp8_dispatch, **options)
        self.experts = GroupedExperts(
            config.num_experts, hidden_size, config.moe_ffn_hidden_size, ep_group=dims.ep_group,
            etp_group=dims.etp_group, activation=config.activation, gemm_backend=config.gemm_backend,
            init_std=config.init_std, output_init_std=config.output_init_std, fp8=config.fp8,
            fp8_token_group=dims.expert_token_group, glu=config.glu, bias=config.linear_bias,
            row_layout=config.expert_row_layout, dtype=dtype, device=device)
        self.num_experts = config.num_experts
        self.etp_rank = group_rank(dims.etp_group)
        self.shared_experts = None
        self.recompute_shared_experts = False   # selective recompute (``dense.recompute``), set by the model
        self.offload_shared_experts = NO_OFFLOAD   # activation offloading (``dense.activation_offload``), likewise
        if config.has_shared_experts:
            self.shared_experts = SharedExperts(
                hidden_size, config.shared_expert_ffn_size, tp_group=dims.tp_group,
                sequence_parallel=self.sequence_parallel, gate=config.shared_expert_gate,
                init_std=config.init_std, output_init_std=config.output_init_std, dtype=dtype, device=device)

    # -- the layer's steps, shared by forward() and by the staged form the overlap schedules run -------------------
    def _route(self, x_SBH: Tensor, global_state: GlobalLoadState | None, generator: torch.Generator | None,
               ) -> tuple[Tensor, RouterOutput, bool]:
        """Tokens to dispatch ``x_in_TH`` (this tp rank's), the router's output, whether tokens were split over tp."""
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
        routed = self.router(x_TH, global_state=global_state, generator=generator, **router_kw)
        if self._pad_multiple is not None:   # --moe-router-padding-for-quantization: the dispatch lays rows out padded
            routed = replace(routed, routing=replace(routed.routing, pad_multiple=self._pad_multiple))
        if self.config.apply_probs_on_input:  # top-1: scale the token, sum the copy unweighted
            # the product in fp32 (bf16 tokens times the fp32 prob), rounded once: Megatron-Core's experts.py
            # ``permuted_probs.unsqueeze(-1) * permuted_local_hidden_states`` then ``.to(original_dtype)``
            x_TH = (x_TH * routed.routing.probs_TK).to(x_TH.dtype)
        return x_TH, routed, split_tokens

    def _shared(self, x_SBH: Tensor) -> Tensor | None:
        if self.shared_experts is None:
            return None
        with self.offload_shared_experts:
            return checkpointed(self.shared_experts, x_SBH, enabled=self.recompute_shared_experts)

    def _routed_experts(self, dispatched: Dispatched) -> Tensor:
        """routed experts: plain FFN_g(rows) (partial sums over etp)"""
        return self.experts(dispatched.tokens_NH, dispatched.tokens_per_expert_e, dispatched.tokens_per_expert_host)

    def _output(self, y_TH: Tensor, x_SBH: Tensor, split_tokens: bool, shared_SBH: Tensor | None) -> Tensor:
        # For bf16 tokens the combine returns its fp32 sum of the k weighted copies (``dispatch.base``): the
        # shared experts' output is added to it in fp32 and the layer's output rounded once (Megatron-Core
        # rounds the combine's sum first, then adds the shared experts in bf16)
        if split_tokens:   # rounded before the gather, which then moves model-dtype bytes
            y_TH = gather_along_dim(y_TH.to(x_SBH.dtype), self.tp_group, dim=0)
        y_SBH = y_TH.view(x_SBH.shape)
        if shared_SBH is not None:
            y_SBH = y_SBH + shared_SBH
        return y_SBH.to(x_SBH.dtype)

    @staticmethod
    def _info(routed: RouterOutput) -> MoEOutputInfo:
        return MoEOutputInfo(aux_loss=routed.aux_loss, losses=routed.losses, stats=routed.stats,
                             load_E=routed.load_E, global_state=routed.global_state)

    def forward(self, x_SBH: Tensor, *, global_state: GlobalLoadState | None = None,
                generator: torch.Generator | None = None) -> tuple[Tensor, MoEOutputInfo]:
        """x [S, B, H] (SP shard or replicated over tp) -> (y like x, MoEOutputInfo).

        ``global_state``/``generator`` go to the router (global_aux_loss, input jitter).
        """
        # 1. route: the same Routing feeds the dispatch and the balancing losses
        x_in_TH, routed, split_tokens = self._route(x_SBH, global_state, generator)
        # 2. start moving token copies to their experts (the combine weights each returned copy by its prob,
        # unless the probs were applied to the input) ...
        pending = self.dispatcher.dispatch_start(x_in_TH, routed.routing,
                                                 weighted_combine=not self.config.apply_probs_on_input)
        # 3. ... and compute the shared experts while they travel (alltoall, flex: the exchange is in
        # flight until wait(); allgather has finished its gathers already)
        shared_SBH = self._shared(x_SBH)
        dispatched = pending.wait()
        # 4. routed experts, 5. bring the outputs home, reduce over etp, add up each token's k copies times probs
        y_TH = self.dispatcher.combine(self._routed_experts(dispatched), dispatched.handle)
        info = replace(self._info(routed), received_E=self._received(dispatched.received_e))
        return self._output(y_TH, x_SBH, split_tokens, shared_SBH), info

    # -- staged: the overlap schedules (pipeline.overlap) run each step as its own node, the exchanges between -----
    def route_and_prepare(self, x_SBH: Tensor, *, global_state: GlobalLoadState | None = None,
                          generator: torch.Generator | None = None) -> MoEDispatchStart:
        """Router, the dispatcher's local preparation (its split sizes: a host sync for dropless alltoall) and the
        shared experts: everything before the dispatch exchange."""
        x_in_TH, routed, split_tokens = self._route(x_SBH, global_state, generator)
        sent, prep = self.dispatcher.prepare_dispatch(x_in_TH, routed.routing,
                                                      weighted_combine=not self.config.apply_probs_on_input)
        return MoEDispatchStart(sent=sent, prep=prep, shared_SBH=self._shared(x_SBH), info=self._info(routed),
                                split_tokens=split_tokens)

    def experts_step(self, received: tuple[Tensor, ...], meta: Any, prep: Any,
                     ) -> tuple[tuple[Tensor, ...], DispatchHandle]:
        """Between the two exchanges: the dispatch's local finish, the routed experts, the combine's local start.
        Returns (the tensors the combine exchange sends, its handle)."""
        dispatched = self.dispatcher.finish_dispatch(received, meta, prep)
        return self.dispatcher.prepare_combine(self._routed_experts(dispatched), dispatched.handle), dispatched.handle

    def combine_finish(self, received: tuple[Tensor, ...], handle: DispatchHandle, x_SBH_like: Tensor,
                       split_tokens: bool, shared_SBH: Tensor | None) -> Tensor:
        """After the combine exchange: each token's copies summed (with their probs), the shared experts added.
        ``x_SBH_like``: a tensor of the layer input's shape and dtype."""
        return self._output(self.dispatcher.finish_combine(received, handle), x_SBH_like, split_tokens, shared_SBH)

    def _received(self, received_e: Tensor | None) -> Tensor | None:
        """This rank's experts' received copies at their global indices (``MoEOutputInfo.received_E``)."""
        if received_e is None:
            return None
        out = received_e.new_zeros(self.num_experts)
        if self.etp_rank == 0:
            e = received_e.shape[0]
            off = self.experts.local_expert_offset
            out[off:off + e] = received_e.detach()
        return out

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, dispatcher={self.config.dispatcher}, sp={self.sequence_parallel}"
