"""Batch-level overlap: one micro-batch's expert exchange in flight while another micro-batch computes.

A model chunk runs as a list of pieces (``models.sublayers``: computes, and the token exchanges between them).
``ChunkRun`` runs them for one (micro-batch, chunk) with the autograd graph cut between every two pieces: each
compute's output tensors on the graph are replaced by fresh leaves (``_cut``), so its backward is its own
``torch.autograd.backward`` call, started when the next piece has produced the leaves' gradients. Exchanges move
tensors without autograd (``dispatch.token_exchange``): started, then waited on later, forward and backward.

``run_overlapped(forward, backward)`` runs the forward of one micro-batch and the backward of another in turns.
A turn runs a side until it has started an exchange, so each exchange is in flight while the other side computes:
for two MoE layers this is Megatron's combined 1F1B order (``combined_1f1b.py``)::

    b: post backward, start combine backward     | f: pre forward (attention, router), start dispatch
    b: wait, mlp backward, start dispatch bwd    | f: wait, mlp forward (experts), start combine
    b: wait, pre backward                        | f: wait, post forward

``--delay-wgrad-compute``: a compute's weight-gradient GEMMs (``dense.split_backward``) are deferred and run right
after the next exchange has started (the experts' behind the dispatch's backward exchange, attention's behind the
previous layer's combine backward), unless the whole backward is an ``I`` whose weight gradients wait for its W.

On CUDA the exchanges run on the communication library's stream (ProcessGroupNCCL's, DeepEP's) and ``wait()``
is a stream wait on its event: no host waits are added; the dropless all-to-all keeps its one host sync per layer
(the split sizes), taken in the pre piece. On CPU (gloo) the collectives run on gloo's threads. ``Trace`` records
the executed order (the tests prove the interleaving with it).

Memory: the overlapped step holds the activations of both micro-batches, its backward half releasing them block by
block while its forward half takes them: about one micro-batch and a block at once (``planner.inflight.fb_peak``;
measured, ``tests/planner/test_memory.py``). A cut keeps the pieces' outputs and an exchange its sent and received
tensors until their backward, beyond what the graphs save: measured on CPU (DeepSeek-V3 tiny, hidden 256, seq 512,
ep2, one micro-batch) about 2.5 to 3 times an MoE block's expert input rows per block more than the plain path.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from moefold.dense.recompute import checkpointed
from moefold.dense.split_backward import DeferredWeightGrads, WeightGradStore
from moefold.dispatch.token_exchange import Arrival, InFlight, TokenExchange
from moefold.models.sublayers import Compute, Exchange, Piece


class Trace:
    """The executed order of an overlapped run: ``events`` of (what, tag, phase, seconds since start), ``what`` one
    of "compute" / "exchange", ``phase`` "forward start" / "forward end" / "backward start" / "backward end" for
    computes, "start" / "end" (wait returned) / "backward start" / "backward end" for exchanges."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, float]] = []
        self._t0 = time.perf_counter()

    def add(self, what: str, tag: str, phase: str) -> None:
        self.events.append((what, tag, phase, time.perf_counter() - self._t0))

    def index(self, tag: str, phase: str) -> int:
        """Position of the first event of ``tag`` in ``phase`` (ValueError if none)."""
        for i, (_, t, p, _) in enumerate(self.events):
            if t == tag and p == phase:
                return i
        raise ValueError(f"no {phase!r} event of {tag!r} in the trace")


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """How a stage runs its chunks as pieces: ``delay_wgrad`` (--delay-wgrad-compute) with the model's ``store``
    (``dense.split_backward``), and an optional ``trace`` of the executed order."""

    delay_wgrad: bool = False
    store: WeightGradStore | None = None
    trace: Trace | None = None

    def __post_init__(self) -> None:
        if self.delay_wgrad and self.store is None:
            raise ValueError("delay_wgrad needs the model's WeightGradStore (dense.split_backward)")


def _cut(obj: Any, pairs: list[tuple[Tensor, Tensor]], seen: dict[int, Tensor]) -> Any:
    """``obj`` with every non-leaf tensor that requires grad replaced by a leaf (one per tensor), recorded in
    ``pairs`` as (tensor, leaf). Walks tuples, lists, dicts and dataclasses; leaves and other values pass."""
    if isinstance(obj, Tensor):
        if not obj.requires_grad or obj.grad_fn is None:
            return obj
        if id(obj) not in seen:
            leaf = obj.detach().requires_grad_()
            seen[id(obj)] = leaf
            pairs.append((obj, leaf))
        return seen[id(obj)]
    if isinstance(obj, (tuple, list)):
        out = [_cut(x, pairs, seen) for x in obj]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _cut(v, pairs, seen) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            new = _cut(value, pairs, seen)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def cut(obj: Any) -> tuple[Any, list[tuple[Tensor, Tensor]]]:
    """``obj`` with its graph cut (see ``_cut``) and the (tensor, leaf) pairs to backpropagate later."""
    pairs: list[tuple[Tensor, Tensor]] = []
    return _cut(obj, pairs, {}), pairs


class _ComputeRun:
    def __init__(self, piece: Compute, tag: str, trace: Trace | None) -> None:
        self.piece, self.tag, self.trace = piece, tag, trace
        self.pairs: list[tuple[Tensor, Tensor]] = []

    def _mark(self, phase: str) -> None:
        if self.trace is not None:
            self.trace.add("compute", self.tag, phase)

    def forward(self, carry: Any) -> Any:
        self._mark("forward start")
        with torch.enable_grad():
            out = checkpointed(self.piece.fn, carry, enabled=self.piece.recompute)
        out, self.pairs = cut(out)
        self._mark("forward end")
        return out

    def backward(self) -> None:
        """The piece's backward: its outputs' leaf gradients into its inputs' leaves (or the weights)."""
        self._mark("backward start")
        pairs = [(t, leaf.grad) for t, leaf in (*self.pairs, *self.piece.borrowed) if leaf.grad is not None]
        self.pairs = []
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self._mark("backward end")


class _ExchangeRun:
    def __init__(self, piece: Exchange, tag: str, trace: Trace | None) -> None:
        self.piece, self.tag, self.trace = piece, tag, trace
        self.flight: InFlight | None = None
        self.exchange: TokenExchange | None = None
        self.sent: tuple[Tensor, ...] = ()
        self.received: tuple[Tensor, ...] = ()
        self.meta: Any = None

    def _mark(self, phase: str) -> None:
        if self.trace is not None:
            self.trace.add("exchange", self.tag, phase)

    def start(self, carry: Any) -> None:
        self.exchange, self.sent, self.rest = self.piece.split(carry)
        self._mark("start")
        self.flight = self.exchange.start(*(t.detach() for t in self.sent))

    def wait(self) -> Any:
        arrival: Arrival = self.flight.wait()
        self._mark("end")
        self.flight, self.meta = None, arrival.meta
        self.received = tuple(t.requires_grad_() if t.is_floating_point() and any(s.requires_grad for s in self.sent)
                              else t for t in arrival.tensors)
        carry, self.rest = self.piece.join(self.rest, self.received, arrival.meta), None
        return carry

    def start_backward(self) -> None:
        self._mark("backward start")
        grads = tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in self.received
                      if t.is_floating_point())
        self.flight = self.exchange.start_backward(grads, self.meta)
        self.received = ()

    def wait_backward(self) -> None:
        grads = self.flight.wait()
        self._mark("backward end")
        for leaf, g in zip(self.sent, grads):
            if leaf.requires_grad:
                leaf.grad = g if leaf.grad is None else leaf.grad + g
        self.flight, self.sent = None, ()


class ChunkRun:
    """One (micro-batch, chunk) through ``pieces``, cut between pieces (module docstring).

    ``forward_steps(carry)`` / ``backward_steps()`` are generators that yield once per exchange in flight (the
    other side's turn); ``forward(carry)`` / ``backward()`` run them alone. After the forward, ``output`` is the last
    piece's (cut) carry; ``seed(tensors, grads)`` backpropagates the chunk's outputs (tensors made from the output
    leaves: the hidden state, the aux-loss sum) into those leaves before the backward.
    """

    def __init__(self, pieces: Sequence[Piece], tag: str = "", trace: Trace | None = None,
                 store: WeightGradStore | None = None, delay_wgrad: bool = False) -> None:
        self.runs = [(_ComputeRun if isinstance(p, Compute) else _ExchangeRun)(p, f"{tag}{p.name}", trace)
                     for p in pieces]
        self.store, self.delay_wgrad = store, delay_wgrad and store is not None
        self.output: Any = None

    def forward_steps(self, carry: Any) -> Iterator[None]:
        for run in self.runs:
            if isinstance(run, _ComputeRun):
                carry = run.forward(carry)
            else:
                run.start(carry)
                yield
                carry = run.wait()
        self.output = carry

    def forward(self, carry: Any) -> Any:
        for _ in self.forward_steps(carry):
            pass
        return self.output

    def seed(self, tensors: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        pairs = [(t, g) for t, g in zip(tensors, grads) if t is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def backward_steps(self) -> Iterator[None]:
        # --delay-wgrad-compute: each compute's weight GEMMs run once the next exchange is in flight; inside an
        # enclosing deferral (an I) they stay there, for its W
        delay = self.delay_wgrad and self.store.current is None
        waiting: DeferredWeightGrads | None = None
        for run in reversed(self.runs):
            if isinstance(run, _ComputeRun):
                if delay:
                    with self.store.defer() as later:
                        run.backward()
                    if waiting is None:
                        waiting = later
                    else:   # two computes without an exchange between them: run both behind the next one
                        later.merge_into(waiting)
                else:
                    run.backward()
            else:
                run.start_backward()
                if waiting is not None:
                    waiting.run()
                    waiting = None
                yield
                run.wait_backward()
        if waiting is not None:
            waiting.run()
        self.output = None

    def backward(self) -> None:
        for _ in self.backward_steps():
            pass


def run_overlapped(forward: Iterator[None] | None, backward: Iterator[None] | None) -> None:
    """Run a forward's and a backward's steps in turns, the backward first (module docstring)."""
    sides = [s for s in (backward, forward) if s is not None]
    while sides:
        for side in list(sides):
            try:
                next(side)
            except StopIteration:
                sides.remove(side)


class _Stitch(torch.autograd.Function):
    """Puts a ChunkRun's outputs on the graph of the plain pipeline executor: forward returns them (views), backward
    seeds the run with their gradients and runs its backward (nested autograd calls, as reentrant checkpointing
    does). The run's input leaf (the received activation) gets its gradient there."""

    @staticmethod
    def forward(ctx, run: ChunkRun, _anchor: Tensor, *outputs: Tensor):
        ctx.run, ctx.outputs = run, outputs
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        run, outputs = ctx.run, ctx.outputs
        ctx.run = ctx.outputs = None
        run.seed(outputs, grads)
        run.backward()
        return (None, None, *([None] * len(grads)))


def stitch(run: ChunkRun, outputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``outputs`` (made from ``run.output``'s leaves) as tensors whose backward runs ``run``'s backward."""
    anchor = torch.empty(0, device=outputs[0].device, requires_grad=True)
    return _Stitch.apply(run, anchor, *outputs)


def backward_seed(outputs: Sequence[Tensor], grads: Sequence[Tensor | None], stitched: Sequence[Tensor],
                  ) -> list[Tensor | None]:
    """The gradients of ``stitched`` (a run's stitched outputs) that ``torch.autograd.backward(outputs, grads)`` would
    deliver to them (the pipeline loss's scaling, the extra losses' 1/m), without running the stitch."""
    needed = [t for t in stitched if t.requires_grad]
    got = torch.autograd.grad(list(outputs), needed, grad_outputs=list(grads), allow_unused=True)
    by_id = {id(t): g for t, g in zip(needed, got)}
    return [by_id.get(id(t)) for t in stitched]


__all__ = ["ChunkRun", "OverlapConfig", "Trace", "backward_seed", "cut", "run_overlapped", "stitch"]
