"""The activation peak of a long pipeline step from a short one's states (``planner.profile.steady_schedule``)
equals the walk of the whole action list, for every schedule the search tries, on every rank."""

from __future__ import annotations

import random

import pytest

from moefold.planner.profile import ChunkProfile, schedule_peak, steady_schedule

SCHEDULES = [("1f1b", 4, 1, False), ("zb-h1", 4, 1, False), ("interleaved", 4, 2, False), ("interleaved", 2, 3, True),
             ("zbv", 4, 2, False), ("dualpipev", 4, 2, True), ("dualpipev", 2, 2, False), ("1f1b", 1, 1, True)]


@pytest.mark.parametrize("name,pp,vpp,overlap", SCHEDULES, ids=lambda v: str(v))
def test_steady_state_peak_equals_the_whole_walk(name: str, pp: int, vpp: int, overlap: bool) -> None:
    rng = random.Random(f"{name}{pp}{vpp}{overlap}")
    for m in (17 * pp, 20 * pp + (1 if vpp == 1 else 0)):
        schedule = (name, pp, m, vpp, overlap)
        for rank in range(pp):
            for _ in range(3):   # chunks of unequal bytes: any weighting of the states
                profiles = []
                for _ in range(vpp):
                    kept = rng.randrange(1, 10**6)
                    profiles.append(ChunkProfile((), kept, kept + rng.randrange(10**6), kept + rng.randrange(10**6)))
                message = rng.randrange(10**5)
                assert schedule_peak(schedule, profiles, rank, message) == \
                    schedule_peak(schedule, profiles, rank, message, steady=False), (schedule, rank)
            if m > 16 * pp:
                assert steady_schedule(schedule, rank)[2] == 6 * pp   # the short step stood for it
