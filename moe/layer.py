"""The MoE layer: router -> dispatch (shared experts meanwhile) -> experts -> combine (+ shared).

Its parts are passed in, built by ``moe.build.build_moe_layer`` from ``MoEConfig``: the router, the dispatcher
(``dispatch.base.Dispatcher``: six typed stages), the routed experts (``GroupedExperts`` with its GEMM backend) and
the shared experts (or None).

One path, in staged pieces: ``forward`` runs exactly the pieces the batch-level overlap schedules
(``pipeline.overlap`` through ``models.sublayers``) run as separate nodes, with the token exchanges between them::

    route_and_prepare -> dispatch exchange -> experts_step -> combine exchange -> combine_finish
                         (shared_step in flight)

``forward`` chains the exchanges with autograd (``dispatch.token_exchange.exchange_with_grad``) and runs
``shared_step`` between the dispatch exchange's start and its wait: the shared experts overlap the exchange where
the dispatcher leaves it in flight (alltoall's asynchronous all-to-all, flex's DeepEP kernel on its communication
stream), not allgather's gather, which has finished when its exchange starts. The overlap schedules run the
shared experts with the router instead, in the piece before the dispatch exchange.
Host synchronisations per layer (forward + backward, bf16 grouped_mm experts): local 0 (dropless
or padded; 1 in unpadded capacity mode), alltoall 1 (dropless or unpadded capacity; 0 padded),
allgather 1, flex on DeepEP V2 0 (sync-free: the received counts stay on the device), flex on the legacy
DeepEP 1 (its dispatch waits on the host for the received counts) (tests/dispatch/test_host_sync.py).

Routing probs: ``y[t] = sum_k p[t, k] * FFN_k(x_t)``, applied inside the experts' activation (each dispatched row
carries its prob, ``Dispatched.probs_N``; the down projection's input is ``(act(h) * p).to(dtype)``, Megatron-Core
0.16.1's order; see ``dispatch.base`` and ``moe.activation``) so that the combine only sums a token's copies, or,
with ``apply_probs_on_input`` (top-1), to the token before the experts (Megatron's ``--moe-apply-probs-on-input``).

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

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from moefold.dense.regions import PLAIN, Region, replace_regions
from moefold.dispatch.base import Dispatched, Dispatcher, DispatchHandle, DispatchPrep
from moefold.dispatch.token_exchange import exchange_with_grad
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.experts import GroupedExperts
from moefold.moe.hash_router import HashRouter
from moefold.moe.latent import LatentProjection
from moefold.moe.router import Router, RouterOutput
from moefold.moe.router_stats import RouterStats
from moefold.moe.routing_replay import LIVE_ROUTING, RoutingTap
from moefold.moe.shared_experts import SharedExperts
from moefold.parallel.comm import gather_along_dim, scatter_along_dim
from moefold.parallel.groups import Group, group_rank, group_size


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


@dataclass(frozen=True)
class MoEDispatchStart:
    """``route_and_prepare``'s result: the tensors the dispatch exchange sends, the dispatcher's ``prep`` (frozen;
    it may hold the routing probs on the graph), the router's info, and whether the tokens were split over tp."""

    sent: tuple[Tensor, ...]
    prep: DispatchPrep
    info: MoEOutputInfo
    split_tokens: bool


@dataclass(frozen=True)
class MoEExpertsOut:
    """``experts_step``'s result: the tensors the combine exchange sends, the dispatch's handle (the combine's
    stages read it), and this rank's experts' received copies (``MoEOutputInfo.received_E``, or None)."""

    sent: tuple[Tensor, ...]
    handle: DispatchHandle
    received_E: Tensor | None


@dataclass(frozen=True)
class MoERegions:
    """Where an MoE layer runs its parts (``dense.regions``): ``shared_experts`` the shared experts (Megatron's
    ``shared_experts`` recompute and offload module); ``router`` the router and ``preprocess`` the dispatcher's
    local preparation (the CUDA graph scopes ``moe_router`` and ``moe_preprocess``); ``routing`` where the router's
    expert choices come from and go to (``moe.routing_replay.RoutingTap``: live, recorded or replayed). The routed
    experts own theirs (``ExpertsRegions``)."""

    shared_experts: Region = PLAIN
    router: Region = PLAIN
    preprocess: Region = PLAIN
    routing: RoutingTap = field(default=LIVE_ROUTING, metadata={"kind": RoutingTap})


class MoELayer(nn.Module):
    """A mixture-of-experts FFN from its parts (module docstring; ``moe.build.build_moe_layer`` builds them).

    ``tp_group``: attention's tensor-parallel group (the tokens' sharding); ``sequence_parallel``: the input is the
    tp rank's sequence shard (else replicated over tp and split here); ``apply_probs_on_input``: top-1, the token is
    scaled by its prob before the experts; ``pad_multiple``: the dispatch lays each expert's rows out padded to it
    (``--moe-router-padding-for-quantization``), or None.

    ``regions`` (``MoERegions``), installed by ``configure`` (``moefold.execution``: recompute, offload).
    """

    def __init__(self, router: Router, dispatcher: Dispatcher[DispatchPrep, object, DispatchHandle],
                 experts: GroupedExperts, shared_experts: SharedExperts | None = None, *, tp_group: Group = None,
                 sequence_parallel: bool = False, apply_probs_on_input: bool = False,
                 pad_multiple: int | None = None,
                 latent: tuple[LatentProjection, LatentProjection] | None = None) -> None:
        super().__init__()
        if not router.config.num_experts == dispatcher.num_experts == experts.num_experts:
            raise ValueError(f"MoELayer: the router has {router.config.num_experts} experts, the dispatcher "
                             f"{dispatcher.num_experts}, the experts {experts.num_experts}")
        width = router.hidden_size if latent is None else latent[0].out_features
        if latent is not None and not (latent[0].in_features == latent[1].out_features == router.hidden_size
                                       and latent[1].in_features == width):
            raise ValueError(f"MoELayer: latent projections {latent[0].extra_repr()} and {latent[1].extra_repr()} "
                             f"do not map hidden size {router.hidden_size} to a latent width and back")
        if width != experts.hidden_size:
            raise ValueError(f"MoELayer: the experts take width {experts.hidden_size}, the tokens reach them at "
                             f"{width} (hidden size {router.hidden_size}, latent {latent is not None})")
        self.hidden_size, self.num_experts = router.hidden_size, experts.num_experts
        # Megatron's fc1_latent_proj / fc2_latent_proj (moe.latent), or None
        self.latent_down, self.latent_up = latent if latent is not None else (None, None)
        self.tp_group, self.tp = tp_group, group_size(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.apply_probs_on_input, self._pad_multiple = apply_probs_on_input, pad_multiple
        # the per-sequence balancing loss needs each token's sequence id (fixed by the config)
        self.needs_seq_ids = "seq_aux_loss" in router.config.loss_coeffs()
        self.router = router
        self.dispatcher = dispatcher
        self.experts = experts
        self.etp_rank = group_rank(experts.etp_group)
        self.shared_experts = shared_experts
        self.regions = MoERegions()

    def configure(self, **regions: Region | RoutingTap) -> None:
        """Install regions by name (``MoERegions``); ValueError for an unknown name or a wrong kind."""
        self.regions = replace_regions(self.regions, "MoELayer", **regions)

    # -- the layer's staged pieces: forward runs them, the overlap schedules run each as its own node ------------
    def route_and_prepare(self, x_SBH: Tensor, *, global_state: GlobalLoadState | None = None,
                          generator: torch.Generator | None = None,
                          token_ids_BS: Tensor | None = None) -> MoEDispatchStart:
        """Router and the dispatcher's local preparation (its split sizes: a host sync for dropless alltoall):
        everything before the dispatch exchange but the shared experts (``shared_step``).
        ``global_state``/``generator`` go to the router (global_aux_loss, input jitter); ``token_ids_BS``: the
        tokens' vocabulary ids, int [B, S] over the tp group's sequence (the input's, or tp x the SP shard's),
        which a hash router (``moe.hash_router``) selects by and any other router refuses."""
        x_in_TH, routed, split_tokens = self._route(x_SBH, global_state, generator, token_ids_BS)
        if self.latent_down is not None:   # the exchange and the experts at the latent width
            x_in_TH = self.latent_down(x_in_TH)
        # the probs travel with the rows to the experts, unless they were applied to the input
        sent, prep = self.regions.preprocess(self.dispatcher.prepare_dispatch, x_in_TH, routed.routing,
                                             with_probs=not self.apply_probs_on_input)
        return MoEDispatchStart(sent=sent, prep=prep, info=self._info(routed), split_tokens=split_tokens)

    def shared_step(self, x_SBH: Tensor) -> Tensor | None:
        """The shared experts' output ``[S, B, H]`` (like the input: SP shard or replicated), or None."""
        if self.shared_experts is None:
            return None
        return self.regions.shared_experts(self.shared_experts, x_SBH)

    def experts_step(self, received: tuple[Tensor, ...], meta: object, prep: DispatchPrep) -> MoEExpertsOut:
        """Between the two exchanges: the dispatch's local finish, the routed experts (``p * FFN_g(rows)``, each
        row's prob applied inside the activation; partial sums over etp), the combine's local start."""
        dispatched: Dispatched[DispatchHandle] = self.dispatcher.finish_dispatch(received, meta, prep)
        out_NH = self.experts(dispatched.tokens_NH, dispatched.tokens_per_expert_e, dispatched.tokens_per_expert_host,
                              dispatched.probs_N)
        return MoEExpertsOut(self.dispatcher.prepare_combine(out_NH, dispatched.handle), dispatched.handle,
                             self._received(dispatched.received_e))

    def combine_finish(self, received: tuple[Tensor, ...], handle: DispatchHandle, x_SBH_like: Tensor,
                       split_tokens: bool, shared_SBH: Tensor | None) -> Tensor:
        """After the combine exchange: each token's (weighted) copies summed, the shared experts added.
        ``x_SBH_like``: a tensor of the layer input's shape and dtype."""
        y_TH = self.dispatcher.finish_combine(received, handle)
        if self.latent_up is not None:   # the combine's sum (fp32 for bf16 tokens) back to the hidden size
            y_TH = self.latent_up(y_TH)
        # For bf16 tokens the combine returns its fp32 sum of the k (weighted) copies (``dispatch.base``): the
        # shared experts' output is added to it in fp32 and the layer's output rounded once (Megatron-Core
        # rounds the combine's sum first, then adds the shared experts in bf16)
        if split_tokens:   # rounded before the gather, which then moves model-dtype bytes
            y_TH = gather_along_dim(y_TH.to(x_SBH_like.dtype), self.tp_group, dim=0)
        y_SBH = y_TH.view(x_SBH_like.shape)
        if shared_SBH is not None:
            y_SBH = y_SBH + shared_SBH
        return y_SBH.to(x_SBH_like.dtype)

    def forward(self, x_SBH: Tensor, *, global_state: GlobalLoadState | None = None,
                generator: torch.Generator | None = None,
                token_ids_BS: Tensor | None = None) -> tuple[Tensor, MoEOutputInfo]:
        """x [S, B, H] (SP shard or replicated over tp) -> (y like x, MoEOutputInfo): the staged pieces in order,
        the shared experts while the dispatch exchange is in flight. ``token_ids_BS``: ``route_and_prepare``'s."""
        start = self.route_and_prepare(x_SBH, global_state=global_state, generator=generator,
                                       token_ids_BS=token_ids_BS)
        flight = exchange_with_grad(self.dispatcher.dispatch_exchange(start.prep), *start.sent)
        shared_SBH = self.shared_step(x_SBH)
        arrival, received = flight.wait()
        step = self.experts_step(received, arrival.meta, start.prep)
        _, returned = exchange_with_grad(self.dispatcher.combine_exchange(step.handle), *step.sent).wait()
        y_SBH = self.combine_finish(returned, step.handle, x_SBH, start.split_tokens, shared_SBH)
        return y_SBH, replace(start.info, received_E=step.received_E)

    # -- helpers of the pieces ---------------------------------------------------------------------------------
    def _route(self, x_SBH: Tensor, global_state: GlobalLoadState | None, generator: torch.Generator | None,
               token_ids_BS: Tensor | None = None) -> tuple[Tensor, RouterOutput, bool]:
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
        tap = self.regions.routing
        replayed_BSK = tap.replayed()
        hashed = isinstance(self.router, HashRouter)
        if hashed != (token_ids_BS is not None):
            raise ValueError("MoELayer: a hash router selects by the tokens' ids, pass token_ids_BS" if hashed else
                             "MoELayer: token_ids_BS given but the router is a top-k router (not hash-routed)")
        if hashed:   # the table's ids are what any replay recorded, so they take the replayed ids' path
            if tuple(token_ids_BS.shape) != (B, self._tp_sequence(S)):
                raise ValueError(f"MoELayer: token_ids_BS has shape {tuple(token_ids_BS.shape)}, this call's tokens "
                                 f"need [B, S] = {[B, self._tp_sequence(S)]} (S over the tp group)")
            replayed_BSK = self.router.expert_ids(token_ids_BS)
        if replayed_BSK is not None:
            router_kw["replayed_ids_TK"] = self._replayed_ids(replayed_BSK, S, B, x_TH.device)
        routed = self.regions.router(self.router, x_TH, global_state=global_state, generator=generator,
                                     **router_kw)
        if tap.recording():
            tap.record(self._recorded_ids(routed.routing.expert_ids_TK, S, B))
        if self._pad_multiple is not None:   # --moe-router-padding-for-quantization: the dispatch lays rows out padded
            routed = replace(routed, routing=replace(routed.routing, pad_multiple=self._pad_multiple))
        if self.apply_probs_on_input:  # top-1: scale the token, sum the copy unweighted
            # the product in fp32 (bf16 tokens times the fp32 prob), rounded once: Megatron-Core's experts.py
            # ``permuted_probs.unsqueeze(-1) * permuted_local_hidden_states`` then ``.to(original_dtype)``
            x_TH = (x_TH * routed.routing.probs_TK).to(x_TH.dtype)
        return x_TH, routed, split_tokens

    def _tp_sequence(self, S: int) -> int:
        """The sequence length a tp group's tokens span: the input's, or tp x the SP shard's."""
        return S * self.tp if self.sequence_parallel else S

    def _replayed_ids(self, ids_BSK: Tensor, S: int, B: int, device: torch.device) -> Tensor:
        """A tap's ``[B, S, K]`` ids (the tp group's tokens) -> this tp rank's router tokens' ``[T, K]``: the SP shard,
        or the 1/tp slice of the sequence-first tokens; either is the rank's contiguous chunk of ``[S * B]``."""
        want = (B, self._tp_sequence(S), self.router.config.topk)
        if tuple(ids_BSK.shape) != want:
            raise ValueError(f"MoELayer: routing replay gave ids of shape {tuple(ids_BSK.shape)} for this call, its "
                             f"tokens need [B, S, K] = {list(want)}")
        ids_TK = ids_BSK.to(device, non_blocking=True).transpose(0, 1).reshape(-1, want[2])
        if self.tp > 1:
            ids_TK = ids_TK.chunk(self.tp)[group_rank(self.tp_group)]
        return ids_TK.contiguous()

    def _recorded_ids(self, ids_TK: Tensor, S: int, B: int) -> Tensor:
        """This tp rank's chosen ``[T, K]`` -> the tp group's ``[B, S, K]`` (all-gathered over tp: collective)."""
        with torch.no_grad():
            ids_TK = gather_along_dim(ids_TK.detach(), self.tp_group, dim=0)
        return ids_TK.view(self._tp_sequence(S), B, -1).transpose(0, 1).contiguous()

    @staticmethod
    def _info(routed: RouterOutput) -> MoEOutputInfo:
        return MoEOutputInfo(aux_loss=routed.aux_loss, losses=routed.losses, stats=routed.stats,
                             load_E=routed.load_E, global_state=routed.global_state)

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
        return f"hidden={self.hidden_size}, dispatcher={self.dispatcher.kind}, sp={self.sequence_parallel}"
