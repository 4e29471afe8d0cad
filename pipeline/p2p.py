"""Point-to-point between neighbouring pipeline stages: fixed shapes, async, batched.

Every micro-batch's activation (and its gradient) has the same shape and dtype, known to both
ends in advance (``TensorSpec``), so no shape handshake precedes a transfer. All sends and
receives of one step are posted together with ``dist.batch_isend_irecv`` on the pipeline group
passed in (one NCCL group call, which keeps two ranks that send to each other at the same time
from deadlocking); the caller waits on the returned handle before it reads a received tensor or
reuses a sent one. Works on gloo and NCCL. Peers are ranks *within* the pipeline group;
neighbours wrap around (the last stage's next is stage 0: interleaved chunks go round the ring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group, group_rank, group_size


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of one micro-batch's activation between stages (e.g. [S/tp, B, H])."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"

    def empty(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def check(self, tensor: Tensor, what: str) -> None:
        """ValueError if ``tensor`` does not have this spec's shape and dtype (it would be misread)."""
        if tuple(tensor.shape) != tuple(self.shape) or tensor.dtype != self.dtype:
            raise ValueError(f"{what} has shape {tuple(tensor.shape)} dtype {tensor.dtype}, but the pipeline "
                             f"moves fixed tensors of shape {tuple(self.shape)} dtype {self.dtype}")


@dataclass
class P2PHandle:
    """Outstanding transfers of one batch; ``wait()`` waits until all completed (on NCCL: makes the
    current stream wait for them, no host synchronisation).

    Idempotent: a gloo receive waited on twice would wait for a second message that never comes.
    After waiting it drops its works, which hold the batch's tensors (sent and receive buffers), so that
    each is freed as soon as its last other user lets it go.
    """

    works: tuple[dist.Work, ...]
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()
            self.works, self.done = (), True


def next_rank(group: Group) -> int:
    """Group rank of the next pipeline stage (wraps around)."""
    return (group_rank(group) + 1) % group_size(group)


def prev_rank(group: Group) -> int:
    """Group rank of the previous pipeline stage (wraps around)."""
    return (group_rank(group) - 1) % group_size(group)


def batch_send_recv(sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                    group: dist.ProcessGroup) -> P2PHandle:
    """Post ``sends`` [(tensor, peer)] and ``recvs`` [(buffer, peer)] as one batch; peers are group ranks.

    On each directed pair, transfers match in posting order (no tags): both ends must post their
    halves in the same order. Sent tensors must stay untouched until ``wait()``.
    """
    if group is None:
        raise ValueError("point-to-point needs a pipeline process group (pp > 1); got None")
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    if not ops:
        return P2PHandle(())
    return P2PHandle(tuple(w for w in dist.batch_isend_irecv(ops) if w is not None))


def send_forward(activation: Tensor, group: dist.ProcessGroup) -> P2PHandle:
    """Send a micro-batch's output activation to the next stage."""
    return batch_send_recv([(activation, next_rank(group))], [], group)


def recv_forward(spec: TensorSpec, group: dist.ProcessGroup) -> tuple[Tensor, P2PHandle]:
    """Receive a micro-batch's input activation from the previous stage (valid after ``wait()``)."""
    buf = spec.empty()
    return buf, batch_send_recv([], [(buf, prev_rank(group))], group)


def send_backward(grad: Tensor, group: dist.ProcessGroup) -> P2PHandle:
    """Send the gradient of a micro-batch's input back to the previous stage."""
    return batch_send_recv([(grad, prev_rank(group))], [], group)


def recv_backward(spec: TensorSpec, group: dist.ProcessGroup) -> tuple[Tensor, P2PHandle]:
    """Receive the gradient of a micro-batch's output from the next stage (valid after ``wait()``)."""
    buf = spec.empty()
    return buf, batch_send_recv([], [(buf, next_rank(group))], group)
