"""Pipeline schedules as explicit lists of actions per rank: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV.

A schedule is built in two steps:

1. the *compute order* of each rank (``pipeline.compute_orders``: which F / B / I / W / FB runs next), as in the
   literature and in Megatron-LM / torch.distributed.pipelining;
2. the *communication placement*, derived from that order: the order is timed (forward 1 x the chunk's cost,
   full backward ``backward_ratio`` x, ``I`` and ``W`` half of it each, an ``FB`` the sum of its halves), every send
   is placed right after the compute that produces it, and the matching receive in the receiver's batch at that
   same moment (after its last compute that ends no later; or, when the receiver's next compute starts before the
   send and does not take the message, after that compute: a batch completes as a whole, and waiting for it
   would stall a compute on a message it does not need). Each rank's batches are in time order and every wait (a
   compute on its input, a batch on the peer's half or on the rank's previous batch) points to an earlier instant
   of one consistent timeline: no wait cycle, hence no deadlock, can form, even under NCCL's rendezvous semantics
   with one in-order communication stream and whatever the real compute times. For 1F1B this reproduces Megatron's
   ``send_forward_recv_backward`` / ``send_backward_recv_forward`` pairs. A hand-over between two chunks of one
   rank (the V placement's turn) is no message.

``chunk_costs[r][c]``: the relative forward time of rank r's chunk c (e.g. its layer count; default equal):
only the placement's timing uses it, so any per-stage layer assignment gets its waits placed for its own
durations (deadlock freedom holds for any costs).

``pipeline.simulator.simulate`` checks and times the result; ``pipeline.executor`` runs it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from moefold.pipeline.actions import Action, ActionKind, Placement, is_local, message_of, model_chunk, rank_and_chunk
from moefold.pipeline.compute_orders import compute_order

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")      # run I and W: the model's GEMMs need a WeightGradStore
V_SCHEDULES = ("zbv", "dualpipev")                   # two chunks per rank in V placement
OVERLAP_SCHEDULES = ("1f1b", "interleaved", "dualpipev")   # run FB pairs (1f1b, interleaved: made by overlap=True)


@dataclass(frozen=True)
class Schedule:
    """``actions[r]`` is pipeline rank r's action list; ``vpp`` virtual chunks per rank, placed by ``placement``."""

    name: str
    pp: int
    vpp: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    forward_only: bool = False
    placement: Placement = Placement.INTERLEAVED

    @property
    def overlap(self) -> bool:
        """Whether some action is an FB pair (batch-level overlap, DualPipeV)."""
        return any(a.kind is ActionKind.FB for actions in self.actions for a in actions)

    def rank_actions(self, pp_rank: int) -> tuple[Action, ...]:
        return self.actions[pp_rank]

    @property
    def split_backward(self) -> bool:
        """Whether some action is an ``I``/``W`` (the model must defer weight gradients)."""
        return any(a.kind is ActionKind.W for actions in self.actions for a in actions)

    @property
    def num_model_chunks(self) -> int:
        return self.pp * self.vpp


def placement_of(name: str) -> Placement:
    return Placement.V if name in V_SCHEDULES else Placement.INTERLEAVED


def check_schedule_config(name: str, pp: int, vpp: int, num_microbatches: int, overlap: bool = False) -> None:
    """ValueError naming the numbers when (name, pp, vpp, microbatches) is not a valid schedule."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not one of {SCHEDULES}")
    for label, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}={value!r} must be a positive integer")
    if overlap and name not in OVERLAP_SCHEDULES:
        raise ValueError(f"batch-level overlap (--overlap-moe-expert-parallel-comm) runs with the "
                         f"{', '.join(OVERLAP_SCHEDULES)} schedules; {name!r} has no forward/backward pairs to "
                         f"overlap")
    if overlap and name == "1f1b" and pp > 1:
        raise ValueError(f"batch-level overlap (--overlap-moe-expert-parallel-comm) at pp={pp} needs virtual pipeline "
                         f"stages (the interleaved schedule, --num-layers-per-virtual-pipeline-stage): with one chunk "
                         f"per rank each overlapped step waits for its neighbour's, which halves the throughput "
                         f"(Megatron refuses it too)")
    if name == "interleaved":
        if pp < 2:
            raise ValueError(f"the interleaved schedule needs pp >= 2, got pp={pp}")
        if num_microbatches % pp != 0:
            raise ValueError(f"the interleaved schedule needs num_microbatches={num_microbatches} to be a "
                             f"multiple of pp={pp} (e.g. {pp * max(1, round(num_microbatches / pp))})")
    elif name in V_SCHEDULES:
        if vpp != 2:
            raise ValueError(f"the {name} schedule runs 2 chunks per rank in V placement, got vpp={vpp}; "
                             f"set --num-layers-per-virtual-pipeline-stage to num_layers / (2 pp)")
        if name == "dualpipev" and num_microbatches < 2 * pp:
            raise ValueError(f"the dualpipev schedule needs num_microbatches >= 2 x pp = {2 * pp} (one per "
                             f"stage), got {num_microbatches}")
    elif vpp != 1:
        raise ValueError(f"schedule={name!r} runs one chunk per rank, got vpp={vpp}; use 'interleaved' for vpp > 1 "
                         "(or 'zbv' / 'dualpipev' for 2 chunks in V placement)")


@dataclass(frozen=True)
class RelativeTimes:
    """Action times relative to a chunk's forward (1): full ``backward``, its ``weight`` part W (None: half; I is
    the rest) and an ``overlapped`` forward + backward FB (None: their sum)."""

    backward: float = 2.0
    weight: float | None = None
    overlapped: float | None = None

    def __post_init__(self) -> None:
        if not self.backward > 0:
            raise ValueError(f"backward_ratio={self.backward!r} must be positive")
        if self.weight is not None and not 0 < self.weight < self.backward:
            raise ValueError(f"weight_ratio={self.weight!r} must lie in (0, backward_ratio={self.backward})")
        if self.overlapped is not None and not self.overlapped > 0:
            raise ValueError(f"overlapped_ratio={self.overlapped!r} must be positive")

    def of(self, kind: ActionKind) -> float:
        weight = self.backward / 2 if self.weight is None else self.weight
        return {ActionKind.F: 1.0, ActionKind.B: self.backward, ActionKind.I: self.backward - weight,
                ActionKind.W: weight,
                ActionKind.FB: 1.0 + self.backward if self.overlapped is None else self.overlapped}[kind]


def timed_compute_orders(orders: list[list[Action]], pp: int, vpp: int, forward_time: float = 1.0,
                         backward_time: float = 1.0, placement: Placement = Placement.INTERLEAVED,
                         chunk_costs: Sequence[Sequence[float]] | None = None,
                         times: RelativeTimes | None = None) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action when data moves instantly and never blocks a sender.

    ``F(mb)`` on model chunk k waits for ``F(mb)`` on k-1; ``B``/``I(mb)`` on k for the input gradient of k+1 (its
    ``B``/``I``) and its own ``F``; ``W`` for its ``I``. Raises ValueError if the orders cannot run (a dependency
    cycle or a missing action).
    """
    last_mc = pp * vpp - 1
    times = times or RelativeTimes(backward_time / forward_time)
    done: dict[tuple[str, int, int], float] = {}
    timed: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    pos = [0] * pp

    def deps(r: int, a: Action) -> list[tuple[str, int, int]]:
        out = []
        for part in a.parts():
            mc = model_chunk(r, part.chunk, pp, placement)
            if part.kind is ActionKind.F:
                if mc > 0:
                    out.append(("F", part.microbatch, mc - 1))
            elif part.kind is ActionKind.W:
                out.append(("G", part.microbatch, mc))
            else:   # B or I: its own forward ran earlier on this rank, the next chunk's input gradient arrives
                if ("F", part.microbatch, mc) not in done:
                    raise ValueError(f"rank {r}: {part} comes before its forward")
                if mc < last_mc:
                    out.append(("G", part.microbatch, mc + 1))
        return out

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                needed = deps(r, a)
                if any(d not in done for d in needed):
                    break
                start = max([clock[r]] + [done[d] for d in needed])
                cost = 1.0 if chunk_costs is None else chunk_costs[r][a.chunk]
                if a.kind is ActionKind.FB and chunk_costs is not None:   # the mean of its halves' costs, by time
                    f, b = times.of(ActionKind.F), times.of(ActionKind.B)
                    cost = (f * chunk_costs[r][a.chunk] + b * chunk_costs[r][a.b_chunk]) / (f + b)
                end = start + forward_time * cost * times.of(a.kind)
                for part in a.parts():
                    mc = model_chunk(r, part.chunk, pp, placement)
                    step = ("F" if part.kind is ActionKind.F else
                            "G" if part.kind in (ActionKind.B, ActionKind.I) else "W")
                    done[(step, part.microbatch, mc)] = end
                timed[r].append((start, end))
                clock[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(pp) if pos[r] < len(orders[r])}
            raise ValueError(f"compute orders cannot run: every rank waits for data (next actions {stuck})")
    return timed


def place_communication(orders: list[list[Action]], pp: int, vpp: int, backward_ratio: float = 2.0,
                        placement: Placement = Placement.INTERLEAVED,
                        chunk_costs: Sequence[Sequence[float]] | None = None,
                        times: RelativeTimes | None = None) -> tuple[tuple[Action, ...], ...]:
    """Insert SEND/RECV actions into compute orders (see the module docstring for the rule).

    The orders are timed with forward 1 and backward ``backward_ratio`` (typical: 2; ``times`` for W and FB too).
    Any positive times give a deadlock-free placement; ones close to the real times need the fewest waits.
    """
    times = times or RelativeTimes(backward_ratio)
    timed = timed_compute_orders(orders, pp, vpp, 1.0, times.backward, placement, chunk_costs, times)
    ends = [[end for _, end in rank] for rank in timed]  # ascending per rank
    starts = [[start for start, _ in rank] for rank in timed]
    last_mc = pp * vpp - 1
    # after[r][i]: comm actions posted after rank r's i-th compute (i = -1: before the first).
    after: list[dict[int, list[tuple[float, int, Action]]]] = [{} for _ in range(pp)]
    for r in range(pp):
        for i, a in enumerate(orders[r]):
            for part in a.parts():
                kind = "F" if part.kind is ActionKind.F else "B" if part.kind in (ActionKind.B, ActionKind.I) else None
                if kind is None:
                    continue
                mc = model_chunk(r, part.chunk, pp, placement)
                if (kind == "F" and mc == last_mc) or (kind == "B" and mc == 0) or is_local(
                        r, part.chunk, kind, pp, placement):
                    continue
                sent_at = timed[r][i][1]
                dst, dst_chunk = rank_and_chunk(mc + 1 if kind == "F" else mc - 1, pp, placement)
                after[r].setdefault(i, []).append((sent_at, 0, Action("SEND_" + kind, part.microbatch, part.chunk)))
                recv = Action("RECV_" + kind, part.microbatch, dst_chunk)
                # Receiver: after its last compute that ends no later than the send, or after the next one when that
                # starts before the send without taking this message (else it would wait for a message it does not
                # need: a batch completes as a whole)
                j = bisect.bisect_right(ends[dst], sent_at) - 1
                if j + 1 < len(orders[dst]) and starts[dst][j + 1] < sent_at and not _takes(orders[dst][j + 1], recv):
                    j += 1
                after[dst].setdefault(j, []).append((sent_at, 1, recv))
    out = []
    for r in range(pp):
        seq: list[Action] = []
        for i in range(-1, len(orders[r])):
            if i >= 0:
                seq.append(orders[r][i])
            # Sends first, then receives in send-time order: FIFO order on every channel.
            seq += [a for _, _, a in sorted(after[r].get(i, []),
                                            key=lambda t: (t[0], t[1], message_key(t[2], r, pp, placement)))]
        out.append(tuple(seq))
    return tuple(out)


def _takes(compute: Action, recv: Action) -> bool:
    """Whether ``compute`` consumes what ``recv`` receives (an F its activation, a B/I its gradient)."""
    return any((p.microbatch, p.chunk) == (recv.microbatch, recv.chunk)
               and (p.kind is ActionKind.F) == (recv.kind is ActionKind.RECV_F) and p.kind is not ActionKind.W
               for p in compute.parts())


def message_key(action: Action, pp_rank: int, pp: int, placement: Placement = Placement.INTERLEAVED) -> tuple:
    msg = message_of(action, pp_rank, pp, placement)
    return (msg.src, msg.kind, msg.microbatch, msg.src_model_chunk)


def build_schedule(name: str, pp: int, num_microbatches: int, vpp: int = 1, forward_only: bool = False,
                   backward_ratio: float = 2.0, overlap: bool = False,
                   chunk_costs: Sequence[Sequence[float]] | None = None, weight_ratio: float | None = None,
                   overlapped_ratio: float | None = None) -> Schedule:
    """The full action lists of schedule ``name`` (``SCHEDULES``) for every rank.

    ``forward_only`` (evaluation) keeps the schedule's forwards, in order, and their sends/receives.
    ``backward_ratio``: backward/forward time assumed to place the communication. Executed with
    lazy waits (as ``pipeline.executor`` does), the interleaved schedule then keeps the textbook
    bubble both for equal times and for backward = 2 x forward. ``weight_ratio`` / ``overlapped_ratio``: the W and
    FB times assumed likewise (``RelativeTimes``). ``overlap``: batch-level overlap (1f1b, interleaved: FB pairs,
    ``pipeline.compute_orders``; dualpipev has them anyway). ``chunk_costs``: see the module docstring.
    """
    check_schedule_config(name, pp, vpp, num_microbatches, overlap)
    times = RelativeTimes(backward_ratio, weight_ratio, overlapped_ratio)
    placement = placement_of(name)
    if chunk_costs is not None and (len(chunk_costs) != pp or any(len(c) != vpp for c in chunk_costs)
                                    or any(not x > 0 for c in chunk_costs for x in c)):
        raise ValueError(f"chunk_costs must give {pp} ranks x {vpp} chunks of positive costs, got {chunk_costs}")
    orders = [compute_order(name, pp, vpp, num_microbatches, r, overlap) for r in range(pp)]
    if forward_only:
        orders = [[p for a in order for p in a.parts() if p.kind is ActionKind.F] for order in orders]
    return Schedule(name=name, pp=pp, vpp=vpp, num_microbatches=num_microbatches,
                    actions=place_communication(orders, pp, vpp, backward_ratio, placement, chunk_costs, times),
                    forward_only=forward_only, placement=placement)


def expected_bubble_fraction(name: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Textbook bubble fraction with equal forward and backward times: (p-1)/(v*m+p-1). For the zero-bubble
    schedules, with equal F, I and W (B = I + W): ZB-H1 (p-1)/(3m+p-1) (the paper's (p-1)(F+I-W) idle per rank),
    ZB-V and DualPipeV see ``zero_bubble_idle`` / ``dualpipev_idle``."""
    if name == "zb-h1":
        return (pp - 1) / (3 * num_microbatches + pp - 1)
    if name in V_SCHEDULES:
        raise ValueError(f"{name}: use the idle-time formulas (zbv: 0 when F = I = W; dualpipev_idle)")
    v = vpp if name == "interleaved" else 1
    return (pp - 1) / (v * num_microbatches + pp - 1)


def zb_h1_idle(pp: int, forward: float, backward_input: float, weight: float) -> float:
    """ZB-H1's idle time per rank (the paper's bubble): (p - 1)(F + I - W), for W <= F + I."""
    return (pp - 1) * (forward + backward_input - weight)


def one_f_one_b_idle(pp: int, forward: float, backward: float) -> float:
    """1F1B's idle time per rank: (p - 1)(F + B)."""
    return (pp - 1) * (forward + backward)


def dualpipev_idle(pp: int, overlapped: float, backward: float, weight: float) -> float:
    """DualPipeV's published bubble (deepseek-ai/DualPipe README, per device, PP = 2 pp stages on pp devices):
    (PP/2 - 1)(F&B + B - 3W) = (pp - 1)(F&B + B - 3W), F&B the time of an overlapped forward+backward pair."""
    return (pp - 1) * (overlapped + backward - 3 * weight)
