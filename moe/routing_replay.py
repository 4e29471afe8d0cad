"""Routing replay for one MoE layer (Megatron-Core's ``--moe-enable-routing-replay``, ``router_replay.py``): record
the experts each token chose in one forward, and replay exactly those choices in a later forward and backward.

The RL case: a rollout (an inference pass) routed its tokens with the weights of that moment; training on the
rollout should send each token to the experts that produced it. Replay fixes the expert *ids*; the combine
weights are the *current* router's scores at those ids (``moe.scoring.route_scores``), so the router still
learns. Capacity dropping applies to the replayed ids by the same rule as to chosen ones; expert bias, group
limit and forced balancing play no part in a replayed selection (the bias update counts the replayed ids).

A layer's ``routing`` region (``MoERegions.routing``, installed only by ``MoELayer.configure(routing=...)``) is a
``RoutingTap``; the default ``LIVE_ROUTING`` lets the router choose. ``RoutingRecorder`` and ``RoutingReplayer`` are
the two taps this module gives; ``moefold.training.routing_replay`` installs one per layer of a model (its record
and replay contexts) and reads and writes the on-disk format. No module-level state: each tap belongs to one layer.

Token order a tap sees: ``ids_BSK`` int64 ``[B, S, K]`` global expert ids, this rank's micro-batch of ``B``
samples over its sequence ``S`` (the CP slice when cp > 1: every tp rank of a tp group sees the same), batch-first
like ``input_ids``. The layer maps that onto the tokens its router sees (the SP shard, or the 1/tp slice of the
tokens without SP: both the tp rank's contiguous chunk of the sequence-first ``[S * B]`` order) and all-gathers
the tp ranks' chunks back for a recording: the only thing that crosses ranks here, one ``[T, K]`` int64
all-gather over tp per recorded layer call.

Recompute. A layer recomputed in backward (activation checkpointing, ``dense.recompute``) routes again: under
replay it must take the same ids as its forward. A replayer hands forward call ``i`` micro-batch ``i``'s ids and a
call inside backward the ids of the earliest forward not yet recomputed (first in, first out: every schedule runs
one layer's backwards in the order of its forwards), as Megatron's ``REPLAY_BACKWARD`` does, without a switch.
A recorder records forward calls only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


def in_backward() -> bool:
    """True inside a backward pass (where a checkpointed region is recomputed). torch's own checkpoint asks the
    same (``torch.utils.checkpoint``); ``execution.offloader`` too."""
    return torch._C._current_graph_task_id() != -1


@runtime_checkable
class RoutingTap(Protocol):
    """Where one MoE layer's expert choices come from and go to, asked once per router call (module docstring)."""

    def replayed(self) -> Tensor | None:
        """int64 ``[B, S, K]`` ids for this call's tokens, or None: the router chooses."""
        ...

    def recording(self) -> bool:
        """Whether this call's choice goes to ``record`` (the layer then gathers it over tp)."""
        ...

    def record(self, ids_BSK: Tensor) -> None:
        """The ids the router chose in this call (before any capacity drop), int64 ``[B, S, K]``."""
        ...


class LiveRouting:
    """The default tap: the router chooses, nothing is kept."""

    def replayed(self) -> Tensor | None:
        return None

    def recording(self) -> bool:
        return False

    def record(self, ids_BSK: Tensor) -> None:
        raise RuntimeError("LIVE_ROUTING records nothing: install a RoutingRecorder to record")

    def __repr__(self) -> str:
        return "LIVE_ROUTING"


LIVE_ROUTING = LiveRouting()


class RoutingRecorder:
    """Records each forward call's choice, in call order (``calls``: one ``[B, S, K]`` int64 per call, on the layer's
    device). A recompute inside backward records nothing (it routes the same tokens again)."""

    def __init__(self) -> None:
        self.calls: list[Tensor] = []

    def replayed(self) -> Tensor | None:
        return None

    def recording(self) -> bool:
        return not in_backward()

    def record(self, ids_BSK: Tensor) -> None:
        self.calls.append(ids_BSK.detach())

    def __repr__(self) -> str:
        return f"RoutingRecorder({len(self.calls)} calls)"


class RoutingReplayer:
    """Replays ``micro_batches`` (one int64 ``[B, S, K]`` per forward call, in call order): forward call ``i`` gets
    ``micro_batches[i]``; a call inside backward (a recompute) the earliest forward's ids not yet recomputed.

    ``layer``: the layer's global index, for messages. A forward past the given micro-batches, or a recompute with
    no forward pending, is a RuntimeError naming the layer and the counts."""

    def __init__(self, micro_batches: Sequence[Tensor], layer: int | None = None) -> None:
        for i, ids in enumerate(micro_batches):
            if not isinstance(ids, Tensor) or ids.dim() != 3 or ids.dtype != torch.int64:
                what = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
                raise ValueError(f"RoutingReplayer{_at(layer)}: micro-batch {i}'s ids are {what}, expected an int64 "
                                 "[B, S, K] tensor")
        self.micro_batches = list(micro_batches)
        self.layer = layer
        self.used = 0                                # forward calls served
        self._recompute: deque[Tensor] = deque()    # forwards with grad, awaiting a possible recompute

    def replayed(self) -> Tensor:
        if in_backward():
            if not self._recompute:
                raise RuntimeError(f"routing replay{_at(self.layer)}: a recompute in backward with no forward pending "
                                   f"({self.used} forward calls served)")
            return self._recompute.popleft()
        if self.used >= len(self.micro_batches):
            raise RuntimeError(f"routing replay{_at(self.layer)}: forward call {self.used + 1}, but ids were given for "
                               f"{len(self.micro_batches)} micro-batches")
        ids = self.micro_batches[self.used]
        self.used += 1
        if torch.is_grad_enabled():   # a checkpointed forward is recomputed in backward, in this order
            self._recompute.append(ids)
        return ids

    def recording(self) -> bool:
        return False

    def record(self, ids_BSK: Tensor) -> None:
        raise RuntimeError("a RoutingReplayer records nothing")

    def __repr__(self) -> str:
        return f"RoutingReplayer({self.used}/{len(self.micro_batches)} micro-batches)"


def _at(layer: int | None) -> str:
    return "" if layer is None else f" (layer {layer})"


__all__ = ["LIVE_ROUTING", "LiveRouting", "RoutingRecorder", "RoutingReplayer", "RoutingTap", "in_backward"]
