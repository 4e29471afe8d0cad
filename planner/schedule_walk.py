"""A pipeline rank's activation states over a step, walked from its schedule's action lists (``pipeline.schedules``):
the (micro-batch, chunk) pairs it holds before each action, the messages in flight and the action's own transient.
``schedule_peak`` turns them into the rank's peak (``planner.profile``'s exact mode; ``planner.inflight``'s closed
form is tested against it); ``steady_schedule`` stands a long step's states for a short one's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from moefold.pipeline.actions import ActionKind, is_local, model_chunk, split_batches
from moefold.pipeline.schedules import Schedule, build_schedule
from moefold.planner.inflight import fb_matrix

if TYPE_CHECKING:
    from moefold.planner.profile import ChunkProfile


def schedule_peak(schedule: tuple[str, int, int, int, bool] | None, profiles: list[ChunkProfile], pp_rank: int,
                  message: int = 0, steady: bool = True) -> tuple[int, int]:
    """(peak activation bytes, most (micro-batch, chunk) pairs held at once) of ``pp_rank`` over a step, walking
    its action list (``schedule``: (name, pp, micro-batches, vpp, overlap)); ``profiles[c]``: its chunk c;
    ``message``: bytes of one activation crossing stages; ``schedule`` None: pp = 1 without the overlap.
    ``steady``: a long step's states from a short one's (``steady_schedule``; False: the whole action list)."""
    if schedule is None:
        return profiles[0].peak, 1
    walked = steady_schedule(schedule, pp_rank) if steady else schedule
    live, messages, kinds, chunks, most, partners = _events(walked, pp_rank)
    kept = np.array([p.kept for p in profiles], dtype=np.float64)
    transient = np.zeros(len(kinds))
    fwd, bwd, fb = kinds == 1, kinds == 2, kinds == 4
    transient[fwd] = np.array([p.fwd_peak for p in profiles], dtype=np.float64)[chunks[fwd]]
    transient[bwd] = np.array([p.bwd_peak for p in profiles], dtype=np.float64)[chunks[bwd]]
    if fb.any():   # the row holds the backward's pair whole: the step's two pairs are fb_peak instead
        pairs = np.array(fb_matrix(profiles), dtype=np.float64)
        transient[fb] = pairs[chunks[fb], partners[fb]] - kept[partners[fb]]
    return int((live @ kept + messages * float(message) + transient).max()), most

STEADY_PROBES = (6, 8)   # x pp micro-batches: the two short steps whose states stand for a long one's


@lru_cache(maxsize=4096)
def steady_schedule(schedule: tuple[str, int, int, int, bool], pp_rank: int) -> tuple[str, int, int, int, bool]:
    """The schedule whose action list ``_events`` walks for ``schedule`` on ``pp_rank``: past its warm-up a schedule
    repeats its steady state, so a long step (more than 2 x 8 pp micro-batches) holds the same states (held pairs
    per chunk, messages, the action and its chunk) as a short one. When the steps of 6 pp and 8 pp micro-batches
    reach the same set of states and the same most pairs held, the 6 pp one stands for ``schedule`` (any peak, a
    maximum over those states, is then the same); otherwise ``schedule`` itself is walked. Building and walking a
    step of 1,024 micro-batches costs seconds; this makes every long step cost that of 6 pp + 8 pp (cached)."""
    name, pp, m, vpp, overlap = schedule
    probes = [(name, pp, k * pp, vpp, overlap) for k in STEADY_PROBES]
    if m <= 2 * probes[-1][2]:
        return schedule
    try:
        states = [_states(p, pp_rank) for p in probes]
    except ValueError:   # a probe this schedule refuses (its micro-batch count): walk the step itself
        return schedule
    return probes[0] if states[0] == states[1] else schedule


def _states(schedule: tuple[str, int, int, int, bool], pp_rank: int) -> tuple[frozenset, int]:
    """The distinct states of ``_events`` (what any peak is a maximum over) and the most pairs held."""
    live, messages, kinds, chunks, most, partners = _events(schedule, pp_rank)
    return frozenset(zip(map(tuple, live.tolist()), messages.tolist(), kinds.tolist(), chunks.tolist(),
                         partners.tolist())), most


@lru_cache(maxsize=1024)
def _events(schedule: tuple[str, int, int, int, bool], pp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                                np.ndarray, int, np.ndarray]:
    """``pipeline.executor.run_schedule``'s buffers, action by action, as counts: for each posted batch and compute
    of ``pp_rank``, the (micro-batch, chunk) pairs of each chunk held then (a backward's own pair already released)
    and the point-to-point messages held; plus the event kind (0 a batch posted, 1 forward, 2 backward or I, 3 W,
    4 an FB), its chunk (an FB's: its forward's), the most pairs held at once and, last, an FB's backward chunk
    (-1 for other events). A rank holds, before an action, the ``kept`` bytes of each held pair plus that many
    messages plus the action's own transient (``schedule_peak``): a forward's or a backward's; an FB's row holds its
    backward's pair, and its two pairs together hold ``planner.inflight.fb_peak`` (the backward releasing its blocks
    while the forward takes its own). An I keeps its pair until its W (the weight gradients read the saved inputs).

    Messages, as the executor holds them: a receive buffer from its posting until its consumer ran (a received
    activation is then its chunk's input, in ``kept``; a received gradient is freed after its backward); an input
    gradient from its backward until its batch is waited on (a compute waits for its input's batch and the ones
    before it); a sent output is in its chunk's ``kept`` until its backward, then a message while its batch is not
    waited on. A hand-over between the V placement's two chunks of a rank is no message."""
    _, pp, _, vpp, _ = schedule
    built = _schedule(*schedule)
    placement = built.placement
    last = pp * vpp - 1
    live = [0] * vpp
    rows, messages, kinds, chunks, partners = [], [], [], [], []
    receiving = gradients = most = 0   # receive buffers not yet consumed; input gradients not yet posted
    unwaited: dict[int, tuple[int, list[tuple[int, int]]]] = {}   # batch -> (input gradients, outputs) it sends
    batch_of: dict[tuple[str, int, int], int] = {}               # a posted receive -> its batch
    backward_done: set[tuple[int, int]] = set()

    def held() -> int:
        sent = sum(g + sum(o in backward_done for o in outputs) for g, outputs in unwaited.values())
        return receiving + gradients + sent

    def wait_for(key: tuple[str, int, int]) -> None:
        for b in [b for b in unwaited if b <= batch_of[key]]:
            del unwaited[b]

    def remote(c: int, direction: str) -> bool:
        """Whether the chunk's input (direction 'F') / output gradient ('B') crosses ranks."""
        mc = model_chunk(pp_rank, c, pp, placement)
        if direction == "F":
            return mc > 0 and not is_local(pp_rank, c, "B", pp, placement)
        return mc < last and not is_local(pp_rank, c, "F", pp, placement)

    for index, item in enumerate(split_batches(built.rank_actions(pp_rank))):
        if isinstance(item, tuple):
            outputs = [(a.microbatch, a.chunk) for a in item if a.kind is ActionKind.SEND_F]
            sent_gradients = sum(a.kind is ActionKind.SEND_B for a in item)
            unwaited[index] = (sent_gradients, outputs)
            gradients -= sent_gradients
            for a in item:
                if a.kind.startswith("RECV"):
                    batch_of[(a.kind[-1], a.microbatch, a.chunk)] = index
                    receiving += 1
            rows.append(list(live))
            messages.append(held())
            kinds.append(0)
            chunks.append(item[0].chunk)
            partners.append(-1)
            continue
        after = []   # what each part does once the action ran
        for part in item.parts():
            c = part.chunk
            if part.kind is ActionKind.F:
                if remote(c, "F"):
                    wait_for(("F", part.microbatch, c))
                    receiving -= 1   # the receive buffer is now the chunk's input (in ``kept``)
                after.append(("hold", part))
            elif part.kind is ActionKind.W:
                live[c] -= 1
            else:   # B, I
                if remote(c, "B"):
                    wait_for(("B", part.microbatch, c))   # the received gradient lives through the backward
                if item.kind is not ActionKind.FB:   # an FB's backward half keeps its pair in the step (upper bound)
                    live[c] -= 1
                after.append(("backward", part))
        rows.append(list(live))
        messages.append(held())
        kinds.append({ActionKind.F: 1, ActionKind.B: 2, ActionKind.I: 2, ActionKind.W: 3, ActionKind.FB: 4}[item.kind])
        chunks.append(item.chunk)
        partners.append(item.b_chunk if item.kind is ActionKind.FB else -1)
        if item.kind is ActionKind.FB:   # its two pairs, each in part
            most = max(most, sum(live) + 1)
        for what, part in after:
            c = part.chunk
            if what == "hold":
                live[c] += 1
                continue
            receiving -= int(remote(c, "B"))
            gradients += int(remote(c, "F"))
            backward_done.add((part.microbatch, c))
            if part.kind is ActionKind.I:
                live[c] += 1   # held until its W
            elif item.kind is ActionKind.FB:
                live[c] -= 1
        most = max(most, sum(live))
    return (np.array(rows, dtype=np.float64), np.array(messages, dtype=np.float64), np.array(kinds),
            np.array(chunks), most, np.array(partners))


@lru_cache(maxsize=256)
def _schedule(name: str, pp: int, num_micro: int, vpp: int, overlap: bool = False) -> Schedule:
    return build_schedule(name, pp, num_micro, vpp, overlap=overlap)
