"""Run any schedule's action list on this pipeline rank: forwards, backwards, sends, receives.

The model plugs in through :class:`PipelineStage`: this rank's part of the model (all its
virtual chunks, layers keyed by global index), with one method::

    forward_step(chunk, hidden, microbatch) -> Tensor | tuple[Tensor, Tensor | None]

``hidden`` is None on the model's first chunk (embed ``microbatch``), else the activation
received from the previous model chunk (a leaf that requires grad). It returns the output
activation (sent on, or given to ``loss_fn(output, microbatch)`` on the model's last chunk) and
optionally a scalar *extra loss* of this chunk for this micro-batch (MoE load-balancing / z-loss,
MTP, already weighted). Extra losses reach the gradients on the stage that made them, without
any cross-stage reduction: a backward step is
``torch.autograd.backward([output, extra * s / m], [grad_from_next_stage, 1])``.
Every loss is scaled by s/num_microbatches, so the gradients equal s times those of the mean loss
over the micro-batches of the unsplit model (s: the fp16 loss scale, 1 otherwise).

Actions: ``F`` and ``B`` as above; ``I`` is ``B`` with the weight gradients deferred (the stage model's
``WeightGradStore``, ``dense.split_backward``) and ``W`` runs them; an ``FB`` runs the forward of one
(micro-batch, chunk) and the backward of another as one overlapped step when the stage offers
``forward_backward_step`` (``OverlappedStage``: the decoder with ``pipeline.overlap``), else one after the
other. With the V placement (``zbv``, ``dualpipev``) the hand-over between a rank's two chunks stays local.

Each batch of communication is posted with one ``batch_isend_irecv`` without blocking. Only a
compute waits: for the batch that carries its input and, first, for every batch posted before it,
in posting order (the last sends are waited on at the step's end). The schedules
(``pipeline.schedules``) are built so that this cannot deadlock even under NCCL's rendezvous
semantics with one in-order communication stream (``pipeline.simulator`` checks it,
``wait="lazy"``): there a batch completes only after every earlier batch of its rank, so waiting
for the earlier ones first adds no wait, and gloo, which completes a transfer once both ends
posted it, finishes no later. Waiting lazily keeps the textbook bubble when backward is slower
than forward.

Memory: a waited batch's handle lets go of its ``dist.Work`` objects (they hold the batch's sent
tensors and receive buffers), so no point-to-point tensor lives to the step's end unless needed: a
receive buffer lives until its consumer ran (an activation: until its micro-batch's backward), a
sent tensor until its batch is waited on (by the first compute whose input was posted with it or
later), a sent output also until its backward. Safe on both backends: gloo's work keeps its tensor
until waited on (its ``is_completed()`` stays False until ``wait()``, so it cannot be polled
instead), and NCCL records its communication stream on every point-to-point tensor, so the caching
allocator reuses a freed one only after the transfer ran. ``wait()`` on NCCL is a stream wait: no
host synchronisation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.dense.split_backward import DeferredWeightGrads, WeightGradStore
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.pipeline.actions import Action, ActionKind, is_local, model_chunk, peer_of, rank_and_chunk, split_batches
from moefold.pipeline.p2p import P2PHandle, TensorSpec, batch_send_recv
from moefold.pipeline.schedules import Schedule

StageOutput = Tensor | tuple[Tensor, Tensor | None]


class PipelineStage(Protocol):
    """This rank's part of the model (see the module docstring)."""

    def forward_step(self, chunk: int, hidden: Tensor | None, microbatch: Any) -> StageOutput: ...


@dataclass(frozen=True)
class PipelineResult:
    """What one executed step leaves on this rank.

    ``losses``: per micro-batch ``loss_fn`` values (detached, unscaled); only on the rank holding
    the model's last chunk, empty elsewhere. ``extra_loss``: this rank's extra losses summed over
    its chunks and averaged over micro-batches (detached; None if it has none): the objective is
    mean(losses) + the sum of ``extra_loss`` over pipeline ranks (reduce it for logging).
    ``peak_in_flight``: the most (micro-batch, chunk) activations held at once on this rank (from a forward to its
    B or W; an FB counts as one step), as ``pipeline.simulator`` counts them.
    """

    losses: list[Tensor]
    extra_loss: Tensor | None
    peak_in_flight: int


class SequentialStage:
    """A :class:`PipelineStage` from plain callables: ``chunks[c](x) -> output | (output, extra)``.

    The model's first chunk gets ``input_of(microbatch)``; every other chunk the received activation.
    """

    def __init__(self, chunks: Sequence[Callable[[Any], StageOutput]],
                 input_of: Callable[[Any], Any] = lambda mb: mb) -> None:
        self.chunks = list(chunks)
        self.input_of = input_of

    def forward_step(self, chunk: int, hidden: Tensor | None, microbatch: Any) -> StageOutput:
        return self.chunks[chunk](self.input_of(microbatch) if hidden is None else hidden)


@dataclass
class BackwardStep:
    """The backward half of an overlapped step, as the executor would run it alone:
    ``torch.autograd.backward(outputs, grads)`` for (``microbatch``, ``chunk``)."""

    chunk: int
    microbatch: Any
    outputs: list[Tensor]
    grads: list[Tensor | None]


class OverlappedStage(PipelineStage, Protocol):
    """A stage that runs an ``FB`` action as one overlapped step (``pipeline.overlap``): the forward of one
    (micro-batch, chunk) and the ``backward`` of another, interleaved. Without it an FB runs as F then B."""

    def forward_backward_step(self, chunk: int, hidden: Tensor | None, microbatch: Any,
                              backward: BackwardStep) -> StageOutput: ...


def run_schedule(stage: PipelineStage, schedule: Schedule, microbatches: Sequence[Any],
                 loss_fn: Callable[[Tensor, Any], Tensor], pp_group: Group, activation: TensorSpec,
                 weight_store: WeightGradStore | None = None, loss_scale: float = 1.0) -> PipelineResult:
    """Execute ``schedule``'s action list for this rank (forward and backward of one step).

    ``loss_scale`` (fp16 loss scaling): the backward starts from every loss times it, the extra losses' too
    (Megatron scales the MoE aux losses' gradients by the loss scale as well), so every gradient is ``loss_scale``
    times the objective's; the losses returned are unscaled.

    A ``forward_only`` schedule (evaluation) runs the forwards without autograd and keeps nothing.

    ``microbatches`` has ``schedule.num_microbatches`` entries on every rank (the first stage
    reads the inputs, the last the labels, any stage per-micro-batch metadata). ``activation``
    is the fixed spec of every tensor crossing stages (activations and their gradients).
    ``weight_store``: the stage model's ``WeightGradStore`` (``dense.split_backward``), needed by schedules with
    ``I``/``W`` actions: an ``I`` runs the backward with weight gradients deferred, its ``W`` runs them.
    What crosses ranks: only those tensors, to the neighbouring stages of ``pp_group`` (None at pp = 1).
    Gradients accumulate into the stage's parameters' ``.grad``.
    """
    pp = group_size(pp_group)
    if schedule.pp != pp:
        raise ValueError(f"schedule is for pp={schedule.pp} but the pipeline group has {pp} ranks")
    if len(microbatches) != schedule.num_microbatches:
        raise ValueError(f"got {len(microbatches)} micro-batches for a schedule of "
                         f"num_microbatches={schedule.num_microbatches}")
    if schedule.split_backward and weight_store is None:
        raise ValueError(f"the {schedule.name} schedule splits backwards into I and W: pass the model's "
                         "WeightGradStore (execution.split_backward.install_weight_grad_store) as weight_store")
    step = _RankStep(stage, schedule, microbatches, loss_fn, pp_group, activation, weight_store, loss_scale)
    run = {"F": step.forward, "B": step.backward, "I": step.backward, "W": step.weight, "FB": step.forward_backward}
    for item in split_batches(schedule.rank_actions(step.rank)):
        if isinstance(item, tuple):
            step.post(item)
        else:
            run[item.kind](item)
    return step.finish()


class _RankStep:
    """This rank's state while it runs one step of ``run_schedule``. Each tensor stays referenced only while
    it is needed (a forward's or backward's locals end with its method)."""

    def __init__(self, stage: PipelineStage, schedule: Schedule, microbatches: Sequence[Any],
                 loss_fn: Callable[[Tensor, Any], Tensor], pp_group: Group, activation: TensorSpec,
                 weight_store: WeightGradStore | None, loss_scale: float = 1.0) -> None:
        self.stage, self.schedule, self.microbatches, self.loss_fn = stage, schedule, microbatches, loss_fn
        self.pp_group, self.activation, self.weight_store = pp_group, activation, weight_store
        self.rank, self.m = group_rank(pp_group), schedule.num_microbatches
        self.loss_scale = loss_scale   # fp16: every loss backpropagated is scaled (1.0: exactly loss / m)
        self.last_mc = schedule.pp * schedule.vpp - 1
        self.posted: deque[P2PHandle] = deque()   # posted batches not yet waited on, in posting order
        self.inbox: dict[tuple[str, int, int], tuple[Tensor, P2PHandle]] = {}   # posted receives, until their compute
        self.outbox: dict[tuple[str, int, int], Tensor] = {}   # computed, until their send is posted
        self.local: dict[tuple[str, int, int], Tensor] = {}    # the V placement's turn: handed to this rank's chunk
        self.saved: dict[tuple[int, int], tuple[Tensor | None, Tensor, Tensor | None]] = {}   # until the backward
        self.deferred: dict[tuple[int, int], DeferredWeightGrads] = {}   # an I's weight gradients, until its W
        # the (micro-batch, chunk)s whose backward is an I: their forward builds split GEMMs (dense.split_backward)
        self.split = {(p.microbatch, p.chunk) for a in schedule.rank_actions(self.rank) for p in a.parts()
                      if p.kind is ActionKind.I}
        self.losses: list[tuple[int, Tensor]] = []
        self.extra_total: Tensor | None = None
        self.peak = 0

    def _mc(self, chunk: int) -> int:
        return model_chunk(self.rank, chunk, self.schedule.pp, self.schedule.placement)

    def _local(self, chunk: int, kind: str) -> bool:
        return is_local(self.rank, chunk, kind, self.schedule.pp, self.schedule.placement)

    def post(self, batch: tuple[Action, ...]) -> None:
        """Post one batch of sends/receives together; a receive is waited on only by its consumer."""
        sends, recvs = [], []
        for a in batch:
            peer = peer_of(a, self.rank, self.schedule.pp, self.schedule.placement)
            if a.kind.startswith("SEND"):
                sends.append((self.outbox.pop((a.kind[-1], a.microbatch, a.chunk)), peer))
            else:
                recvs.append((self.activation.empty(), peer))
        handle = batch_send_recv(sends, recvs, self.pp_group)
        received = iter(recvs)
        for a in batch:
            if a.kind.startswith("RECV"):
                self.inbox[(a.kind[-1], a.microbatch, a.chunk)] = (next(received)[0], handle)
        self.posted.append(handle)

    def received(self, key: tuple[str, int, int]) -> Tensor:
        """The tensor ``key`` from the previous/next chunk: handed over on this rank, or received (after waiting for
        its batch and, first, every batch posted before it)."""
        if key in self.local:
            return self.local.pop(key)
        buf, handle = self.inbox.pop(key)
        while not handle.done:
            self.posted.popleft().wait()
        return buf

    def _hand_on(self, kind: str, microbatch: int, chunk: int, tensor: Tensor) -> None:
        """An F's output / a B's input gradient: to the outbox, or to this rank's other chunk (the V's turn)."""
        if self._local(chunk, kind):
            pp, placement = self.schedule.pp, self.schedule.placement
            target = rank_and_chunk(self._mc(chunk) + (1 if kind == "F" else -1), pp, placement)[1]
            self.local[(kind, microbatch, target)] = tensor
        else:
            self.outbox[(kind, microbatch, chunk)] = tensor

    def _splitting(self, a: Action) -> AbstractContextManager:
        if self.weight_store is None:
            return nullcontext()
        return self.weight_store.splitting((a.microbatch, a.chunk) in self.split)

    def _forward_input(self, a: Action) -> Tensor | None:
        if self._mc(a.chunk) == 0:
            return None
        return self.received(("F", a.microbatch, a.chunk)).requires_grad_(not self.schedule.forward_only)

    def forward(self, a: Action, output: StageOutput | None = None, hidden: Tensor | None = None,
                count: bool = True) -> None:
        """``a``'s forward (``output``: already computed by an overlapped step, from input ``hidden``); ``count``:
        update the peak of held activations now (an FB counts once, after its backward half)."""
        forward_only = self.schedule.forward_only
        mc = self._mc(a.chunk)
        if output is None:
            hidden = self._forward_input(a)
            with torch.set_grad_enabled(torch.is_grad_enabled() and not forward_only), self._splitting(a):
                output = self.stage.forward_step(a.chunk, hidden, self.microbatches[a.microbatch])
        out, extra = output if isinstance(output, tuple) else (output, None)
        if extra is not None:
            self.extra_total = extra.detach() if self.extra_total is None else self.extra_total + extra.detach()
            extra = extra * self.loss_scale / self.m
        if mc == self.last_mc:
            loss = self.loss_fn(out, self.microbatches[a.microbatch])
            self.losses.append((a.microbatch, loss.detach()))
            out = loss * self.loss_scale / self.m
        else:
            self.activation.check(out, f"output of chunk {a.chunk} (model chunk {mc}) for micro-batch {a.microbatch}")
            self._hand_on("F", a.microbatch, a.chunk, out.detach())
        if not forward_only:
            self.saved[(a.microbatch, a.chunk)] = (hidden, out, extra)
            if count:
                self.peak = max(self.peak, len(self.saved))

    def _backward_step(self, a: Action) -> tuple[Tensor | None, BackwardStep]:
        hidden, out, extra = self.saved[(a.microbatch, a.chunk)]
        outputs = [out]
        grads = [None if self._mc(a.chunk) == self.last_mc else self.received(("B", a.microbatch, a.chunk))]
        if extra is not None:
            outputs.append(extra)
            grads.append(None)  # d(objective)/d(extra) = 1
        return hidden, BackwardStep(a.chunk, self.microbatches[a.microbatch], outputs, grads)

    def backward(self, a: Action, ran: tuple[Tensor | None, BackwardStep] | None = None) -> None:
        """A full backward ``B``, or an ``I`` (weight gradients deferred to its ``W``); ``ran``: the (input, step) an
        overlapped step already ran."""
        hidden, step = ran if ran is not None else self._backward_step(a)
        if ran is None:
            if a.kind is ActionKind.I:
                with self.weight_store.defer() as later:
                    torch.autograd.backward(step.outputs, step.grads)
                self.deferred[(a.microbatch, a.chunk)] = later
            else:
                torch.autograd.backward(step.outputs, step.grads)
        if a.kind is ActionKind.B:
            del self.saved[(a.microbatch, a.chunk)]
        if self._mc(a.chunk) > 0:
            grad = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            self._hand_on("B", a.microbatch, a.chunk, grad)

    def weight(self, a: Action) -> None:
        """``W``: the weight gradients its ``I`` deferred; the activations go with them."""
        self.deferred.pop((a.microbatch, a.chunk)).run()
        del self.saved[(a.microbatch, a.chunk)]

    def forward_backward(self, a: Action) -> None:
        """``FB``: one overlapped step where the stage can (``OverlappedStage``), else its F then its B."""
        f, b = a.parts()
        overlapped = getattr(self.stage, "forward_backward_step", None)
        if overlapped is None:
            self.forward(f, count=False)
            self.backward(b)
        else:
            hidden = self._forward_input(f)
            b_hidden, step = self._backward_step(b)
            with self._splitting(f):
                output = overlapped(f.chunk, hidden, self.microbatches[f.microbatch], step)
            self.forward(f, output, hidden, count=False)
            self.backward(b, ran=(b_hidden, step))
        # one step: its backward half releases activations layer by layer while its forward half takes them
        self.peak = max(self.peak, len(self.saved))

    def finish(self) -> PipelineResult:
        """Wait for the last sends; the step's result."""
        while self.posted:
            self.posted.popleft().wait()
        if self.saved or self.inbox or self.outbox or self.local or self.deferred:
            raise RuntimeError(f"rank {self.rank}: schedule left work behind: saved={sorted(self.saved)} "
                               f"inbox={sorted(self.inbox)} outbox={sorted(self.outbox)} local={sorted(self.local)} "
                               f"deferred={sorted(self.deferred)}")
        extra = None if self.extra_total is None else self.extra_total / self.m
        return PipelineResult(losses=[loss for _, loss in sorted(self.losses, key=lambda t: t[0])],
                              extra_loss=extra, peak_in_flight=self.peak)


def reduce_step_losses(result: PipelineResult, pp_group: Group, device: torch.device | str = "cpu") -> Tensor:
    """``[mean loss, total extra loss]`` of the step on every pipeline rank, for the metrics line.

    Collective over ``pp_group`` (one 2-element all-reduce): the loss lives on the last stage,
    each stage contributes its own extra losses. For logging only; gradients never need it.
    Pass the model's ``device`` on GPUs: NCCL reduces device tensors only, and a middle stage has
    no tensor here to infer it from.
    """
    values = torch.zeros(2, dtype=torch.float32, device=device)
    if result.losses:
        values[0] = torch.stack(result.losses).float().mean()
    if result.extra_loss is not None:
        values[1] = result.extra_loss.float()
    if group_size(pp_group) > 1:
        dist.all_reduce(values, group=pp_group)
    return values
