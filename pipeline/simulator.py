"""Check a schedule and time it: ordering, message matching, deadlock freedom, bubble, memory.

``validate(schedule)`` checks, per rank, that every (micro-batch, chunk) runs its forward and
backward exactly once, forward first, each after its input (activation or gradient) was
received, each output sent; and, per directed pair of ranks, that the k-th send matches the k-th
receive (same message), since point-to-point matching is FIFO.

``simulate(schedule)`` then executes the action lists on a virtual clock. Communication takes no
time. Models:

- ``semantics="rendezvous"`` (NCCL-like, the strict default): a rank's batches run in order on
  one communication stream; a transfer happens once both ends' streams have reached it;
- ``semantics="buffered"`` (gloo-like): sends complete at once, receives when their send is posted.

and ``wait="lazy"`` (the executor: only a compute waits, for the batch carrying its input) or
``wait="eager"`` (the rank blocks on every batch).

It raises :class:`DeadlockError` naming each stuck rank's pending batch if execution cannot
finish, and reports the bubble fraction (idle share of ``pp * makespan``) and the peak number of
(micro-batch, chunk) activations held at once on each rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from moefold.pipeline.actions import Action, Message, message_of, model_chunk, split_batches
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


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError describing the first inconsistency (see module docstring)."""
    pp, vpp, m = schedule.pp, schedule.vpp, schedule.num_microbatches
    last_mc = pp * vpp - 1
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    if len(schedule.actions) != pp:
        raise ScheduleError(f"{len(schedule.actions)} action lists for pp={pp}")
    for r, actions in enumerate(schedule.actions):
        seen: set[tuple[str, int, int]] = set()
        for a in actions:
            if not (0 <= a.microbatch < m and 0 <= a.chunk < vpp):
                raise ScheduleError(f"rank {r}: {a} is outside microbatches 0..{m - 1} / chunks 0..{vpp - 1}")
            key = (a.kind, a.microbatch, a.chunk)
            if schedule.forward_only and a.kind in ("B", "SEND_B", "RECV_B"):
                raise ScheduleError(f"rank {r}: {a} in a forward-only schedule")
            if key in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            mc = model_chunk(r, a.chunk, pp)
            needs = {"F": [("RECV_F", mc > 0)], "B": [("F", True), ("RECV_B", mc < last_mc)],
                     "SEND_F": [("F", True)], "SEND_B": [("B", True)]}.get(a.kind, [])
            for before, required in needs:
                if required and (before, a.microbatch, a.chunk) not in seen:
                    raise ScheduleError(f"rank {r}: {a} comes before {Action(before, a.microbatch, a.chunk)}")
            if (a.kind in ("RECV_F", "SEND_B") and mc == 0) or (a.kind in ("SEND_F", "RECV_B") and mc == last_mc):
                raise ScheduleError(f"rank {r}: {a} on model chunk {mc} has no peer")
            seen.add(key)
            if not a.is_compute:
                msg = message_of(a, r, pp)
                book = sent if a.kind.startswith("SEND") else received
                book.setdefault((msg.src, msg.dst), []).append(msg)
        for i in range(m):
            for c in range(vpp):
                mc = model_chunk(r, c, pp)
                wanted = ["F", "B"] + (["SEND_F", "RECV_B"] if mc < last_mc else []) + (
                    ["RECV_F", "SEND_B"] if mc > 0 else [])
                if schedule.forward_only:
                    wanted = [k for k in wanted if k in ("F", "SEND_F", "RECV_F")]
                for kind in wanted:
                    if (kind, i, c) not in seen:
                        raise ScheduleError(f"rank {r}: {Action(kind, i, c)} is missing")
    for channel in sorted(set(sent) | set(received)):
        s, rcv = sent.get(channel, []), received.get(channel, [])
        for k in range(max(len(s), len(rcv))):
            a = s[k] if k < len(s) else None
            b = rcv[k] if k < len(rcv) else None
            if a != b:
                raise ScheduleError(f"message #{k} from rank {channel[0]} to rank {channel[1]}: sent {a}, "
                                    f"but the receiver's #{k} receive expects {b} (point-to-point is FIFO)")


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 1.0,
             duration: Callable[[int, Action], float] | None = None,
             semantics: Literal["rendezvous", "buffered"] = "rendezvous",
             wait: Literal["lazy", "eager"] = "lazy") -> SimResult:
    """Validate, then run the schedule on a virtual clock (see the module docstring).

    ``duration(pp_rank, action)`` overrides the per-kind ``forward_time`` / ``backward_time``.
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
        duration = lambda r, a: forward_time if a.kind == "F" else backward_time
    items = [split_batches(schedule.actions[r]) for r in range(pp)]
    # Where each message's two halves sit: (rank, item index) of its send and of its receive.
    where: dict[Message, dict[str, tuple[int, int]]] = {}
    for r in range(pp):
        for idx, item in enumerate(items[r]):
            if isinstance(item, tuple):
                for a in item:
                    where.setdefault(message_of(a, r, pp), {})[a.kind[:4]] = (r, idx)
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
                        times.append(posted.get(where[message_of(a, r, pp)]["SEND"]))
                else:
                    times.append(start(*where[message_of(a, r, pp)]["RECV" if a.kind.startswith("SEND") else "SEND"]))
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
                    ready = clock[r]
                    if item.kind == "F" or item.kind == "B":
                        recv = "RECV_F" if item.kind == "F" else "RECV_B"
                        msg = message_of(Action(recv, item.microbatch, item.chunk), r, pp) if _has_input(
                            item, r, schedule) else None
                        if msg is not None:
                            done = completion(*where[msg]["RECV"])
                            if done is None:
                                break
                            ready = max(ready, done)
                    d = duration(r, item)
                    if d <= 0:
                        raise ValueError(f"duration of {item} on rank {r} is {d}; it must be positive")
                    intervals[r].append((ready, ready + d, item))
                    clock[r] = ready + d
                    busy[r] += d
                    if not schedule.forward_only:  # forward-only keeps no activations
                        live[r] += 1 if item.kind == "F" else -1
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


def _has_input(action: Action, pp_rank: int, schedule: Schedule) -> bool:
    """Whether a compute receives its input from another rank (all but the model's first F / last B)."""
    mc = model_chunk(pp_rank, action.chunk, schedule.pp)
    return mc > 0 if action.kind == "F" else mc < schedule.pp * schedule.vpp - 1


def _describe(item: Action | tuple[Action, ...]) -> str:
    return str(item) if isinstance(item, Action) else "[" + ", ".join(map(str, item)) + "]"
