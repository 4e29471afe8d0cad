"""The vocabulary of pipeline schedules: actions, and where each message goes.

A schedule is, per pipeline rank, a list of :class:`Action`. ``chunk`` is always the *local*
virtual chunk of the rank that executes the action:

- ``F`` / ``B``: forward / backward of micro-batch ``microbatch`` on local chunk ``chunk``.
- ``SEND_F``: send the output of ``F(microbatch, chunk)`` to the next model chunk's rank.
- ``RECV_F``: receive the input of ``F(microbatch, chunk)`` from the previous model chunk's rank.
- ``SEND_B``: send the input gradient of ``B(microbatch, chunk)`` to the previous model chunk's rank.
- ``RECV_B``: receive the output gradient that ``B(microbatch, chunk)`` needs from the next one.

Consecutive communication actions form one *batch*: they are posted together (one
``batch_isend_irecv``) and waited on before the next compute action. On every directed pair of
ranks, messages are matched in order (FIFO), as NCCL and gloo point-to-point do without tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule (see the module docstring for what each kind means)."""

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"action kind={self.kind!r} must be one of {COMPUTE_KINDS + COMM_KINDS}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
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


def model_chunk(pp_rank: int, chunk: int, pp: int) -> int:
    """Forward-order index of a rank's virtual chunk (interleaved assignment)."""
    return chunk * pp + pp_rank


def rank_and_chunk(model_chunk_id: int, pp: int) -> tuple[int, int]:
    """Inverse of :func:`model_chunk`: (pp_rank, local chunk)."""
    return model_chunk_id % pp, model_chunk_id // pp


def message_of(action: Action, pp_rank: int, pp: int) -> Message:
    """The message a communication action sends or receives, on rank ``pp_rank``."""
    mc = model_chunk(pp_rank, action.chunk, pp)
    if action.kind == "SEND_F":
        src_mc, dst_mc = mc, mc + 1
    elif action.kind == "RECV_F":
        src_mc, dst_mc = mc - 1, mc
    elif action.kind == "SEND_B":
        src_mc, dst_mc = mc, mc - 1
    elif action.kind == "RECV_B":
        src_mc, dst_mc = mc + 1, mc
    else:
        raise ValueError(f"{action} is not a communication action")
    return Message(kind=action.kind[-1], microbatch=action.microbatch, src_model_chunk=src_mc,
                   src=rank_and_chunk(src_mc, pp)[0], dst=rank_and_chunk(dst_mc, pp)[0])


def peer_of(action: Action, pp_rank: int, pp: int) -> int:
    """The pipeline rank on the other end of a communication action."""
    msg = message_of(action, pp_rank, pp)
    return msg.dst if action.kind.startswith("SEND") else msg.src


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
