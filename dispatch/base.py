"""The dispatcher interface: ``dispatch(x, routing) -> Dispatched`` and ``combine(rows, handle) -> y``.

Every dispatcher moves each kept copy of this rank's T tokens to the rank(s) holding its expert
(expert ``g`` lives on ep rank ``g // e_local``; with etp > 1 every rank of the etp group gets the
same rows) and brings the expert outputs back. Dispatchers are stateless between steps:
everything ``combine`` needs travels in the frozen handle.

The routing weights: the experts compute plain ``FFN_g(x)``; ``combine`` returns
``y[t] = sum_k probs[t, k] * FFN_{g_tk}(x_t)``. Where the probs are applied is the dispatcher's
business: local and alltoall apply them on the token's home rank, in the unpermute that sums the
k returned copies (the probs never travel); allgather and flex, whose combine adds up each
token's copies on the expert side before anything comes home (a reduce-scatter; DeepEP's normal
combine kernels, which add without weights), move them with the routing they must send anyway
and apply them there. ``weighted_combine=False`` sums the copies unweighted (the caller applied
the probs to the input: Megatron's ``--moe-apply-probs-on-input``).

Stages: a dispatch is ``prepare_dispatch`` (local) -> ``dispatch_exchange`` (the one exchange over the
expert group, ``dispatch.token_exchange``) -> ``finish_dispatch`` (local); a combine likewise. The plain
``dispatch_start``/``combine`` chain them with autograd across the exchange; the batch-level overlap
schedules run each as its own node. The allgather dispatcher is not staged (``staged = False``).

Precision: the weighted sum of a token's copies (and any reduction of partial outputs over ranks on
the way home) accumulates in fp32 for bf16/fp16 tokens (``dispatch.permutation.combine_dtype``), and
``combine`` may return it in fp32 (local, alltoall, allgather; flex hands DeepEP bf16): the caller rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from moefold.dispatch.routing import Routing
from moefold.dispatch.token_exchange import TokenExchange, exchange_with_grad
from moefold.parallel.groups import Group, group_rank, group_size

# A bench-only hook: ``timer(phase)`` returns a context manager timing that phase.
PhaseTimer = Callable[[str], AbstractContextManager]


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs to undo one ``dispatch``; subclasses add their dispatcher's fields.

    num_tokens: T of the dispatching rank; num_rows: N rows handed to the experts.
    """

    num_tokens: int
    num_rows: int


@dataclass(frozen=True)
class Dispatched:
    """The experts' input on this rank.

    tokens_NH:              [N, H] rows grouped by local expert (expert-major), padding rows zero
    tokens_per_expert_e:    [e_local] int64 rows per local expert (padding included), on x's device
    handle:                 consumed by ``combine``
    tokens_per_expert_host: the same counts as host ints when the dispatcher already has them
                            (it synchronised for its split sizes, or they are static), else None;
                            GEMM backends that take host split sizes use them instead of a sync
    received_e:             [e_local] int32 copies each local expert received (padding excluded), as the
                            exchange counted them (DeepEP V2's ``cumulative_local_expert_recv_stats``), or None

    Rows past ``sum(tokens_per_expert_e)``: a sync-free dispatcher that allocates for the worst case (the V2 flex
    dispatcher) hands over more rows than its experts' blocks cover; those carry no token (their values are
    unspecified), the experts skip them and ``combine`` never reads their outputs.
    """

    tokens_NH: Tensor
    tokens_per_expert_e: Tensor
    handle: DispatchHandle
    tokens_per_expert_host: tuple[int, ...] | None = None
    received_e: Tensor | None = None


class PendingDispatch:
    """A dispatch whose communication may still be in flight; ``wait()`` returns the ``Dispatched``.

    ``finish`` runs once, at the first ``wait()``: it waits for the exchange (an async collective's
    work, or DeepEP's CUDA event) and does the local work that needs the received rows. Work the
    caller runs between ``dispatch_start`` and ``wait`` (the shared experts) overlaps the exchange
    only as far as the dispatcher left it in flight: alltoall's token exchange and flex's DeepEP
    kernel are; allgather's gathers have finished when ``dispatch_start`` returns.

    ``event``: an object with ``current_stream_wait()`` (DeepEP's ``EventOverlap``) that the
    compute stream must wait on before ``finish`` reads the received rows; the first ``wait()``
    waits on it once and drops it (``event`` is None afterwards). Staged dispatchers wait inside
    their exchange's ``InFlight`` instead (``dispatch.token_exchange``).
    """

    def __init__(self, finish: Callable[[], Dispatched], event: Any = None):
        self._finish: Callable[[], Dispatched] | None = finish
        self._result: Dispatched | None = None
        self.event = event

    def wait(self) -> Dispatched:
        if self._finish is not None:
            if self.event is not None:
                self.event.current_stream_wait()
                self.event = None
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


class TokenDispatcher:
    """Base class: expert placement over ``ep_group`` and input checks shared by all dispatchers."""

    name = "base"

    def __init__(self, num_experts: int, ep_group: Group = None, etp_group: Group = None,
                 timer: PhaseTimer | None = None):
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep, self.etp = group_size(ep_group), group_size(etp_group)
        if num_experts % self.ep != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={self.ep}; "
                             f"use a multiple of {self.ep} experts or an ep that divides {num_experts}")
        self.ep_rank, self.etp_rank = group_rank(ep_group), group_rank(etp_group)
        self.num_local_experts = num_experts // self.ep
        self.local_expert_offset = self.ep_rank * self.num_local_experts
        self._timer = timer

    def _etp_ep_group(self, etp_ep_group: Group) -> Group:
        """The etp x ep group (``ParallelDims.etp_ep_group``: rank ``ep_rank * etp + etp_rank``), checked;
        with ep or etp at 1 it may be None and is the other group."""
        if etp_ep_group is None:
            if self.ep > 1 and self.etp > 1:
                raise ValueError(f"the {self.name} dispatcher with ep={self.ep} and etp={self.etp} needs the "
                                 f"etp_ep_group")
            etp_ep_group = self.ep_group if self.ep > 1 else self.etp_group
        n, rank = self.ep * self.etp, self.ep_rank * self.etp + self.etp_rank
        if group_size(etp_ep_group) != n or group_rank(etp_ep_group) != rank:
            raise ValueError(f"the {self.name} dispatcher's etp_ep_group must hold the ep*etp={self.ep}*{self.etp}={n} "
                             f"ranks ordered ep-major (rank ep_rank*etp + etp_rank, as ParallelDims.etp_ep_group); "
                             f"got a group of {group_size(etp_ep_group)} where this rank is "
                             f"{group_rank(etp_ep_group)}, expected {rank}")
        return etp_ep_group

    def _phase(self, name: str) -> AbstractContextManager:
        return nullcontext() if self._timer is None else self._timer(name)

    def _check(self, x_TH: Tensor, routing: Routing) -> None:
        if x_TH.dim() != 2:
            raise ValueError(f"{self.name} dispatch: x must be [T, H], got shape {tuple(x_TH.shape)}")
        if routing.num_experts != self.num_experts:
            raise ValueError(f"{self.name} dispatch: routing has {routing.num_experts} experts, "
                             f"dispatcher was built for num_experts={self.num_experts}")
        if routing.num_tokens != x_TH.shape[0] or tuple(routing.expert_ids_TK.shape) != tuple(routing.probs_TK.shape):
            raise ValueError(f"{self.name} dispatch: x has {x_TH.shape[0]} tokens, probs_TK "
                             f"{tuple(routing.probs_TK.shape)}, expert_ids_TK {tuple(routing.expert_ids_TK.shape)}")
        if routing.pad_to_capacity and (routing.capacity is None or routing.capacity < 0):
            raise ValueError(f"{self.name} dispatch: pad_to_capacity needs a capacity >= 0, got {routing.capacity}")

    # -- stages: local work, one exchange over the expert group, local work --------------------------------------
    # The batch-level overlap schedules (pipeline.overlap) run the three parts of a dispatch / combine as separate
    # nodes, the exchange in flight while another micro-batch computes; dispatch_start / combine chain them.
    # A dispatcher whose exchange is not one separable step (allgather: its gathers and the routing travel
    # together) keeps staged = False and overrides dispatch_start / combine.
    staged = True

    def prepare_dispatch(self, x_TH: Tensor, routing: Routing, *, weighted_combine: bool = True,
                         ) -> tuple[tuple[Tensor, ...], Any]:
        """Local work before the exchange: (the tensors to send, on the graph of ``x_TH``; a frozen ``prep``
        the other stages read). May synchronise with the host (split sizes)."""
        raise NotImplementedError(f"the {self.name} dispatcher has no separate exchange stage")

    def dispatch_exchange(self, prep: Any) -> TokenExchange:
        """The exchange that moves ``prepare_dispatch``'s tensors to the experts' ranks."""
        raise NotImplementedError(f"the {self.name} dispatcher has no separate exchange stage")

    def finish_dispatch(self, received: tuple[Tensor, ...], meta: Any, prep: Any) -> Dispatched:
        """Local work on the received tensors (``Arrival.meta`` alongside) -> the experts' input."""
        raise NotImplementedError(f"the {self.name} dispatcher has no separate exchange stage")

    def prepare_combine(self, expert_out_NH: Tensor, handle: DispatchHandle) -> tuple[Tensor, ...]:
        """Local work on the experts' output before the exchange back: the tensors to send."""
        raise NotImplementedError(f"the {self.name} dispatcher has no separate exchange stage")

    def combine_exchange(self, handle: DispatchHandle) -> TokenExchange:
        """The exchange that brings ``prepare_combine``'s tensors home."""
        raise NotImplementedError(f"the {self.name} dispatcher has no separate exchange stage")

    def finish_combine(self, received: tuple[Tensor, ...], handle: DispatchHandle) -> Tensor:
        """Local work on the returned tensors -> y [T, H]."""
        raise NotImplementedError(f"the {self.name} dispatcher has no separate exchange stage")

    def dispatch_start(self, x_TH: Tensor, routing: Routing, *, weighted_combine: bool = True) -> PendingDispatch:
        """Start moving the kept copies of x's tokens to their experts (see ``Dispatched``); the exchange is in
        flight until ``wait()``.

        ``weighted_combine``: the combine weights each copy by ``routing.probs_TK`` (False: plain sum).
        """
        sent, prep = self.prepare_dispatch(x_TH, routing, weighted_combine=weighted_combine)
        with self._phase("communicate"):
            flight = exchange_with_grad(self.dispatch_exchange(prep), *sent)

        def finish() -> Dispatched:
            with self._phase("communicate"):
                arrival, received = flight.wait()
            return self.finish_dispatch(received, arrival.meta, prep)

        return PendingDispatch(finish)

    def dispatch(self, x_TH: Tensor, routing: Routing, *, weighted_combine: bool = True) -> Dispatched:
        """``dispatch_start(x, routing).wait()``."""
        return self.dispatch_start(x_TH, routing, weighted_combine=weighted_combine).wait()

    def combine(self, expert_out_NH: Tensor, handle: DispatchHandle) -> Tensor:
        """[N, H] expert outputs (not weighted; partial sums over etp) -> y [T, H], each token's copies
        weighted by its routing probs (unless dispatched with ``weighted_combine=False``) and summed
        (in fp32 for bf16 rows: y may be fp32, see the module docstring)."""
        sent = self.prepare_combine(expert_out_NH, handle)
        with self._phase("communicate"):
            _, received = exchange_with_grad(self.combine_exchange(handle), *sent).wait()
        return self.finish_combine(received, handle)

    def _check_combine(self, expert_out_NH: Tensor, handle: DispatchHandle, handle_type: type) -> None:
        if not isinstance(handle, handle_type):
            raise TypeError(f"{self.name} combine: expected a {handle_type.__name__}, got {type(handle).__name__}")
        if expert_out_NH.dim() != 2 or expert_out_NH.shape[0] != handle.num_rows:
            raise ValueError(f"{self.name} combine: expert output has shape {tuple(expert_out_NH.shape)}, "
                             f"expected [{handle.num_rows}, H] (the dispatched rows)")
