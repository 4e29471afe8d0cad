"""Check a schedule and time it: ordering, message matching, deadlock freedom, bubble, memory.

``validate(schedule)`` checks, per rank, that every (micro-batch, chunk) runs its forward and
backward (a full ``B``, or ``I`` then ``W``) exactly once, forward first, each after its input
(activation or gradient) was received (or, the V placement's turn, produced by the rank's other
chunk), each output sent; an ``FB`` counts as its forward and its backward; and, per directed pair
of ranks, that the k-th send matches the k-th receive (same message), since point-to-point
matching is FIFO.

``simulate(schedule)`` then executes the action lists on a virtual clock. Communication takes no
time. Models:

- ``semantics="rendezvous"`` (NCCL-like, the strict default): a rank's batches run in order on
  one communication stream; a transfer happens once both ends' streams have reached it;
- ``semantics="buffered"`` (gloo-like): sends complete at once, receives when their send is posted.

and ``wait="lazy"`` (the executor: only a compute waits, for the batch carrying its input) or
``wait="eager"`` (the rank blocks on every batch).

It raises :class:`DeadlockError` naming each stuck rank's pending batch if execution cannot
finish, and reports the bubble fraction (idle share of ``pp * makespan``) and the peak number of
(micro-batch, chunk) activations held at once on each rank (from its F to its B, or to its W: the
weight gradients need the saved inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from moefold.pipeline.actions import (
    Action,
    ActionKind,
    Message,
    is_local,
    message_of,
    model_chunk,
    rank_and_chunk,
    split_batches,
)
from moefold.pipeline.schedules import Schedule


class ScheduleError(ValueError):
    """The action lists are inconsistent (missing, duplicated, misordered or unmatched actions)."""


class DeadlockError(RuntimeError):
    """Simulated execution cannot finish: every unfinished rank waits on a peer."""


@dataclass(frozen=True)
class SimResult:
    """Timing of one simulated run. ``intervals[r]``: (start, end, action) of rank r's computes."""

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble_per_rank: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    intervals: tuple[tuple[tuple[float, float, Action], ...], ...]


def _input_chunk(part: Action, pp_rank: int, schedule: Schedule) -> tuple[bool, int] | None:
    """Where ``part`` (an F, B or I) gets its input from: None (the model's first F / last B), else (local?, the
    producing model chunk). Local: the producer is another chunk of this rank (the V placement's turn)."""
    pp, placement = schedule.pp, schedule.placement
    mc = model_chunk(pp_rank, part.chunk, pp, placement)
    src = mc - 1 if part.kind is ActionKind.F else mc + 1
    if src < 0 or src >= schedule.num_model_chunks:
        return None
    return rank_and_chunk(src, pp, placement)[0] == pp_rank, src


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError describing the first inconsistency (see module docstring)."""
    pp, vpp, m, placement = schedule.pp, schedule.vpp, schedule.num_microbatches, schedule.placement
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    if len(schedule.actions) != pp:
        raise ScheduleError(f"{len(schedule.actions)} action lists for pp={pp}")
    for r, actions in enumerate(schedule.actions):
        seen: set[tuple[str, int, int]] = set()
        for a in actions:
            for part in a.parts():
                if not (0 <= part.microbatch < m and 0 <= part.chunk < vpp):
                    raise ScheduleError(f"rank {r}: {a} is outside microbatches 0..{m - 1} / chunks 0..{vpp - 1}")
                key = (part.kind, part.microbatch, part.chunk)
                if schedule.forward_only and part.kind not in (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F):
                    raise ScheduleError(f"rank {r}: {a} in a forward-only schedule")
                backward_keys = [(k, part.microbatch, part.chunk) for k in (ActionKind.B, ActionKind.I)]
                if key in seen or (part.kind in (ActionKind.B, ActionKind.I) and any(k in seen for k in backward_keys)):
                    raise ScheduleError(f"rank {r}: {a} repeats a step of micro-batch {part.microbatch} chunk "
                                        f"{part.chunk}")
                _check_order(part, a, r, schedule, seen)
                seen.add(key)
                if not part.is_compute:
                    msg = message_of(part, r, pp, placement)
                    book = sent if part.kind.startswith("SEND") else received
                    book.setdefault((msg.src, msg.dst), []).append(msg)
        for i in range(m):
            for c in range(vpp):
                _check_complete(Action(ActionKind.F, i, c), r, schedule, seen)
    for channel in sorted(set(sent) | set(received)):
        s, rcv = sent.get(channel, []), received.get(channel, [])
        for k in range(max(len(s), len(rcv))):
            a = s[k] if k < len(s) else None
            b = rcv[k] if k < len(rcv) else None
            if a != b:
                raise ScheduleError(f"message #{k} from rank {channel[0]} to rank {channel[1]}: sent {a}, "
                                    f"but the receiver's #{k} receive expects {b} (point-to-point is FIFO)")


def _check_order(part: Action, action: Action, r: int, schedule: Schedule, seen: set) -> None:
    """``part`` of ``action`` comes after everything it needs on rank ``r`` (``seen``: what ran before)."""
    mb, c = part.microbatch, part.chunk
    pp, placement = schedule.pp, schedule.placement
    did_backward = (ActionKind.B, mb, c) in seen or (ActionKind.I, mb, c) in seen
    need: list[tuple[bool, str]] = []
    if part.kind in (ActionKind.F, ActionKind.B, ActionKind.I):
        source = _input_chunk(part, r, schedule)
        if source is not None:
            local, src_mc = source
            if local:
                src_chunk = rank_and_chunk(src_mc, pp, placement)[1]
                ok = (ActionKind.F, mb, src_chunk) in seen if part.kind is ActionKind.F else any(
                    (k, mb, src_chunk) in seen for k in (ActionKind.B, ActionKind.I))
                need.append((ok, f"{'F' if part.kind == 'F' else 'B/I'}(mb={mb}, chunk={src_chunk}) on this rank"))
            else:
                recv = ActionKind.RECV_F if part.kind is ActionKind.F else ActionKind.RECV_B
                need.append(((recv, mb, c) in seen, str(Action(recv, mb, c))))
        if part.kind is not ActionKind.F:
            need.append(((ActionKind.F, mb, c) in seen, str(Action(ActionKind.F, mb, c))))
    elif part.kind is ActionKind.W:
        need.append(((ActionKind.I, mb, c) in seen, str(Action(ActionKind.I, mb, c))))
    elif part.kind is ActionKind.SEND_F:
        need.append(((ActionKind.F, mb, c) in seen, str(Action(ActionKind.F, mb, c))))
    elif part.kind is ActionKind.SEND_B:
        need.append((did_backward, f"B/I(mb={mb}, chunk={c})"))
    for ok, what in need:
        if not ok:
            raise ScheduleError(f"rank {r}: {action} comes before {what}")
    if not part.is_compute:
        direction = "F" if part.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else "B"
        mc = model_chunk(r, c, pp, placement)
        out_of_model = (direction == "F" and mc == schedule.num_model_chunks - 1) or (direction == "B" and mc == 0)
        if out_of_model or is_local(r, c, direction, pp, placement):
            raise ScheduleError(f"rank {r}: {part} on model chunk {mc} has no peer")


def _check_complete(forward: Action, r: int, schedule: Schedule, seen: set) -> None:
    """Every step of (micro-batch, chunk) ran on rank ``r``: F, B or I+W, and each remote message."""
    mb, c, pp, placement = forward.microbatch, forward.chunk, schedule.pp, schedule.placement
    mc = model_chunk(r, c, pp, placement)
    last = schedule.num_model_chunks - 1
    wanted = [ActionKind.F]
    if not schedule.forward_only:
        split = (ActionKind.I, mb, c) in seen
        wanted += [ActionKind.I, ActionKind.W] if split else [ActionKind.B]
    if mc < last and not is_local(r, c, "F", pp, placement):
        wanted += [ActionKind.SEND_F] + ([] if schedule.forward_only else [ActionKind.RECV_B])
    if mc > 0 and not is_local(r, c, "B", pp, placement):
        wanted += [ActionKind.RECV_F] + ([] if schedule.forward_only else [ActionKind.SEND_B])
    for kind in wanted:
        if (kind, mb, c) not in seen:
            raise ScheduleError(f"rank {r}: {Action(kind, mb, c)} is missing")


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 1.0,
             duration: Callable[[int, Action], float] | None = None,
             semantics: Literal["rendezvous", "buffered"] = "rendezvous",
             wait: Literal["lazy", "eager"] = "lazy") -> SimResult:
    """Validate, then run the schedule on a virtual clock (see the module docstring).

    ``duration(pp_rank, action)`` overrides the per-kind times: ``forward_time`` for F, ``backward_time`` for B,
    half of it for I and for W, their sum for an FB (no overlap gain unless ``duration`` says so).
    ``wait="lazy"`` (what the executor does): posting a batch never blocks; a compute waits only
    for the batch that carries its input; under rendezvous a rank's batches complete in posting
    order (one communication stream). ``wait="eager"``: the rank blocks on every batch.
    """
    if semantics not in ("rendezvous", "buffered"):
        raise ValueError(f"semantics={semantics!r} must be 'rendezvous' or 'buffered'")
    if wait not in ("lazy", "eager"):
        raise ValueError(f"wait={wait!r} must be 'lazy' or 'eager'")
    validate(schedule)
    pp = schedule.pp
    if duration is None:
        per_kind = {ActionKind.F: forward_time, ActionKind.B: backward_time, ActionKind.I: backward_time / 2,
                    ActionKind.W: backward_time / 2, ActionKind.FB: forward_time + backward_time}
        duration = lambda r, a: per_kind[a.kind]
    placement = schedule.placement
    items = [split_batches(schedule.actions[r]) for r in range(pp)]
    # Where each message's two halves sit: (rank, item index) of its send and of its receive.
    where: dict[Message, dict[str, tuple[int, int]]] = {}
    for r in range(pp):
        for idx, item in enumerate(items[r]):
            if isinstance(item, tuple):
                for a in item:
                    where.setdefault(message_of(a, r, pp, placement), {})[a.kind[:4]] = (r, idx)
    posted: dict[tuple[int, int], float] = {}
    finished: dict[tuple[int, int], float] = {}
    previous_batch: list[dict[int, int | None]] = []
    for r in range(pp):
        prev, table = None, {}
        for idx, item in enumerate(items[r]):
            table[idx] = prev
            if isinstance(item, tuple):
                prev = idx
        previous_batch.append(table)

    resolving: set[tuple[int, int]] = set()

    def start(r: int, idx: int) -> float | None:
        """When batch ``idx`` of rank ``r`` is posted and (rendezvous) its stream reaches it."""
        if (r, idx) not in posted:
            return None
        prev = previous_batch[r][idx]
        if semantics == "buffered" or prev is None:
            return posted[(r, idx)]
        done = completion(r, prev)
        return None if done is None else max(posted[(r, idx)], done)

    def completion(r: int, idx: int) -> float | None:
        """When batch ``idx`` of rank ``r`` completes; None while that depends on the unknown.

        Rendezvous: every transfer happens once both ends' streams reach it. Buffered: a send
        completes when posted, a receive once its send is posted.
        """
        if (r, idx) in finished:
            return finished[(r, idx)]
        if (r, idx) in resolving:  # a wait cycle (so far): unknown
            return None
        resolving.add((r, idx))
        try:
            times = [start(r, idx)]
            for a in items[r][idx]:
                if semantics == "buffered":
                    if a.kind.startswith("RECV"):
                        times.append(posted.get(where[message_of(a, r, pp, placement)]["SEND"]))
                else:
                    times.append(start(*where[message_of(a, r, pp, placement)][
                        "RECV" if a.kind.startswith("SEND") else "SEND"]))
        finally:
            resolving.discard((r, idx))
        if any(t is None for t in times):
            return None
        finished[(r, idx)] = max(times)
        return finished[(r, idx)]

    clock = [0.0] * pp
    pos = [0] * pp
    busy = [0.0] * pp
    live = [0] * pp
    peak = [0] * pp
    intervals: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    while any(pos[r] < len(items[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(items[r]):
                item = items[r][pos[r]]
                if isinstance(item, Action):
                    ready, blocked = clock[r], False
                    for part in item.parts():
                        source = _input_chunk(part, r, schedule) if part.kind is not ActionKind.W else None
                        if source is None or source[0]:   # no input, or a local one (ran earlier on this rank)
                            continue
                        recv = Action(ActionKind.RECV_F if part.kind is ActionKind.F else ActionKind.RECV_B,
                                      part.microbatch, part.chunk)
                        done = completion(*where[message_of(recv, r, pp, placement)]["RECV"])
                        if done is None:
                            blocked = True
                            break
                        ready = max(ready, done)
                    if blocked:
                        break
                    d = duration(r, item)
                    if d <= 0:
                        raise ValueError(f"duration of {item} on rank {r} is {d}; it must be positive")
                    intervals[r].append((ready, ready + d, item))
                    clock[r] = ready + d
                    busy[r] += d
                    if not schedule.forward_only:  # forward-only keeps no activations
                        live[r] += sum(1 if p.kind is ActionKind.F else
                                       -1 if p.kind in (ActionKind.B, ActionKind.W) else 0 for p in item.parts())
                    peak[r] = max(peak[r], live[r])
                else:
                    posted.setdefault((r, pos[r]), clock[r])
                    if wait == "eager":
                        done = completion(r, pos[r])
                        if done is None:
                            break
                        clock[r] = done
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} at {_describe(items[r][pos[r]])}"
                              for r in range(pp) if pos[r] < len(items[r]))
            raise DeadlockError(f"{schedule.name} pp={pp} vpp={schedule.vpp} m={schedule.num_microbatches} "
                                f"deadlocks ({semantics}, {wait} waits): {stuck}")
    last_batches = [completion(r, j) for r in range(pp) for j in range(len(items[r]))
                    if isinstance(items[r][j], tuple)]
    if any(t is None for t in last_batches):
        raise DeadlockError(f"{schedule.name}: some communication never completes")
    makespan = max(clock + last_batches)
    return SimResult(makespan=makespan, busy=tuple(busy),
                     bubble_fraction=1.0 - sum(busy) / (pp * makespan),
                     bubble_per_rank=tuple(1.0 - b / makespan for b in busy),
                     peak_in_flight=tuple(peak), intervals=tuple(tuple(iv) for iv in intervals))


def _describe(item: Action | tuple[Action, ...]) -> str:
    return str(item) if isinstance(item, Action) else "[" + ", ".join(map(str, item)) + "]"
