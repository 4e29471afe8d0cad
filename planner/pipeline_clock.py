"""The pipeline clock of a planned step: the schedule's action lists run on ``pipeline.simulator``'s clock with the
durations the step-time model estimates per (pipeline rank, virtual chunk) (``planner.step_time``), giving the
step's makespan, each rank's busy time and the expert exchange the batch-level overlap hides on the busiest rank.

Durations per (rank, chunk): forward, backward, its weight-gradient GEMMs (the W of the split-backward schedules;
an I takes the backward less them) and the forward's and backward's (ep exchange, compute) that an FB step overlaps
(``--overlap-moe-expert-parallel-comm``: the exchange hidden is both halves' up to both halves' compute;
``--delay-wgrad-compute``: a lone backward hides its exchange behind its own weight GEMMs). Long steps are
extrapolated from three short simulations when those lie on one line (``step_makespan``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from moefold.pipeline.actions import Action, ActionKind
from moefold.pipeline.schedules import V_SCHEDULES, Schedule, build_schedule, dualpipev_idle, expected_bubble_fraction
from moefold.pipeline.simulator import simulate
from moefold.planner.inflight import interleaved_warmup


@lru_cache(maxsize=64)
def _schedule(name: str, pp: int, vpp: int, m: int, overlap: bool) -> Schedule:
    return build_schedule(name, pp, m, vpp, overlap=overlap)


# per (rank, chunk): forward, backward, its weight GEMMs, the forward's and the backward's (ep, compute) that overlap
Durations = tuple[tuple[tuple[float, float, float, tuple[float, float], tuple[float, float]], ...], ...]


def _duration(durations: Durations, overlap: bool, delay_wgrad: bool) -> Callable[[int, Action], float]:
    def duration(r: int, a: Action) -> float:
        f, b, w, _, (b_ep, _) = durations[r][a.chunk]
        if a.kind is ActionKind.F:
            return f
        if a.kind is ActionKind.W:
            return w
        if a.kind is ActionKind.I:
            return b - w
        if a.kind is ActionKind.B:   # alone: with --delay-wgrad-compute its exchange hides behind its own weight GEMMs
            return b - min(b_ep, w) if delay_wgrad else b
        fb, bb = durations[r][a.chunk], durations[r][a.b_chunk]   # an FB: overlapped only with the overlap
        return fb[0] + bb[1] - (_hidden(fb[3], bb[4]) if overlap else 0.0)
    return duration


def _hidden(forward: tuple[float, float], backward: tuple[float, float]) -> float:
    """Of an FB step, the exchange hidden: both halves' (ep) behind both halves' compute, at most all of it."""
    return min(forward[0] + backward[0], forward[1] + backward[1])


@lru_cache(maxsize=512)
def simulate_step(name: str, pp: int, vpp: int, m: int, durations: Durations, overlap: bool = False,
              delay_wgrad: bool = False) -> tuple[float, tuple[float, ...], float]:
    """(makespan, busy seconds per pipeline rank, exchange hidden on the busiest rank) of the schedule with these
    durations per (rank, chunk). pipeline.simulator's cost grows with pp x m (about 0.5 s at pp=16, m=120)."""
    schedule = _schedule(name, pp, vpp, m, overlap)
    result = simulate(schedule, duration=_duration(durations, overlap, delay_wgrad))
    critical = max(range(pp), key=lambda r: result.busy[r])
    hidden = 0.0
    for a in schedule.rank_actions(critical):
        if a.kind is ActionKind.FB and overlap:
            hidden += _hidden(durations[critical][a.chunk][3], durations[critical][a.b_chunk][4])
        elif a.kind is ActionKind.B and delay_wgrad:
            _, _, w, _, (b_ep, _) = durations[critical][a.chunk]
            hidden += min(b_ep, w)
    return result.makespan, result.busy, hidden


PROBES = (4, 6, 8)   # x pp micro-batches: the simulated steps whose makespans are extrapolated when collinear


def step_makespan(name: str, pp: int, vpp: int, m: int, durations: Durations, overlap: bool = False,
              delay_wgrad: bool = False) -> tuple[float, tuple[float, ...], float]:
    """(makespan, busy per rank, hidden exchange on the busiest rank) of ``m`` micro-batches. Past the warm-up a
    schedule repeats itself: each further micro-batch adds the same time, so these are affine in ``m``. When the
    simulated makespans of 4, 6 and 8 x pp micro-batches lie on one line (to 1e-9), that line gives the values at
    ``m`` (pp = 16 with m = 960 then costs three short simulations instead of one long one); otherwise, and for
    small ``m``, all ``m`` micro-batches are simulated."""
    probes = [k * pp for k in PROBES]
    if m > 2 * probes[-1]:
        runs = [simulate_step(name, pp, vpp, k, durations, overlap, delay_wgrad) for k in probes]
        spans = [r[0] for r in runs]
        slopes = [(spans[i + 1] - spans[i]) / (probes[i + 1] - probes[i]) for i in range(2)]
        if abs(slopes[1] - slopes[0]) <= 1e-9 * spans[-1]:
            k = (m - probes[-1]) / (probes[-1] - probes[-2])
            busy = tuple(b + k * (b - a) for a, b in zip(runs[-2][1], runs[-1][1]))
            return spans[-1] + (m - probes[-1]) * slopes[1], busy, runs[-1][2] + k * (runs[-1][2] - runs[-2][2])
    return simulate_step(name, pp, vpp, m, durations, overlap, delay_wgrad)


def formula_makespan(name: str, pp: int, vpp: int, m: int, durations: Durations, overlap: bool = False,
                     delay_wgrad: bool = False) -> tuple[float, tuple[float, ...], float]:
    """``step_makespan``'s (makespan, busy per rank, hidden exchange on the busiest rank) in closed form, for the
    search (the simulated clock is ``--exact``'s). Each rank runs ``m`` forwards and backwards per chunk; with the
    overlap all but its warm-up's pairs run as FB steps, each hiding ``_hidden`` of the chunk averages; with
    --delay-wgrad-compute a lone backward hides its exchange behind its weight GEMMs. Idle time of the busiest
    rank: 1F1B, GPipe, ZB-H1 and interleaved 1F1B by their textbook bubble fractions
    (``expected_bubble_fraction``), ZB-V ``(pp - 1)(F + B - 2W)``, DualPipeV ``dualpipev_idle``, per chunk."""
    busy, hidden_of = [], []
    for r, chunks in enumerate(durations):
        n = len(chunks)
        f, b, w = (sum(c[k] for c in chunks) / n for k in range(3))
        f_ep, f_c = (sum(c[3][k] for c in chunks) / n for k in range(2))
        b_ep, b_c = (sum(c[4][k] for c in chunks) / n for k in range(2))
        pairs = m * n
        warmup = min(interleaved_warmup(pp, vpp, m, r) if name == "interleaved" else
                     2 * (pp - r - 1) if name in V_SCHEDULES else 1 if pp == 1 else pp - r - 1, pairs)
        fb = pairs - warmup if overlap else 0
        per_fb = _hidden((f_ep, f_c), (b_ep, b_c))
        hidden = fb * per_fb
        if delay_wgrad:
            hidden += (pairs - fb) * min(b_ep, w)
        busy.append(pairs * (f + b) - hidden)
        hidden_of.append((hidden, f, b, w, per_fb if overlap else 0.0))
    critical = max(range(pp), key=lambda r: busy[r])
    hidden, f, b, w, per_fb = hidden_of[critical]
    if name == "zbv":
        idle = (pp - 1) * max(f + b - 2 * w, 0.0)
    elif name == "dualpipev":
        overlapped = f + b - per_fb
        idle = dualpipev_idle(pp, overlapped, b, w) if overlapped + b > 3 * w else 0.0
    else:
        fraction = expected_bubble_fraction(name if pp > 1 else "1f1b", pp, m, vpp)
        idle = busy[critical] * fraction / (1 - fraction)
    return busy[critical] + idle, tuple(busy), hidden
