"""A dispatch's or combine's token exchange as an object: started now, waited on later, in either direction.

A dispatcher's work splits into local stages around one exchange of rows over the expert group (see
``dispatch.base.Dispatcher``): the MoE layer chains them (``exchange_with_grad``: autograd
connects the rows that were sent to those that arrived, backward is the exchange's adjoint), and the
batch-level overlap schedules (``pipeline.overlap``) start one micro-batch's exchange, compute another
micro-batch meanwhile, and wait; the backward exchange is started and waited on the same way. Both run
the same objects, so the overlapped step moves the same bytes with the same collectives.

- ``exchange.start(*tensors) -> InFlight``; ``.wait()`` gives an ``Arrival`` (the received tensors, and
  what the exchange learned on the way, e.g. DeepEP's layout, as ``meta``).
- ``exchange.start_backward(grads, meta) -> InFlight``; ``.wait()`` gives the gradients of the sent tensors.

Neither records autograd. Asynchrony: torch.distributed collectives are launched with ``async_op=True``;
``wait()`` is ``Work.wait()``: on NCCL the communication runs on ProcessGroupNCCL's own stream and
``wait()`` makes the current (compute) stream wait on its CUDA event (no host wait); on gloo it runs on
gloo's threads and ``wait()`` blocks the caller until it is done. DeepEP's exchanges (``dispatch.deepep``,
``dispatch.deepep_elastic``) run on DeepEP's communication stream and wait on its event (``after_event``).

``AllToAllExchange``: the alltoall dispatcher's uneven all-to-all over ep (one collective, or one per
local expert when chunked; the rows' routing probs beside them by the same splits), optionally FP8
(rows leave as e4m3 with their scales, arrive dequantised; gradients return in the rows' dtype, the
cast counting as the identity).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.dispatch.fp8_exchange import dequantize_rows, pack, quantize_rows, unpack
from moefold.parallel.groups import Group, group_size

T = TypeVar("T")
M = TypeVar("M")


class InFlight(Generic[T]):
    """Work in flight; ``wait()`` finishes it once and returns its result (later calls return the same)."""

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None

    @property
    def done(self) -> bool:
        return self._finish is None

    def wait(self) -> T:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result  # type: ignore[return-value]


class StreamEvent(Protocol):
    """An event the compute stream can wait on (DeepEP's ``EventOverlap``)."""

    def current_stream_wait(self) -> None: ...


def after_event(event: StreamEvent, result: T) -> InFlight[T]:
    """``result`` in flight until the compute stream waits on ``event`` (DeepEP's ``EventOverlap``, recorded on its
    communication stream after the kernel that writes ``result``'s tensors): ``wait()`` makes the current stream
    wait on it, no host wait, and returns ``result``."""
    def finish() -> T:
        event.current_stream_wait()
        return result

    return InFlight(finish)


@dataclass(frozen=True)
class Arrival(Generic[M]):
    """What an exchange delivered: ``tensors`` (received; no autograd) and ``meta``, what its backward and the
    next stage need to know that only the exchange found out (DeepEP's received layout, the allgather's gathered
    expert ids; None for all-to-all)."""

    tensors: tuple[Tensor, ...]
    meta: M


class TokenExchange(ABC, Generic[M]):
    """One exchange of token rows over an expert group, both directions (module docstring); ``M``: the type of
    what it learns on the way (``Arrival.meta``)."""

    @abstractmethod
    def start(self, *tensors: Tensor) -> InFlight[Arrival[M]]:
        """Start moving ``tensors`` (detached) forward."""

    @abstractmethod
    def start_backward(self, grads: Sequence[Tensor], meta: M) -> InFlight[tuple[Tensor, ...]]:
        """Start moving the gradients of the received tensors back; ``meta`` is the forward ``Arrival``'s. The
        result holds one gradient per sent tensor."""


class _Arrived(torch.autograd.Function):
    """Forward: the arrived tensors, now on the graph of the sent ones. Backward: the exchange's adjoint."""

    @staticmethod
    def forward(ctx, exchange: TokenExchange[M], meta: M, num_sent: int, *tensors: Tensor):
        ctx.exchange, ctx.meta, ctx.num_sent = exchange, meta, num_sent
        received = tensors[num_sent:]
        ctx.mark_non_differentiable(*(t for t in received if not t.is_floating_point()))
        return tuple(t.view_as(t) for t in received)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        sent = ctx.exchange.start_backward(tuple(g.contiguous() for g in grads), ctx.meta).wait()
        return (None, None, None, *sent, *([None] * len(grads)))


def arrive(exchange: TokenExchange[M], sent: Sequence[Tensor], arrival: Arrival[M]) -> tuple[Tensor, ...]:
    """The received tensors on the autograd graph of ``sent`` (what crossed ranks: their gradients, backward)."""
    if not any(t.requires_grad for t in sent):
        return arrival.tensors
    return _Arrived.apply(exchange, arrival.meta, len(sent), *sent, *arrival.tensors)


def exchange_with_grad(exchange: TokenExchange[M], *sent: Tensor) -> InFlight[tuple[Arrival[M], tuple[Tensor, ...]]]:
    """Start ``exchange`` on ``sent`` (autograd-connected at ``wait()``): the plain layer's way to run it.
    ``wait()`` gives (the Arrival, its tensors on the graph)."""
    flight = exchange.start(*(t.detach() for t in sent))

    def finish() -> tuple[Arrival[M], tuple[Tensor, ...]]:
        arrival = flight.wait()
        return arrival, arrive(exchange, sent, arrival)

    return InFlight(finish)


# --------------------------------------------------------------------------------------------- all-to-all
def _launch(out: Tensor, x: Tensor, out_splits: Sequence[Sequence[int]], in_splits: Sequence[Sequence[int]],
            group: Group) -> list[dist.Work]:
    """One asynchronous uneven all-to-all per chunk c: the next sum(in_splits[c]) rows of ``x`` out, the
    received rows appended to ``out`` in chunk order."""
    works, o, i = [], 0, 0
    for oc, ic in zip(out_splits, in_splits):
        no, ni = sum(oc), sum(ic)
        works.append(dist.all_to_all_single(out[o:o + no], x[i:i + ni], list(oc), list(ic), group=group,
                                            async_op=True))
        o, i = o + no, i + ni
    return works


def _all_to_all(x: Tensor, out_splits: Sequence[Sequence[int]], in_splits: Sequence[Sequence[int]],
                group: Group) -> InFlight[Tensor]:
    if sum(map(sum, in_splits)) != x.shape[0]:
        raise ValueError(f"all-to-all: splits {list(in_splits)} cover {sum(map(sum, in_splits))} rows, the input "
                         f"has {x.shape[0]}")
    if group_size(group) == 1:
        return InFlight(lambda: x)
    out = x.new_empty((sum(map(sum, out_splits)), *x.shape[1:]))
    works = _launch(out, x.contiguous(), out_splits, in_splits, group)

    def finish() -> Tensor:
        for w in works:
            w.wait()
        return out

    return InFlight(finish)


@dataclass(frozen=True)
class AllToAllExchange(TokenExchange[None]):
    """Rows over ``group`` by fixed host split sizes, as chunks: chunk c sends ``send[c][r]`` rows to rank r and
    receives ``recv[c][r]`` from it (one chunk: a plain uneven all-to-all). ``reverse()`` is the combine's
    direction. ``fp8``: the forward rows travel as e4m3 with their per-block scales (``dispatch.fp8_exchange``)
    and arrive in ``dtype``; gradients travel in their own dtype."""

    send: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    group: Group
    fp8: bool = False

    def reverse(self) -> AllToAllExchange:
        """The exchange back (received rows -> their senders), in high precision."""
        return AllToAllExchange(self.recv, self.send, self.group)

    def start(self, *tensors: Tensor) -> InFlight[Arrival[None]]:
        """``(rows [N, ...],)`` or ``(rows, probs [N])``: each tensor by the same splits (the probs in their own
        dtype, one more all-to-all, as Megatron-Core's alltoall dispatcher moves its permuted probs)."""
        rows, *rest = tensors
        others = [_all_to_all(t, self.recv, self.send, self.group) for t in rest]
        if not self.fp8:
            flight = _all_to_all(rows, self.recv, self.send, self.group)
            return InFlight(lambda: Arrival((flight.wait(), *(f.wait() for f in others)), None))
        if rows.dim() != 2:
            raise ValueError(f"FP8 dispatch sends token rows [N, H], got shape {tuple(rows.shape)}")
        with torch.no_grad():   # every row is cast, also those a rank keeps: the same values at every layout
            flight = _all_to_all(pack(*quantize_rows(rows)), self.recv, self.send, self.group)
        H, dtype = rows.shape[1], rows.dtype
        return InFlight(lambda: Arrival((dequantize_rows(*unpack(flight.wait(), H), dtype),
                                         *(f.wait() for f in others)), None))

    def start_backward(self, grads: Sequence[Tensor], meta: None) -> InFlight[tuple[Tensor, ...]]:
        flights = [_all_to_all(g, self.send, self.recv, self.group) for g in grads]
        return InFlight(lambda: tuple(f.wait() for f in flights))


__all__ = ["AllToAllExchange", "Arrival", "InFlight", "StreamEvent", "TokenExchange", "after_event", "arrive",
           "exchange_with_grad"]
