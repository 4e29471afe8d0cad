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
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group, group_rank, group_size
from moefold.pipeline.actions import Action, model_chunk, peer_of, split_batches
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
    ``peak_in_flight``: the most (micro-batch, chunk) activations held at once on this rank.
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


def run_schedule(stage: PipelineStage, schedule: Schedule, microbatches: Sequence[Any],
                 loss_fn: Callable[[Tensor, Any], Tensor], pp_group: Group, activation: TensorSpec,
                 loss_scale: float = 1.0) -> PipelineResult:
    """Execute ``schedule``'s action list for this rank (forward and backward of one step).

    ``loss_scale`` (fp16 loss scaling): the backward starts from every loss times it, the extra losses' too
    (Megatron scales the MoE aux losses' gradients by the loss scale as well), so every gradient is ``loss_scale``
    times the objective's; the losses returned are unscaled.

    A ``forward_only`` schedule (evaluation) runs the forwards without autograd and keeps nothing.

    ``microbatches`` has ``schedule.num_microbatches`` entries on every rank (the first stage
    reads the inputs, the last the labels, any stage per-micro-batch metadata). ``activation``
    is the fixed spec of every tensor crossing stages (activations and their gradients).
    What crosses ranks: only those tensors, to the neighbouring stages of ``pp_group``.
    Gradients accumulate into the stage's parameters' ``.grad``.
    """
    pp = group_size(pp_group)
    if schedule.pp != pp:
        raise ValueError(f"schedule is for pp={schedule.pp} but the pipeline group has {pp} ranks")
    if len(microbatches) != schedule.num_microbatches:
        raise ValueError(f"got {len(microbatches)} micro-batches for a schedule of "
                         f"num_microbatches={schedule.num_microbatches}")
    step = _RankStep(stage, schedule, microbatches, loss_fn, pp_group, activation, loss_scale)
    for item in split_batches(schedule.rank_actions(step.rank)):
        if isinstance(item, tuple):
            step.post(item)
        elif item.kind == "F":
            step.forward(item)
        else:
            step.backward(item)
    return step.finish()


class _RankStep:
    """This rank's state while it runs one step of ``run_schedule``. Each tensor stays referenced only while
    it is needed (a forward's or backward's locals end with its method)."""

    def __init__(self, stage: PipelineStage, schedule: Schedule, microbatches: Sequence[Any],
                 loss_fn: Callable[[Tensor, Any], Tensor], pp_group: Group, activation: TensorSpec,
                 loss_scale: float = 1.0) -> None:
        self.stage, self.schedule, self.microbatches, self.loss_fn = stage, schedule, microbatches, loss_fn
        self.pp_group, self.activation = pp_group, activation
        self.rank, self.m = group_rank(pp_group), schedule.num_microbatches
        self.loss_scale = loss_scale   # fp16: every loss backpropagated is scaled (1.0: exactly loss / m)
        self.last_mc = schedule.pp * schedule.vpp - 1
        self.posted: deque[P2PHandle] = deque()   # posted batches not yet waited on, in posting order
        self.inbox: dict[tuple[str, int, int], tuple[Tensor, P2PHandle]] = {}   # posted receives, until their compute
        self.outbox: dict[tuple[str, int, int], Tensor] = {}   # computed, until their send is posted
        self.saved: dict[tuple[int, int], tuple[Tensor | None, Tensor, Tensor | None]] = {}   # until the backward
        self.losses: list[tuple[int, Tensor]] = []
        self.extra_total: Tensor | None = None
        self.peak = 0

    def post(self, batch: tuple[Action, ...]) -> None:
        """Post one batch of sends/receives together; a receive is waited on only by its consumer."""
        sends, recvs = [], []
        for a in batch:
            peer = peer_of(a, self.rank, self.schedule.pp)
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
        """The received tensor ``key``, after waiting for its batch and, first, every batch posted before it."""
        buf, handle = self.inbox.pop(key)
        while not handle.done:
            self.posted.popleft().wait()
        return buf

    def forward(self, a: Action) -> None:
        forward_only = self.schedule.forward_only
        mc = model_chunk(self.rank, a.chunk, self.schedule.pp)
        hidden = None
        if mc > 0:
            hidden = self.received(("F", a.microbatch, a.chunk)).requires_grad_(not forward_only)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not forward_only):
            out = self.stage.forward_step(a.chunk, hidden, self.microbatches[a.microbatch])
        out, extra = out if isinstance(out, tuple) else (out, None)
        if extra is not None:
            self.extra_total = extra.detach() if self.extra_total is None else self.extra_total + extra.detach()
            extra = extra * self.loss_scale / self.m
        if mc == self.last_mc:
            loss = self.loss_fn(out, self.microbatches[a.microbatch])
            self.losses.append((a.microbatch, loss.detach()))
            out = loss * self.loss_scale / self.m
        else:
            self.activation.check(out, f"output of chunk {a.chunk} (model chunk {mc}) for micro-batch {a.microbatch}")
            self.outbox[("F", a.microbatch, a.chunk)] = out.detach()
        if not forward_only:
            self.saved[(a.microbatch, a.chunk)] = (hidden, out, extra)
            self.peak = max(self.peak, len(self.saved))

    def backward(self, a: Action) -> None:
        mc = model_chunk(self.rank, a.chunk, self.schedule.pp)
        hidden, out, extra = self.saved.pop((a.microbatch, a.chunk))
        outputs, grads = [out], [None if mc == self.last_mc else self.received(("B", a.microbatch, a.chunk))]
        if extra is not None:
            outputs.append(extra)
            grads.append(None)  # d(objective)/d(extra) = 1
        torch.autograd.backward(outputs, grads)
        if mc > 0:
            grad = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            self.outbox[("B", a.microbatch, a.chunk)] = grad

    def finish(self) -> PipelineResult:
        """Wait for the last sends; the step's result."""
        while self.posted:
            self.posted.popleft().wait()
        if self.saved or self.inbox or self.outbox:
            raise RuntimeError(f"rank {self.rank}: schedule left work behind: saved={sorted(self.saved)} "
                               f"inbox={sorted(self.inbox)} outbox={sorted(self.outbox)}")
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
