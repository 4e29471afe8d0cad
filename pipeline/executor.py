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
``torch.autograd.backward([output, extra / m], [grad_from_next_stage, 1])``.
Every loss is scaled by 1/num_microbatches, so the gradients equal those of the mean loss
over the micro-batches of the unsplit model.

Each batch of communication is posted with one ``batch_isend_irecv`` without blocking; a
compute waits only for the receive that carries its input, and sends are waited on at the end
(their tensors stay referenced until then). The schedules (``pipeline.schedules``) are built so
that this cannot deadlock even under NCCL's rendezvous semantics with one in-order
communication stream (``pipeline.simulator`` checks it, ``wait="lazy"``); waiting lazily keeps
the textbook bubble when backward is slower than forward.
"""

from __future__ import annotations

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
                 loss_fn: Callable[[Tensor, Any], Tensor], pp_group: Group, activation: TensorSpec) -> PipelineResult:
    """Execute ``schedule``'s action list for this rank (forward and backward of one step).

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
    m = schedule.num_microbatches
    if len(microbatches) != m:
        raise ValueError(f"got {len(microbatches)} micro-batches for a schedule of num_microbatches={m}")
    rank = group_rank(pp_group)
    last_mc = pp * schedule.vpp - 1
    inbox: dict[tuple[str, int, int], tuple[Tensor, P2PHandle]] = {}  # posted receives, until their compute
    sending: list[P2PHandle] = []  # posted sends: their tensors must live until they complete
    outbox: dict[tuple[str, int, int], Tensor] = {}  # computed, waiting for their send
    saved: dict[tuple[int, int], tuple[Tensor | None, Tensor, Tensor | None]] = {}
    losses: list[tuple[int, Tensor]] = []
    extra_total: Tensor | None = None
    peak = 0
    for item in split_batches(schedule.rank_actions(rank)):
        if isinstance(item, tuple):
            sending.append(_communicate(item, rank, pp, pp_group, activation, inbox, outbox))
            continue
        a: Action = item
        mc = model_chunk(rank, a.chunk, pp)
        key = (a.microbatch, a.chunk)
        if a.kind == "F":
            hidden = None
            if mc > 0:
                hidden = _received(inbox, ("F", a.microbatch, a.chunk)).requires_grad_(not schedule.forward_only)
            with torch.set_grad_enabled(torch.is_grad_enabled() and not schedule.forward_only):
                out = stage.forward_step(a.chunk, hidden, microbatches[a.microbatch])
            out, extra = out if isinstance(out, tuple) else (out, None)
            if extra is not None:
                extra_total = extra.detach() if extra_total is None else extra_total + extra.detach()
                extra = extra / m
            if mc == last_mc:
                loss = loss_fn(out, microbatches[a.microbatch])
                losses.append((a.microbatch, loss.detach()))
                out = loss / m
            else:
                activation.check(out, f"output of chunk {a.chunk} (model chunk {mc}) for micro-batch {a.microbatch}")
                outbox[("F", a.microbatch, a.chunk)] = out.detach()
            if not schedule.forward_only:
                saved[key] = (hidden, out, extra)
                peak = max(peak, len(saved))
        else:
            hidden, out, extra = saved.pop(key)
            outputs, grads = [out], [None if mc == last_mc else _received(inbox, ("B", a.microbatch, a.chunk))]
            if extra is not None:
                outputs.append(extra)
                grads.append(None)  # d(objective)/d(extra) = 1
            torch.autograd.backward(outputs, grads)
            if mc > 0:
                grad = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
                outbox[("B", a.microbatch, a.chunk)] = grad
    for handle in sending:
        handle.wait()
    if saved or inbox or outbox:
        raise RuntimeError(f"rank {rank}: schedule left work behind: saved={sorted(saved)} "
                           f"inbox={sorted(inbox)} outbox={sorted(outbox)}")
    return PipelineResult(losses=[loss for _, loss in sorted(losses, key=lambda t: t[0])],
                          extra_loss=None if extra_total is None else extra_total / m, peak_in_flight=peak)


def _communicate(batch: tuple[Action, ...], rank: int, pp: int, pp_group: Group, activation: TensorSpec,
                 inbox: dict, outbox: dict) -> P2PHandle:
    """Post one batch of sends/receives together; a receive is waited on only by its consumer."""
    sends, recvs = [], []
    for a in batch:
        kind = a.kind[-1]
        peer = peer_of(a, rank, pp)
        if a.kind.startswith("SEND"):
            sends.append((outbox.pop((kind, a.microbatch, a.chunk)), peer))
        else:
            recvs.append((activation.empty(), peer))
    handle = batch_send_recv(sends, recvs, pp_group)
    received = iter(recvs)
    for a in batch:
        if a.kind.startswith("RECV"):
            inbox[(a.kind[-1], a.microbatch, a.chunk)] = (next(received)[0], handle)
    return handle


def _received(inbox: dict, key: tuple[str, int, int]) -> Tensor:
    buf, handle = inbox.pop(key)
    handle.wait()
    return buf


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
