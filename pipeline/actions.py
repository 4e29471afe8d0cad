"""The vocabulary of pipeline schedules: actions, where each model chunk lives, and where each message goes.

A schedule is, per pipeline rank, a list of :class:`Action`. ``chunk`` is always the *local*
virtual chunk of the rank that executes the action:

- ``F``: forward of micro-batch ``microbatch`` on local chunk ``chunk``.
- ``B``: its full backward (input and weight gradients).
- ``I`` / ``W``: the backward split in two (``dense.split_backward``): ``I`` computes the input gradient
  (what the previous chunk waits for), ``W`` later the weight gradients (zero-bubble schedules).
- ``FB``: the forward of (``microbatch``, ``chunk``) and the full backward of (``b_microbatch``, ``b_chunk``)
  run as one overlapped step (batch-level overlap: each one's expert exchange in flight while the other
  computes; ``pipeline.overlap``). It counts as that F and that B.
- ``SEND_F``: send the output of ``F(microbatch, chunk)`` to the next model chunk's rank.
- ``RECV_F``: receive the input of ``F(microbatch, chunk)`` from the previous model chunk's rank.
- ``SEND_B``: send the input gradient of ``B``/``I(microbatch, chunk)`` to the previous model chunk's rank.
- ``RECV_B``: receive the output gradient that ``B``/``I(microbatch, chunk)`` needs from the next one.

Consecutive communication actions form one *batch*: they are posted together (one
``batch_isend_irecv``) and waited on before the next compute action. On every directed pair of
ranks, messages are matched in order (FIFO), as NCCL and gloo point-to-point do without tags.

Placement: model chunk ``k`` (the forward order, 0 .. pp*vpp-1) lives on a rank and local chunk given by
``Placement``: ``interleaved`` (Megatron's: chunk c of rank r is model chunk ``c * pp + r``) or ``v``
(two chunks per rank, ZB-V / DualPipeV: rank r holds model chunks ``r`` and ``2pp - 1 - r``, so rank 0
holds the first and the last and the hand-over between ``pp - 1`` and ``pp`` stays on rank ``pp - 1``:
no message, ``is_local``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Literal


class ActionKind(StrEnum):
    """What an ``Action`` does (module docstring); the values are the schedules' printed names."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the schedules' name: the input-gradient half of a split backward)
    W = "W"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @classmethod
    def _missing_(cls, value: object) -> ActionKind:
        raise ValueError(f"action kind={value!r} must be one of {tuple(k.value for k in cls)}")


COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FB)
COMM_KINDS = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)


class Placement(str, Enum):
    """Which rank and local chunk hold each model chunk (module docstring)."""

    INTERLEAVED = "interleaved"
    V = "v"


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule (see the module docstring for what each kind means). ``b_microbatch`` and
    ``b_chunk`` are the backward half of an ``FB`` (-1 otherwise)."""

    kind: ActionKind
    microbatch: int
    chunk: int = 0
    b_microbatch: int = -1
    b_chunk: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))   # a schedule written as letters ("F", "I", ...)
        if (self.kind is ActionKind.FB) != (self.b_microbatch >= 0):
            raise ValueError(f"{self.kind}: b_microbatch={self.b_microbatch} is the backward half of an FB only")

    @staticmethod
    def overlapped(forward: Action, backward: Action) -> Action:
        """The ``FB`` of a forward and a full backward."""
        if forward.kind is not ActionKind.F or backward.kind is not ActionKind.B:
            raise ValueError(f"FB pairs a forward with a full backward, got {forward} and {backward}")
        return Action(ActionKind.FB, forward.microbatch, forward.chunk, backward.microbatch, backward.chunk)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def parts(self) -> tuple[Action, ...]:
        """The F/B/I/W this compute action consists of (an FB: its F and its B)."""
        if self.kind is ActionKind.FB:
            return (Action(ActionKind.F, self.microbatch, self.chunk),
                    Action(ActionKind.B, self.b_microbatch, self.b_chunk))
        return (self,)

    def __str__(self) -> str:
        if self.kind is ActionKind.FB:
            return f"FB(f mb={self.microbatch} chunk={self.chunk}, b mb={self.b_microbatch} chunk={self.b_chunk})"
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"


@dataclass(frozen=True)
class Message:
    """A point-to-point transfer: ``kind`` 'F' (activation) or 'B' (gradient) of ``microbatch``
    leaving model chunk ``src_model_chunk``; ``src``/``dst`` are pipeline ranks."""

    kind: Literal["F", "B"]
    microbatch: int
    src_model_chunk: int
    src: int
    dst: int


def model_chunk(pp_rank: int, chunk: int, pp: int, placement: Placement = Placement.INTERLEAVED) -> int:
    """Forward-order index of a rank's virtual chunk."""
    if placement == Placement.V:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def rank_and_chunk(model_chunk_id: int, pp: int, placement: Placement = Placement.INTERLEAVED) -> tuple[int, int]:
    """Inverse of :func:`model_chunk`: (pp_rank, local chunk)."""
    if placement == Placement.V:
        return (model_chunk_id, 0) if model_chunk_id < pp else (2 * pp - 1 - model_chunk_id, 1)
    return model_chunk_id % pp, model_chunk_id // pp


def next_model_chunk(pp_rank: int, chunk: int, kind: str, pp: int, placement: Placement) -> int:
    """The model chunk an F's output (kind 'F') or a B/I's input gradient (kind 'B') goes to."""
    mc = model_chunk(pp_rank, chunk, pp, placement)
    return mc + 1 if kind == "F" else mc - 1


def is_local(pp_rank: int, chunk: int, kind: str, pp: int, placement: Placement) -> bool:
    """The output of this F (or the input gradient of this B/I) stays on its rank (the V's turn)."""
    return rank_and_chunk(next_model_chunk(pp_rank, chunk, kind, pp, placement), pp, placement)[0] == pp_rank


def message_of(action: Action, pp_rank: int, pp: int, placement: Placement = Placement.INTERLEAVED) -> Message:
    """The message a communication action sends or receives, on rank ``pp_rank``."""
    mc = model_chunk(pp_rank, action.chunk, pp, placement)
    if action.kind is ActionKind.SEND_F:
        src_mc, dst_mc = mc, mc + 1
    elif action.kind is ActionKind.RECV_F:
        src_mc, dst_mc = mc - 1, mc
    elif action.kind is ActionKind.SEND_B:
        src_mc, dst_mc = mc, mc - 1
    elif action.kind is ActionKind.RECV_B:
        src_mc, dst_mc = mc + 1, mc
    else:
        raise ValueError(f"{action} is not a communication action")
    return Message(kind=action.kind[-1], microbatch=action.microbatch, src_model_chunk=src_mc,
                   src=rank_and_chunk(src_mc, pp, placement)[0], dst=rank_and_chunk(dst_mc, pp, placement)[0])


def peer_of(action: Action, pp_rank: int, pp: int, placement: Placement = Placement.INTERLEAVED) -> int:
    """The pipeline rank on the other end of a communication action."""
    msg = message_of(action, pp_rank, pp, placement)
    return msg.dst if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else msg.src


def split_batches(actions: list[Action] | tuple[Action, ...]) -> list[Action | tuple[Action, ...]]:
    """Group a rank's actions into compute actions and batches (tuples) of consecutive comm actions."""
    items: list[Action | tuple[Action, ...]] = []
    batch: list[Action] = []
    for a in actions:
        if a.is_compute:
            if batch:
                items.append(tuple(batch))
                batch = []
            items.append(a)
        else:
            batch.append(a)
    if batch:
        items.append(tuple(batch))
    return items
