"""How many micro-batches each virtual stage of a pipeline rank holds at once, in closed form (no action list).

A rank's activation peak is ``max over the step's states of sum_c held_c x kept_c`` plus the running action's
transient (``planner.profile``). ``planner.profile._events`` walks the schedule's action lists to find those states
exactly (the ``--exact`` mode and the tests' oracle); here they come from each schedule's warm-up count:

- 1F1B (Megatron's ``forward_backward_pipelining_without_interleaving``): rank r runs ``pp - r - 1`` warm-up
  forwards, so at most ``min(pp - r, m)`` micro-batches are held; GPipe holds all ``m``; ZB-H1 keeps each
  backward's pair until its W, which holds ``min(pp, m)`` on every rank (its paper's 1F1B memory, on the first rank).
- Interleaved 1F1B (``forward_backward_pipelining_with_interleaving``, micro-batch groups of ``pp``): rank r runs
  ``W = (pp - r - 1) * 2 + (vpp - 1) * pp`` warm-up forwards (all ``m x vpp`` when ``m == pp``), forward k on chunk
  ``(k mod pp vpp) div pp``, backward k on chunk ``vpp - 1 -`` that. Before steady step j the forwards
  ``0 .. W + j`` and the backwards ``0 .. j - 1`` have run, so chunk c holds ``F_c(W + j + 1) - B_c(j)`` with
  ``F_c(n) = (n div pp vpp) pp + clamp(n mod pp vpp - c pp, 0, pp)`` and ``B_c = F_{vpp-1-c}``; the counts repeat
  with period ``pp x vpp``, so one period of j gives every state.
- ZB-V and DualPipeV (two chunks in V placement): chunk 0 holds at most ``min(2 pp - r, m)``, chunk 1 at most
  ``r + 1``, together at most ``min(2 pp, m + r + 1)`` (DualPipeV's last rank one more); which mix is held at the
  peak is not tracked, so both extreme mixes are states (an upper bound by at most one chunk's difference).

With the batch-level overlap an FB step runs the forward of one pair and the backward of another in turns, layer by
layer (``pipeline.overlap``): the backward releases its pair's blocks while the forward takes its own, so the step
holds, beyond the other pairs, ``fb_peak`` of the two chunks (about one pair and a block, not two pairs).
``planner.profile.schedule_peak(..., steady=...)`` is the walk these are tested against
(``tests/planner/test_formula.py``: every schedule, pp up to 8, every rank, short and long steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moefold.planner.profile import ChunkProfile

MESSAGES = 3   # point-to-point buffers a pipelined rank holds at its peak (a received input, a gradient, a send)


def interleaved_warmup(pp: int, vpp: int, m: int, rank: int) -> int:
    """Megatron's warm-up forwards of ``rank`` in interleaved 1F1B (all of them when ``m == pp``)."""
    total = m * vpp
    if m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def _forwards_on(n: np.ndarray, chunk: int, pp: int, vpp: int) -> np.ndarray:
    """Of the first ``n`` forwards (or backwards, chunks reversed) of a rank, those on ``chunk``."""
    group = pp * vpp
    return (n // group) * pp + np.clip(n % group - chunk * pp, 0, pp)


@lru_cache(maxsize=4096)
def held_states(name: str, pp: int, vpp: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """The distinct per-chunk held-pair counts of ``rank`` that its peak is a maximum over (the running action's
    own pair included; the batch-level overlap changes none of them: an FB step's two pairs are ``peak_bytes``'
    ``fb``). ``name``: ``pipeline.schedules``' name."""
    if pp == 1:
        return ((1,),)
    if name == "gpipe":
        states = np.array([[m]])
    elif name == "1f1b" and vpp == 1:
        states = np.array([[min(pp - rank, m)]])
    elif name == "zb-h1":
        states = np.array([[min(pp, m)]])
    elif name in ("zbv", "dualpipev"):
        most = min(2 * pp, m + rank + 1) + int(name == "dualpipev" and rank == pp - 1 and m >= 2 * pp)
        first, second = min(2 * pp - rank, m), min(rank + 1, m)
        states = np.array([[first, max(most - first, 0)], [max(most - second, 0), second]])
    else:   # interleaved 1F1B
        total = m * vpp
        warmup = interleaved_warmup(pp, vpp, m, rank)
        steps = np.arange(0, max(min(total - warmup, pp * vpp), 1))
        forwards = np.minimum(warmup + steps + 1, total)
        states = np.stack([_forwards_on(forwards, c, pp, vpp) - _forwards_on(steps, vpp - 1 - c, pp, vpp)
                           for c in range(vpp)], axis=1)
    return tuple(sorted({tuple(int(x) for x in row) for row in states}))


def peak_bytes(states: tuple[tuple[int, ...], ...], kept: list[int], peaks: list[int], message: int,
               pipelined: bool, fb: Sequence[Sequence[int]] | None = None) -> int:
    """A rank's activation peak from its held states: the fullest state's kept bytes, plus the largest transient
    of one action beyond its own kept bytes (``peaks[c]``: chunk c's forward or backward peak for one micro-batch),
    plus ``MESSAGES`` point-to-point buffers of ``message`` bytes when pipelined. ``fb`` (the overlap,
    ``fb_matrix``): any state may run an FB step whose forward is one of its pairs, on chunk c, and whose backward
    is a pair of any chunk c' not in the state: the state less that pair, plus ``fb[c][c']``."""
    held = max(sum(n * k for n, k in zip(state, kept)) for state in states)
    transient = max(p - k for p, k in zip(peaks, kept))
    peak = held + max(transient, 0)
    if fb is not None:
        peak = max([peak] + [sum(n * k for n, k in zip(state, kept)) - kept[c] + max(fb[c])
                             for state in states for c in range(len(state)) if state[c] > 0])
    return int(peak + (MESSAGES * message if pipelined else 0))


def fb_peak(forward: ChunkProfile, backward: ChunkProfile) -> int:
    """The most an FB step holds of its two pairs: ``forward``'s chunk running forward while ``backward``'s runs
    backward, in turns that end where a side has started a token exchange (``pipeline.overlap.run_overlapped``,
    the backward first). Each side's blocks (``ChunkProfile.units``) are placed on those turns: the forward holds a
    block from the turn it starts in, the backward frees one after the turn it ends in; the peak is the fullest
    turn, with the transient of the blocks running then. Chunks without parts: both pairs whole, the larger
    transient (the bound before the turns were modelled)."""
    if not forward.units or not backward.units:
        return forward.kept + backward.kept + max(forward.peak - forward.kept, backward.peak - backward.kept, 0)
    key = (id(forward), id(backward))
    hit = _FB_PEAKS.get(key)
    if hit is not None and hit[0] is forward and hit[1] is backward:
        return hit[2]
    f_start, f_kept, f_extra, f_end = _turns(forward.units, 1)
    b_start, b_kept, b_extra, b_end = _turns(backward.units[::-1], 2)   # in the order the backward runs them
    t = np.arange(int(max(f_end.max(), b_end.max())) + 1)[:, None]   # every turn at once: [turns, units]
    # the backward's turn t: its blocks not yet freed and the forward's started before t, the running blocks' transient
    held_b = (b_kept * (b_end >= t)).sum(1) + (f_kept * (f_start <= t - 1)).sum(1)
    run_b = np.where((b_start <= t) & (t <= b_end), b_extra, 0.0).max(1)
    # the forward's turn t: its blocks started by t and the backward's freed after t
    held_f = (f_kept * (f_start <= t)).sum(1) + (b_kept * (b_end > t)).sum(1)
    run_f = np.where((f_start <= t) & (t <= f_end), f_extra, 0.0).max(1)
    best = int(max((held_b + run_b).max(), (held_f + run_f).max(), 0))
    if len(_FB_PEAKS) > _CACHE:
        _FB_PEAKS.clear()
    _FB_PEAKS[key] = (forward, backward, best)   # the profiles are cached objects, reused across layouts
    return best


_FB_PEAKS: dict[tuple[int, int], tuple[ChunkProfile, ChunkProfile, int]] = {}
_CACHE = 1 << 16   # entries per cache (each holds its profiles alive: bounded, then cleared)


def _turns(units: tuple[tuple[int, int, int, int], ...], transient: int) -> tuple[np.ndarray, ...]:
    """(first turn, kept bytes, transient, last turn) of each unit of a side, in its running order; ``transient``:
    the units' field to take (1 the forward's, 2 the backward's), none below zero."""
    exchanges = np.array([u[3] for u in units])
    start = np.concatenate([[0], np.cumsum(exchanges)[:-1]])
    kept = np.array([u[0] for u in units], dtype=np.float64)
    extra = np.maximum(np.array([u[transient] for u in units], dtype=np.float64), 0)
    return start, kept, extra, start + exchanges


def fb_matrix(profiles: Sequence[ChunkProfile]) -> list[list[int]]:
    """``fb_peak`` of every (forward chunk, backward chunk) pair of a rank's chunks (cached per list of profile
    objects: a search's ranks of many layouts share their chunks' profiles)."""
    key = tuple(id(p) for p in profiles)
    hit = _FB_MATRICES.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], profiles)):
        return hit[1]
    matrix = [[fb_peak(f, b) for b in profiles] for f in profiles]
    if len(_FB_MATRICES) > _CACHE:
        _FB_MATRICES.clear()
    _FB_MATRICES[key] = (tuple(profiles), matrix)
    return matrix


_FB_MATRICES: dict[tuple[int, ...], tuple[tuple[ChunkProfile, ...], list[list[int]]]] = {}


def most_held(states: tuple[tuple[int, ...], ...]) -> int:
    """The most (micro-batch, chunk) pairs held at once."""
    return max(sum(state) for state in states)
