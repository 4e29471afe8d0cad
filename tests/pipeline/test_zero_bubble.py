"""The split-backward and overlap schedules on the simulator: valid, deadlock-free under every model, the published
bubbles and memory.

- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): idle (p-1)(F+I-W) per rank (W <= I), below 1F1B's
  (p-1)(F+B) for the same pp and micro-batches, at 1F1B's activation peak (p on every rank).
- ZB-V: only the unavoidable start-up ramp (p-1)F when F = I = W, p stage-activations per rank.
- DualPipeV (deepseek-ai/DualPipe README): idle (PP/2-1)(F&B+B-3W) per device, PP+1 chunk-activations on the
  busiest device, 2x a PP-stage 1F1B's parameters per device.
- Batch-level overlap (FB pairs): 1F1B at pp = 1 and interleaved 1F1B at pp > 1; refused where it would stall.
"""

from __future__ import annotations

import random

import pytest

from moefold.pipeline.schedules import (
    build_schedule,
    check_schedule_config,
    dualpipev_idle,
    expected_bubble_fraction,
    one_f_one_b_idle,
    zb_h1_idle,
)
from moefold.pipeline.simulator import simulate, validate
from moefold.pipeline.stages import StageLayout
from moefold.training.cli import main as cli_main

V_GRID = [(name, pp, m) for name in ("zbv", "dualpipev") for pp in (2, 3, 4, 8) for m in (2 * pp, 2 * pp + 1, 3 * pp)]
GRID = [("zb-h1", pp, 1, m, False) for pp in (2, 3, 4, 8) for m in (1, 2, pp, 2 * pp + 1)]
GRID += [(name, pp, 2, m, False) for name, pp, m in V_GRID] + [("zbv", 4, 2, 3, False)]
GRID += [("interleaved", pp, v, k * pp, True) for pp in (2, 4) for v in (2, 3) for k in (1, 2, 3)]
GRID += [("1f1b", 1, 1, m, True) for m in (1, 2, 5)]


def _times(f: float, i: float, w: float, fb: float | None = None) -> dict[str, float]:
    return {"F": f, "I": i, "W": w, "B": i + w, "FB": f + i + w if fb is None else fb}


def _idle(schedule, times: dict[str, float]) -> float:
    result = simulate(schedule, duration=lambda _r, a: times[a.kind])
    return max(result.makespan - b for b in result.busy)


@pytest.mark.parametrize("semantics, wait", [("rendezvous", "lazy"), ("rendezvous", "eager"), ("buffered", "lazy")])
def test_valid_and_deadlock_free_with_any_compute_times(semantics, wait):
    rng = random.Random(1)
    for name, pp, v, m, overlap in GRID:
        schedule = build_schedule(name, pp, m, v, overlap=overlap)
        validate(schedule)
        times: dict = {}
        simulate(schedule, duration=lambda r, a: times.setdefault((r, a), rng.uniform(0.1, 3.0)),
                 semantics=semantics, wait=wait)
        simulate(build_schedule(name, pp, m, v, forward_only=True, overlap=overlap), semantics=semantics, wait=wait)
        kinds = {a.kind for actions in schedule.actions for a in actions if a.is_compute}
        if name in ("zb-h1", "zbv"):
            assert kinds == {"F", "I", "W"}, (name, kinds)
        elif overlap and m > (pp if name == "interleaved" else 1):   # a steady state exists
            assert "FB" in kinds and schedule.overlap


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_matches_the_paper_and_beats_1f1b(pp):
    for m in (pp, 2 * pp, 3 * pp + 1):
        one_f_one_b = build_schedule("1f1b", pp, m)
        for f, i, w in ((1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1)):
            t = _times(f, i, w)
            zb = build_schedule("zb-h1", pp, m, backward_ratio=(i + w) / f, weight_ratio=w / f)
            idle = _idle(zb, t)
            assert idle == pytest.approx(zb_h1_idle(pp, f, i, w)), (pp, m, f, i, w)
            assert _idle(one_f_one_b, t) == pytest.approx(one_f_one_b_idle(pp, f, i + w))
            assert idle < one_f_one_b_idle(pp, f, i + w)
        result = simulate(build_schedule("zb-h1", pp, m), 1.0, 2.0)
        assert result.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))
        assert expected_bubble_fraction("zb-h1", pp, m) == pytest.approx(result.bubble_fraction)
        assert result.bubble_fraction < simulate(one_f_one_b, 1.0, 2.0).bubble_fraction
        # the same activation peak as 1F1B's first stage, on every stage
        assert result.peak_in_flight == (min(pp, m),) * pp


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zbv_leaves_only_the_start_up_ramp(pp):
    for m in (2 * pp, 3 * pp):
        for f in (1.0, 0.5):
            result = simulate(build_schedule("zbv", pp, m, 2), duration=lambda _r, a, f=f: f)
            assert max(result.makespan - b for b in result.busy) == pytest.approx((pp - 1) * f)
            assert max(result.peak_in_flight) == 2 * pp   # p stage-activations (2 chunks of half a stage each)
        zb_h1_stage_idle = zb_h1_idle(pp, 2.0, 2.0, 2.0)   # the same stage times on one chunk per rank
        assert (pp - 1) * 1.0 < zb_h1_stage_idle


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_bubble_and_memory_as_published(pp):
    """Times with B = 2F, W = F (DualPipe's figure), F&B from no overlap gain (F + B) down to a third off."""
    for m in (2 * pp, 3 * pp, 20):
        for fb in (3.0, 2.5, 2.0):
            schedule = build_schedule("dualpipev", pp, m, 2, backward_ratio=2.0, weight_ratio=1.0,
                                      overlapped_ratio=fb)
            result = simulate(schedule, duration=lambda _r, a, fb=fb: _times(1.0, 1.0, 1.0, fb)[a.kind])
            idle = max(result.makespan - b for b in result.busy)
            assert idle == pytest.approx(dualpipev_idle(pp, fb, 2.0, 1.0)), (pp, m, fb)
            assert max(result.peak_in_flight) == 2 * pp + 1   # PP + 1 with PP = 2 pp stages
    # 2x the parameters per device of a 1F1B over the same 2 pp stages (one stage per device)
    layers = 8 * pp
    v_layout = StageLayout(layers, pp, 2, placement="v")
    stage_layout = StageLayout(layers, 2 * pp, 1)
    assert all(len(v_layout.rank_layers(r)) == 2 * len(stage_layout.rank_layers(r)) for r in range(pp))
    assert v_layout.chunk_spec(0, 0).has_embedding and v_layout.chunk_spec(0, 1).has_head


def test_overlap_pairs_are_independent_and_cheaper_when_the_exchange_hides():
    """Each FB pairs a forward with the backward of an earlier micro-batch (one more warm-up forward), so an FB that
    runs faster than F + B (the exchanges hidden) shortens the step."""
    for name, pp, v, m in (("1f1b", 1, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 2, 3, 6)):
        schedule = build_schedule(name, pp, m, v, overlap=True)
        for actions in schedule.actions:
            seen = set()
            for a in actions:
                if a.kind == "FB":
                    f, b = a.parts()
                    assert (b.microbatch, b.chunk) in seen and (f.microbatch, f.chunk) not in seen
                seen |= {(p.microbatch, p.chunk) for p in a.parts() if p.kind == "F"}
        plain = simulate(build_schedule(name, pp, m, v), 1 / v, 2 / v).makespan
        hidden = simulate(schedule, duration=lambda _r, a, v=v: {"F": 1 / v, "B": 2 / v, "FB": 2.4 / v}[a.kind])
        assert hidden.makespan < plain


def test_refusals_name_the_numbers():
    cases = [(("1f1b", 2, 1, 4, True), "needs virtual pipeline stages"),
             (("zb-h1", 2, 1, 4, True), "has no forward/backward pairs to overlap"),
             (("gpipe", 1, 1, 4, True), "has no forward/backward pairs to overlap"),
             (("dualpipev", 4, 2, 7, False), "needs num_microbatches >= 2 x pp = 8"),
             (("zbv", 4, 1, 8, False), "runs 2 chunks per rank in V placement, got vpp=1"),
             (("zb-h1", 4, 2, 8, False), "runs one chunk per rank, got vpp=2")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            check_schedule_config(*args)


def test_schedule_subcommand_prints_the_published_formulas(capsys):
    assert cli_main(["schedule", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8",
                     "--backward-time", "2"]) == 0
    out = capsys.readouterr().out
    assert "expected idle per rank (p-1)(F+I-W) (Qi et al. 2024, ZB-H1) = 3; 1F1B's (p-1)(F+B) = 9; simulated 3" in out
    assert "rank 0 |F0 F1 F2 F3" in out and "I0" in out and "W0" in out
    assert cli_main(["schedule", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "10",
                     "--backward-time", "1", "--overlapped-time", "1.25"]) == 0
    out = capsys.readouterr().out
    assert "(PP/2-1)(F&B+B-3W) (deepseek-ai/DualPipe, PP = 8 stages) = 2.25; simulated 2.25" in out
    assert "PP+1 = 9 chunk-micro-batches published, simulated peak 9" in out and "F7aB3b" in out
    assert cli_main(["schedule", "--pp", "2", "--overlap-moe-expert-parallel-comm"]) == 2
    assert "needs virtual pipeline stages" in capsys.readouterr().out


def test_zbv_and_dualpipev_orders_are_torchs():
    """The compute orders equal torch.distributed.pipelining's ScheduleZBVZeroBubble / ScheduleDualPipeV (installed
    torch, which ports deepseek-ai/DualPipe's dualpipev.py), action by action on every rank."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from moefold.pipeline.compute_orders import compute_order

    kinds = {schedules._ComputationType.FORWARD: "F", schedules._ComputationType.BACKWARD_INPUT: "I",
             schedules._ComputationType.BACKWARD_WEIGHT: "W", schedules._ComputationType.FULL_BACKWARD: "B"}

    def theirs(cls, pp: int, m: int, rank: int) -> list[str]:
        plan = object.__new__(cls)   # only the order generator: no stages, no process group
        plan.pp_group_size, plan._n_microbatches, plan.num_stages = pp, m, 2 * pp
        out = []
        for a in plan._calculate_single_rank_operations(rank):
            if a is None:
                continue
            if a.computation_type == schedules._ComputationType.OVERLAP_F_B:
                f, b = a.sub_actions
                out.append(f"FB{f.microbatch_index}:{f.stage_index}/{b.microbatch_index}:{b.stage_index}")
            else:
                out.append(f"{kinds[a.computation_type]}{a.microbatch_index}:{a.stage_index}")
        return out

    def ours(name: str, pp: int, m: int, rank: int) -> list[str]:
        stage = lambda c: rank if c == 0 else 2 * pp - 1 - rank   # the V placement
        return [f"FB{a.microbatch}:{stage(a.chunk)}/{a.b_microbatch}:{stage(a.b_chunk)}" if a.kind == "FB"
                else f"{a.kind}{a.microbatch}:{stage(a.chunk)}" for a in compute_order(name, pp, 2, m, rank)]

    for cls, name in ((schedules.ScheduleZBVZeroBubble, "zbv"), (schedules.ScheduleDualPipeV, "dualpipev")):
        for pp, m in ((2, 3), (2, 4), (3, 7), (4, 8), (4, 10), (8, 16)):
            if name == "dualpipev" and m < 2 * pp:
                continue
            for rank in range(pp):
                assert ours(name, pp, m, rank) == theirs(cls, pp, m, rank), (name, pp, m, rank)
