"""Schedules: valid, matched, deadlock-free (even under NCCL rendezvous), textbook bubble, memory."""

import argparse
import functools
import random

import pytest

from moefold.pipeline.actions import Action
from moefold.pipeline.schedules import Schedule, build_schedule, expected_bubble_fraction
from moefold.pipeline.simulator import DeadlockError, ScheduleError, simulate, validate
from moefold.pipeline.timeline import render_text, schedule_figure
from moefold.training.cli import SUBCOMMANDS
from moefold.training.cli import schedule as schedule_cli

GRID = [(name, pp, 1, m) for name in ("gpipe", "1f1b") for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]
GRID += [("interleaved", pp, v, k * pp) for pp in (2, 3, 4, 8) for v in (2, 3, 4) for k in (1, 2, 3)]


@functools.cache
def _schedule(name: str, pp: int, m: int, v: int, forward_only: bool = False, ratio: float = 2.0) -> Schedule:
    return build_schedule(name, pp, m, v, forward_only, backward_ratio=ratio)


@pytest.mark.parametrize("semantics, wait", [("rendezvous", "lazy"), ("rendezvous", "eager"), ("buffered", "lazy"),
                                             ("buffered", "eager")])
def test_grid_valid_deadlock_free_and_textbook_bubble(semantics, wait):
    # The executor's model (rendezvous, lazy) on the whole grid; the other models on every third point.
    # Eager waits keep the textbook bubble only when the communication was placed for equal times.
    ratio = 2.0 if wait == "lazy" else 1.0
    for name, pp, v, m in GRID if (semantics, wait) == ("rendezvous", "lazy") else GRID[::3]:
        schedule = _schedule(name, pp, m, v, ratio=ratio)
        validate(schedule)
        result = simulate(schedule, 1 / v, 1 / v, semantics=semantics, wait=wait)  # chunk time 1/v
        expected = expected_bubble_fraction(name, pp, m, v)
        assert expected == (pp - 1) / (v * m + pp - 1)  # the formula itself (v = 1 except interleaved)
        assert result.bubble_fraction == pytest.approx(expected, abs=1e-9), (name, pp, v, m)
        assert all(b == pytest.approx(expected, abs=1e-9) for b in result.bubble_per_rank), (name, pp, v, m)
        simulate(_schedule(name, pp, m, v, True), semantics=semantics, wait=wait)
        if name == "1f1b":
            assert result.peak_in_flight[0] == min(pp, m)
            assert all(result.peak_in_flight[r] <= pp - r for r in range(pp))
        elif name == "gpipe":
            assert result.peak_in_flight[0] == m
        else:  # Megatron: 2(p-1) + (v-1)p warm-up forwards, plus the one in flight
            assert result.peak_in_flight[0] == (m * v if m == pp else 2 * (pp - 1) + (v - 1) * pp + 1)


def test_no_deadlock_with_any_compute_times():
    rng = random.Random(0)
    for name, pp, v, m in GRID[::3]:
        schedule = _schedule(name, pp, m, v)
        times = {}
        duration = lambda r, a: times.setdefault((r, a), rng.uniform(0.1, 3.0))
        for wait in ("lazy", "eager"):
            for sched in (schedule, _schedule(name, pp, m, v, ratio=1.0)):
                result = simulate(sched, duration=duration, semantics="rendezvous", wait=wait)
                assert result.makespan >= max(result.busy)


@pytest.mark.parametrize("pp, v, m", [(4, 2, 8), (8, 2, 16), (3, 3, 9), (4, 4, 8)])
def test_lazy_waits_keep_textbook_bubble_when_backward_is_twice_forward(pp, v, m):
    s = build_schedule("interleaved", pp, m, v)
    for semantics in ("rendezvous", "buffered"):
        result = simulate(s, 1 / v, 2 / v, semantics=semantics)
        assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))
    # Blocking on every batch (what a naive executor would do) is never better (receives are posted where the
    # next compute does not need them, so here it keeps the bubble too)
    assert simulate(s, 1 / v, 2 / v, wait="eager").bubble_fraction >= result.bubble_fraction - 1e-12


def test_every_forward_precedes_its_backward_and_every_send_is_received():
    schedule = build_schedule("interleaved", 4, 8, 2)
    for actions in schedule.actions:
        index = {a: i for i, a in enumerate(actions)}
        for a in actions:
            if a.kind == "B":
                assert index[Action("F", a.microbatch, a.chunk)] < index[a]
    sends = sum(a.kind.startswith("SEND") for acts in schedule.actions for a in acts)
    recvs = sum(a.kind.startswith("RECV") for acts in schedule.actions for a in acts)
    # every model-chunk boundary is crossed by each micro-batch once forward and once backward
    assert sends == recvs == 2 * 8 * (4 * 2 - 1)


def _broken(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return Schedule(schedule.name, schedule.pp, schedule.vpp, schedule.num_microbatches, tuple(lists))


def test_validator_and_deadlock_detector_catch_broken_schedules():
    s = build_schedule("1f1b", 2, 2)
    a0, a1 = list(s.actions[0]), list(s.actions[1])
    with pytest.raises(ScheduleError, match=r"rank 1: RECV_F\(mb=0, chunk=0\) is missing|comes before RECV_F"):
        validate(_broken(s, 1, [a for a in a1 if a != Action("RECV_F", 0)]))
    with pytest.raises(ScheduleError, match=r"B\(mb=0, chunk=0\) comes before F\(mb=0, chunk=0\)"):
        validate(_broken(s, 1, [Action("B", 0), *[a for a in a1 if a != Action("B", 0)]]))
    swapped = [a for a in a1 if a.kind != "RECV_F"]
    swapped = [Action("RECV_F", 1), Action("RECV_F", 0), *swapped]
    with pytest.raises(ScheduleError, match=r"message #0 from rank 0 to rank 1.*FIFO"):
        validate(_broken(s, 1, swapped))
    assert a0[:2] == [Action("F", 0), Action("SEND_F", 0)]
    # rank 0 waits for B(0)'s gradient before sending F(0)'s activation: a cycle
    r0 = [Action("F", 0), Action("RECV_B", 0), Action("F", 1), Action("SEND_F", 0), Action("SEND_F", 1),
          Action("B", 0), Action("RECV_B", 1), Action("B", 1)]
    r1 = [Action("RECV_F", 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0), Action("RECV_F", 1),
          Action("F", 1), Action("B", 1), Action("SEND_B", 1)]
    bad = Schedule("custom", 2, 1, 2, (tuple(r0), tuple(r1)))
    validate(bad)
    # NCCL: rank 0's stream blocks in RECV_B(0) before it reaches SEND_F(0), which rank 1 needs first
    for wait in ("lazy", "eager"):
        with pytest.raises(DeadlockError, match=r"deadlocks \(rendezvous, .*rank 0 at B\(mb=0.*rank 1 at F\(mb=0"
                           if wait == "lazy" else r"rank 0 at \[RECV_B\(mb=0, chunk=0\)\]; rank 1 at \[RECV_F"):
            simulate(bad, wait=wait)
    with pytest.raises(DeadlockError, match=r"buffered, eager"):
        simulate(bad, semantics="buffered", wait="eager")
    simulate(bad, semantics="buffered", wait="lazy")  # gloo-like buffering with lazy waits gets through


@pytest.mark.parametrize("args, message", [
    (("interleaved", 4, 6, 2), r"num_microbatches=6 to be a multiple of pp=4"),
    (("interleaved", 1, 2, 2), r"needs pp >= 2"),
    (("1f1b", 4, 8, 2), r"schedule='1f1b' runs one chunk per rank, got vpp=2"),
    (("zb", 4, 8, 1), r"schedule='zb' is not one of"),
    (("gpipe", 4, 0, 1), r"num_microbatches=0 must be a positive integer"),
])
def test_bad_schedule_configs_fail_clearly(args, message):
    name, pp, m, v = args
    with pytest.raises(ValueError, match=message):
        build_schedule(name, pp, m, v)


def test_text_timeline_shows_1f1b():
    s = build_schedule("1f1b", 4, 8)
    text = render_text(s, simulate(s))
    assert "rank 0 |F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7|" in text
    assert "rank 3 |.. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. ..|" in text
    assert "bubble fraction 0.2727" in text


def cli_main(argv: list[str]) -> int:
    # The subcommand module alone: building the whole CLI would import every other subcommand.
    assert argv[0] == "schedule" and SUBCOMMANDS["schedule"][0] == "moefold.training.cli.schedule"
    parser = argparse.ArgumentParser()
    schedule_cli.add_arguments(parser)
    return schedule_cli.main(parser.parse_args(argv[1:]))


def test_schedule_subcommand_prints_and_plots(tmp_path, capsys):
    png = tmp_path / "schedule.png"
    assert cli_main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--plot", str(png),
                     "--num-layers", "16"]) == 0
    out = capsys.readouterr().out
    assert "interleaved pp=4 vpp=2 (interleaved placement) microbatches=8" in out
    assert "bubble fraction 0.1579" in out and "expected bubble (p-1)/(v*m+p-1) with equal F and B = 0.1579" in out
    assert "rank 0 |F0a F1a F2a F3a F0b" in out
    assert "pp rank 0: chunk 0: layers 0-1 +embedding; chunk 1: layers 8-9" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert cli_main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "6"]) == 2
    assert "needs num_microbatches=6 to be a multiple of pp=4" in capsys.readouterr().out


def test_plot_legend_separates_kinds_from_chunks_and_nothing_is_cut_off():
    """zbv (vpp 2, split backward): each kind of compute has its own colour and legend entry, a chunk its hatch
    (an input-gradient backward never looks like "chunk a" of a backward); axis label and legend lie inside the
    figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    schedule = build_schedule("zbv", 2, 4, 2)
    fig = schedule_figure(schedule, simulate(schedule))
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        assert labels == ["forward", "backward (input)", "backward (weights)", "chunk a", "chunk b"], labels
        # a bar's fill says its kind (one colour per kind, whatever the chunk), its hatch its chunk
        fills: dict[tuple, set] = {}
        for bars in ax.collections:
            fills.setdefault(tuple(bars.get_facecolor()[0]), set()).add(bars.get_hatch())
        assert set(fills) == {to_rgba(c) for c in ("tab:blue", "yellowgreen", "tab:purple")}, fills
        assert all(hatches == {"", "//"} for hatches in fills.values()), fills
        inside = fig.bbox
        for artist in (ax.xaxis.label, *fig.legends, ax.title):
            box = artist.get_window_extent()
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, \
                (artist, box, inside)
    finally:
        plt.close(fig)
