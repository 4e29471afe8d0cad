"""The dispatcher interface: ``dispatch(x, routing) -> Dispatched`` and ``combine(rows, handle) -> y``.

Every dispatcher moves each kept copy of this rank's T tokens to the rank(s) holding its expert
(expert ``g`` lives on ep rank ``g // e_local``; with etp > 1 every rank of the etp group gets the
same rows) and brings the expert outputs back. Dispatchers are stateless between steps:
everything ``combine`` needs travels in the frozen handle.

The routing weights: ``dispatch`` hands each row to the experts with its routing prob (``Dispatched.probs_N``),
the experts return ``p * FFN_g(x)`` (they apply the prob inside their activation, ``moe.activation``, as
Megatron-Core 0.16.1's experts do) and ``combine`` sums a token's returned copies unweighted:
``y[t] = sum_k probs[t, k] * FFN_{g_tk}(x_t)``. So the probs travel with the rows, as Megatron's dispatchers carry
them: local and alltoall permute them with the rows and exchange them beside the tokens (a second, [N] fp32,
all-to-all), allgather gathers them with the tokens and the routing, flex receives them in DeepEP's dispatch
message (``topk_weights``), and their gradient (computed by the experts' activation) returns by each exchange's
backward. The combine keeps nothing of the rows for backward. ``with_probs=False`` hands no probs (the caller
applied them to the input: Megatron's ``--moe-apply-probs-on-input``), and the experts run unweighted.

Stages (``Dispatcher``, a typed ``Protocol``): a dispatch is ``prepare_dispatch`` (local) -> ``dispatch_exchange``
(the one exchange over the expert group, ``dispatch.token_exchange``) -> ``finish_dispatch`` (local); a combine
likewise (``prepare_combine`` -> ``combine_exchange`` -> ``finish_combine``). What crosses from one stage to the next
is typed per dispatcher: its ``DispatchPrep`` subclass, its exchange's ``Arrival.meta`` and its ``DispatchHandle``
subclass. Every dispatcher implements every stage; the MoE layer (``moe.layer``) and the batch-level overlap
schedules run exactly these stages, the layer with the exchanges chained by autograd (``exchange_with_grad``),
the schedules with each exchange as its own node. ``TokenDispatcher.dispatch_start`` / ``dispatch`` / ``combine``
chain the same stages for tests and benchmarks.

Precision: the sum of a token's copies (and any reduction of partial outputs over ranks on
the way home) accumulates in fp32 for bf16/fp16 tokens (``dispatch.permutation.combine_dtype``), and
``combine`` may return it in fp32 (local, alltoall, allgather; flex hands DeepEP bf16): the caller rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from torch import Tensor

from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.routing import Routing
from moefold.dispatch.token_exchange import InFlight, TokenExchange, exchange_with_grad
from moefold.parallel.groups import Group, group_rank, group_size

# A bench-only hook: ``timer(phase)`` returns a context manager timing that phase.
PhaseTimer = Callable[[str], AbstractContextManager]


@dataclass(frozen=True)
class DispatchPrep:
    """What ``prepare_dispatch`` found out for the later stages; subclasses add their dispatcher's fields.

    num_tokens: T of the dispatching rank.
    """

    num_tokens: int


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs to undo one ``dispatch``; subclasses add their dispatcher's fields.

    num_tokens: T of the dispatching rank; num_rows: N rows handed to the experts.
    """

    num_tokens: int
    num_rows: int


PrepT = TypeVar("PrepT", bound=DispatchPrep)
MetaT = TypeVar("MetaT")
HandleT = TypeVar("HandleT", bound=DispatchHandle)


@dataclass(frozen=True)
class Dispatched(Generic[HandleT]):
    """The experts' input on this rank.

    tokens_NH:              [N, H] rows grouped by local expert (expert-major), padding rows zero
    tokens_per_expert_e:    [e_local] int64 rows per local expert (padding included), on x's device
    handle:                 consumed by ``combine``
    tokens_per_expert_host: the same counts as host ints when the dispatcher already has them
                            (it synchronised for its split sizes, or they are static), else None;
                            GEMM backends that take host split sizes use them instead of a sync
    received_e:             [e_local] int32 copies each local expert received (padding excluded), as the
                            exchange counted them (DeepEP V2's ``cumulative_local_expert_recv_stats``), or None
    probs_N:                [N] fp32 routing prob of each row (0 for padding rows), on the autograd graph of
                            ``routing.probs_TK`` (the experts weight their rows by it); None when dispatched with
                            ``with_probs=False``

    Rows past ``sum(tokens_per_expert_e)``: a sync-free dispatcher that allocates for the worst case (the V2 flex
    dispatcher) hands over more rows than its experts' blocks cover; those carry no token (their values are
    unspecified), the experts skip them and ``combine`` never reads their outputs.
    """

    tokens_NH: Tensor
    tokens_per_expert_e: Tensor
    handle: HandleT
    tokens_per_expert_host: tuple[int, ...] | None = None
    received_e: Tensor | None = None
    probs_N: Tensor | None = None


@runtime_checkable
class Dispatcher(Protocol[PrepT, MetaT, HandleT]):
    """The six stages every token dispatcher implements (module docstring), and what the MoE layer reads of it.

    ``PrepT``: what ``prepare_dispatch`` hands the later stages; ``MetaT``: what its dispatch exchange learns on the
    way (``Arrival.meta``); ``HandleT``: what ``combine`` needs to undo the dispatch. Stages hold no per-step state
    on the dispatcher.
    """

    kind: ClassVar[DispatcherKind]
    name: ClassVar[str]
    num_experts: int
    num_local_experts: int
    local_expert_offset: int

    def prepare_dispatch(self, x_TH: Tensor, routing: Routing, *, with_probs: bool = True,
                         ) -> tuple[tuple[Tensor, ...], PrepT]:
        """Local work before the exchange: (the tensors to send, on the graph of ``x_TH``; the frozen ``prep``).
        ``with_probs``: the probs travel with the rows (``Dispatched.probs_N``; False: none, the experts run
        unweighted). May synchronise with the host (split sizes)."""
        ...

    def dispatch_exchange(self, prep: PrepT) -> TokenExchange[MetaT]:
        """The exchange that moves ``prepare_dispatch``'s tensors to the experts' ranks."""
        ...

    def finish_dispatch(self, received: tuple[Tensor, ...], meta: MetaT, prep: PrepT) -> Dispatched[HandleT]:
        """Local work on the received tensors (``Arrival.meta`` alongside) -> the experts' input."""
        ...

    def prepare_combine(self, expert_out_NH: Tensor, handle: HandleT) -> tuple[Tensor, ...]:
        """Local work on the experts' output (weighted by the experts; partial sums over etp) before the exchange
        back: the tensors to send."""
        ...

    def combine_exchange(self, handle: HandleT) -> TokenExchange[None]:
        """The exchange that brings ``prepare_combine``'s tensors home."""
        ...

    def finish_combine(self, received: tuple[Tensor, ...], handle: HandleT) -> Tensor:
        """Local work on the returned tensors -> y [T, H], each token's copies summed (in fp32 for bf16 rows: see the
        module docstring)."""
        ...


class TokenDispatcher:
    """Base class: expert placement over ``ep_group``, the input checks every dispatcher shares, and the stages
    chained (``dispatch_start`` / ``dispatch`` / ``combine``). Subclasses implement ``Dispatcher``'s stages."""

    kind: ClassVar[DispatcherKind]
    name: ClassVar[str]

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

    # -- the stages chained (tests, benchmarks): the MoE layer runs the same stages itself (moe.layer) ---------------
    def dispatch_start(self: Dispatcher[PrepT, MetaT, HandleT], x_TH: Tensor, routing: Routing, *,
                       with_probs: bool = True) -> InFlight[Dispatched[HandleT]]:
        """``prepare_dispatch``, then the exchange started; ``wait()`` waits for it and runs ``finish_dispatch``. Work
        between the two overlaps the exchange as far as the dispatcher leaves it in flight (alltoall's all-to-all,
        flex's DeepEP kernel; allgather's gather has finished when its exchange starts)."""
        sent, prep = self.prepare_dispatch(x_TH, routing, with_probs=with_probs)
        with self._phase("communicate"):
            flight = exchange_with_grad(self.dispatch_exchange(prep), *sent)

        def finish() -> Dispatched[HandleT]:
            with self._phase("communicate"):
                arrival, received = flight.wait()
            return self.finish_dispatch(received, arrival.meta, prep)

        return InFlight(finish)

    def dispatch(self: Dispatcher[PrepT, MetaT, HandleT], x_TH: Tensor, routing: Routing, *,
                 with_probs: bool = True) -> Dispatched[HandleT]:
        """``dispatch_start(x, routing).wait()``."""
        return self.dispatch_start(x_TH, routing, with_probs=with_probs).wait()

    def combine(self: Dispatcher[PrepT, MetaT, HandleT], expert_out_NH: Tensor, handle: HandleT) -> Tensor:
        """``prepare_combine``, the exchange back, ``finish_combine``: [N, H] expert outputs -> y [T, H]."""
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
