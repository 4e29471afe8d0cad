"""Pipeline schedules as explicit lists of actions per rank: GPipe, 1F1B, interleaved 1F1B.

A schedule is built in two steps:

1. the *compute order* of each rank (which forward/backward runs next), as in the literature and
   in Megatron-LM (warm-up forwards, steady 1F1B, cool-down backwards);
2. the *communication placement*, derived from that order: the order is timed (forward 1,
   backward ``backward_ratio``, default 2), every send is placed right after the compute that produces it, and the
   matching receive in the receiver's batch at that same moment (after its last compute that ends
   no later). Both ends of every message therefore sit at the same instant of one consistent
   timeline and each rank's batches are in time order, so every wait (a compute on its input, a
   batch on the peer's half or on the rank's previous batch) points to a strictly earlier
   instant: no wait cycle, hence no deadlock, can form, even under NCCL's rendezvous semantics
   with one in-order communication stream and whatever the real compute times. For 1F1B this
   reproduces Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward`` pairs.

``pipeline.simulator.simulate`` checks and times the result; ``pipeline.executor`` runs it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from moefold.pipeline.actions import Action, message_of, model_chunk, rank_and_chunk

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Schedule:
    """``actions[r]`` is pipeline rank r's action list; ``vpp`` virtual chunks per rank."""

    name: str
    pp: int
    vpp: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    forward_only: bool = False

    def rank_actions(self, pp_rank: int) -> tuple[Action, ...]:
        return self.actions[pp_rank]


def check_schedule_config(name: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """ValueError naming the numbers when (name, pp, vpp, microbatches) is not a valid schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not one of {SCHEDULES}")
    for label, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}={value!r} must be a positive integer")
    if name == "interleaved":
        if pp < 2:
            raise ValueError(f"the interleaved schedule needs pp >= 2, got pp={pp}")
        if num_microbatches % pp != 0:
            raise ValueError(f"the interleaved schedule needs num_microbatches={num_microbatches} to be a "
                             f"multiple of pp={pp} (e.g. {pp * max(1, round(num_microbatches / pp))})")
    elif vpp != 1:
        raise ValueError(f"schedule={name!r} runs one chunk per rank, got vpp={vpp}; use 'interleaved' for vpp > 1")


def compute_order(name: str, pp: int, vpp: int, num_microbatches: int, pp_rank: int) -> list[Action]:
    """The forward/backward order of one rank (no communication)."""
    m = num_microbatches
    if name == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if name == "1f1b":
        warmup = min(pp - pp_rank - 1, m)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        return order + [Action("B", i) for i in range(m - warmup, m)]
    # Interleaved 1F1B, Megatron-LM's order: virtual micro-batch k runs micro-batch
    # (k // (pp*vpp)) * pp + k % pp on chunk (k // pp) % vpp (reversed chunks for backward).
    total = m * vpp
    warmup = total if m == pp else min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp, total)

    def virtual(k: int, kind: str) -> Action:
        group, pos = divmod(k, pp * vpp)
        chunk = pos // pp
        return Action(kind, group * pp + pos % pp, chunk if kind == "F" else vpp - 1 - chunk)

    order = [virtual(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        order += [virtual(warmup + i, "F"), virtual(i, "B")]
    return order + [virtual(k, "B") for k in range(total - warmup, total)]


def timed_compute_orders(orders: list[list[Action]], pp: int, vpp: int,
                         forward_time: float = 1.0, backward_time: float = 1.0) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action when data moves instantly and never blocks a sender.

    ``F(mb)`` on model chunk k waits for ``F(mb)`` on k-1; ``B(mb)`` on k for ``B(mb)`` on k+1.
    Raises ValueError if the orders cannot run (a dependency cycle or a missing action).
    """
    last_mc = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    pos = [0] * pp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                mc = model_chunk(r, a.chunk, pp)
                if a.kind == "F":
                    dep = ("F", a.microbatch, mc - 1) if mc > 0 else None
                else:
                    if ("F", a.microbatch, mc) not in done:
                        raise ValueError(f"rank {r}: {a} comes before its forward")
                    dep = ("B", a.microbatch, mc + 1) if mc < last_mc else None
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                end = start + (forward_time if a.kind == "F" else backward_time)
                done[(a.kind, a.microbatch, mc)] = end
                times[r].append((start, end))
                clock[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(pp) if pos[r] < len(orders[r])}
            raise ValueError(f"compute orders cannot run: every rank waits for data (next actions {stuck})")
    return times


def place_communication(orders: list[list[Action]], pp: int, vpp: int,
                        backward_ratio: float = 2.0) -> tuple[tuple[Action, ...], ...]:
    """Insert SEND/RECV actions into compute orders (see the module docstring for the rule).

    The orders are timed with forward 1 and backward ``backward_ratio`` (typical: 2). Any positive
    ratio gives a deadlock-free placement; one close to the real ratio needs the fewest waits.
    """
    if not backward_ratio > 0:
        raise ValueError(f"backward_ratio={backward_ratio!r} must be positive")
    times = timed_compute_orders(orders, pp, vpp, 1.0, backward_ratio)
    ends = [[end for _, end in rank] for rank in times]  # ascending per rank
    last_mc = pp * vpp - 1
    # after[r][i]: comm actions posted after rank r's i-th compute (i = -1: before the first).
    after: list[dict[int, list[tuple[float, int, Action]]]] = [{} for _ in range(pp)]
    for r in range(pp):
        for i, a in enumerate(orders[r]):
            mc = model_chunk(r, a.chunk, pp)
            sends = (a.kind == "F" and mc < last_mc) or (a.kind == "B" and mc > 0)
            if not sends:
                continue
            sent_at = times[r][i][1]
            dst_mc = mc + 1 if a.kind == "F" else mc - 1
            dst, dst_chunk = rank_and_chunk(dst_mc, pp)
            after[r].setdefault(i, []).append((sent_at, 0, Action("SEND_" + a.kind, a.microbatch, a.chunk)))
            # Receiver: after its last compute that ends no later than the send.
            j = bisect.bisect_right(ends[dst], sent_at) - 1
            after[dst].setdefault(j, []).append((sent_at, 1, Action("RECV_" + a.kind, a.microbatch, dst_chunk)))
    out = []
    for r in range(pp):
        seq: list[Action] = []
        for i in range(-1, len(orders[r])):
            if i >= 0:
                seq.append(orders[r][i])
            # Sends first, then receives in send-time order: FIFO order on every channel.
            seq += [a for _, _, a in sorted(after[r].get(i, []), key=lambda t: (t[0], t[1], message_key(t[2], r, pp)))]
        out.append(tuple(seq))
    return tuple(out)


def message_key(action: Action, pp_rank: int, pp: int) -> tuple:
    msg = message_of(action, pp_rank, pp)
    return (msg.src, msg.kind, msg.microbatch, msg.src_model_chunk)


def build_schedule(name: str, pp: int, num_microbatches: int, vpp: int = 1, forward_only: bool = False,
                   backward_ratio: float = 2.0) -> Schedule:
    """The full action lists of schedule ``name`` ('gpipe', '1f1b', 'interleaved') for every rank.

    ``forward_only`` (evaluation) keeps the schedule's forwards, in order, and their sends/receives.
    ``backward_ratio``: backward/forward time assumed to place the communication. Executed with
    lazy waits (as ``pipeline.executor`` does), the interleaved schedule then keeps the textbook
    bubble both for equal times and for backward = 2 x forward.
    """
    check_schedule_config(name, pp, vpp, num_microbatches)
    orders = [compute_order(name, pp, vpp, num_microbatches, r) for r in range(pp)]
    if forward_only:
        orders = [[a for a in order if a.kind == "F"] for order in orders]
    return Schedule(name=name, pp=pp, vpp=vpp, num_microbatches=num_microbatches,
                    actions=place_communication(orders, pp, vpp, backward_ratio), forward_only=forward_only)


def expected_bubble_fraction(name: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Textbook bubble fraction with equal forward and backward times: (p-1)/(v*m+p-1)."""
    v = vpp if name == "interleaved" else 1
    return (pp - 1) / (v * num_microbatches + pp - 1)
