"""``moefold schedule``: print a pipeline schedule's timeline, bubble and memory (and plot it).

The command's flags and its output; the schedules, the simulator and the timeline are ``moefold.pipeline``'s (no
argparse below the CLI)."""

from __future__ import annotations

import argparse

from moefold.pipeline.actions import ActionKind
from moefold.pipeline.layout import parse_layout
from moefold.pipeline.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    build_schedule,
    dualpipev_idle,
    expected_bubble_fraction,
    one_f_one_b_idle,
    placement_of,
    zb_h1_idle,
)
from moefold.pipeline.simulator import simulate
from moefold.pipeline.stages import StageLayout, chunk_costs
from moefold.pipeline.timeline import plot_png, render_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=4,
                        help="pipeline ranks (default 4)")
    parser.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp", type=int, default=None,
                        help="virtual chunks per rank (default 1; 2 for zbv/dualpipev; > 1 selects the interleaved "
                             "schedule)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--schedule", choices=SCHEDULES, default=None,
                        help="default: interleaved when --vpp > 1, else 1f1b")
    parser.add_argument("--overlap-moe-expert-parallel-comm", dest="overlap", action="store_true",
                        help="batch-level overlap: the steady state's forward/backward pairs as overlapped FB steps "
                             "(1f1b at pp = 1, interleaved; dualpipev has them anyway)")
    parser.add_argument("--forward-time", type=float, default=None,
                        help="time of one forward on one chunk (default 1/vpp)")
    parser.add_argument("--backward-time", type=float, default=None,
                        help="time of one full backward on one chunk (default: the forward's)")
    parser.add_argument("--weight-time", type=float, default=None,
                        help="of the backward, the weight-gradient part W (default half of it; the input part I is "
                             "the rest)")
    parser.add_argument("--overlapped-time", type=float, default=None,
                        help="time of an overlapped forward + backward pair FB (default forward + backward: no "
                             "overlap gain)")
    parser.add_argument("--num-layers", type=int, default=None, help="also print the layer split")
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        help="with --num-layers: layers on the first stage (default: even split)")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                        help="with --num-layers: layers on the last stage (default: even split)")
    parser.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                        help="Megatron's layout (e.g. 'Et|(tt|)*30mL'; fixes --vpp): every chunk's times scale with "
                             "its layers (embedding, MTP layer, loss counted as one; the times given are per chunk of "
                             "the mean cost)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the timeline as a PNG")


def _layout_vpp(args: argparse.Namespace) -> int | None:
    """The virtual stages per rank that ``--pipeline-model-parallel-layout`` gives (None without it)."""
    if args.pipeline_model_parallel_layout is None:
        return None
    stages = len(parse_layout(args.pipeline_model_parallel_layout))
    if stages % args.pp:
        raise ValueError(f"--pipeline-model-parallel-layout={args.pipeline_model_parallel_layout!r} has {stages} "
                         f"virtual stages, not a multiple of --pp={args.pp}")
    vpp = stages // args.pp
    if args.vpp is not None and args.vpp != vpp:
        raise ValueError(f"--vpp={args.vpp} disagrees with --pipeline-model-parallel-layout ({stages} stages / pp "
                         f"{args.pp} = {vpp}); drop --vpp")
    return vpp


def main(args: argparse.Namespace) -> int:
    try:
        layout_vpp = _layout_vpp(args)
    except ValueError as exc:
        print(f"moefold schedule: error: {exc}")
        return 2
    vpp = layout_vpp or (args.vpp if args.vpp is not None else (2 if args.schedule in V_SCHEDULES else 1))
    name = args.schedule or ("interleaved" if vpp > 1 else "1f1b")
    forward = args.forward_time if args.forward_time is not None else 1.0 / vpp
    backward = args.backward_time if args.backward_time is not None else forward
    weight = args.weight_time if args.weight_time is not None else backward / 2
    overlapped = args.overlapped_time if args.overlapped_time is not None else forward + backward
    try:
        for flag, value in (("--forward-time", args.forward_time), ("--backward-time", args.backward_time),
                            ("--weight-time", args.weight_time), ("--overlapped-time", args.overlapped_time)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag}={value} must be positive")
        if not weight < backward:
            raise ValueError(f"--weight-time={weight:g} must be below --backward-time={backward:g}")
        layout = costs = None
        placement = placement_of(name)
        if args.pipeline_model_parallel_layout is not None:
            text = args.pipeline_model_parallel_layout
            layout = StageLayout("".join(parse_layout(text)).count("t"), args.pp, layout=text, placement=placement)
        elif args.num_layers is not None:
            layout = StageLayout(args.num_layers, args.pp, vpp, args.decoder_first_pipeline_num_layers,
                                 args.decoder_last_pipeline_num_layers, placement=placement)
        if args.pipeline_model_parallel_layout is not None:   # --num-layers alone only prints the split
            costs = chunk_costs(layout)
            mean = sum(map(sum, costs)) / (args.pp * vpp)
            costs = tuple(tuple(c / mean for c in rank) for rank in costs)
        # the communication is placed for these times (any times would be deadlock-free)
        schedule = build_schedule(name, args.pp, args.microbatches, vpp, overlap=args.overlap,
                                  backward_ratio=backward / forward, weight_ratio=weight / forward,
                                  overlapped_ratio=overlapped / forward, chunk_costs=costs)
    except ValueError as exc:
        print(f"moefold schedule: error: {exc}")
        return 2
    times = {ActionKind.F: forward, ActionKind.B: backward, ActionKind.I: backward - weight, ActionKind.W: weight,
             ActionKind.FB: overlapped}

    def duration(rank: int, a) -> float:
        if costs is None:
            return times[a.kind]
        if a.kind is ActionKind.FB:   # its halves, each at its chunk's cost
            return (forward * costs[rank][a.chunk] + backward * costs[rank][a.b_chunk]) * overlapped / (
                forward + backward)
        return times[a.kind] * costs[rank][a.chunk]

    result = simulate(schedule, duration=duration)
    print(render_text(schedule, result))
    print(f"times: F {forward:g}, B {backward:g} (I {backward - weight:g} + W {weight:g}), FB {overlapped:g}")
    idle = max(result.makespan - b for b in result.busy)
    p, m = args.pp, args.microbatches
    if name in ("1f1b", "gpipe") and not args.overlap:
        print(f"expected idle per rank (p-1)(F+B) = {one_f_one_b_idle(p, forward, backward):g}; simulated "
              f"{idle:g}")
        if args.forward_time is None and args.backward_time is None:
            print(f"expected bubble (p-1)/(m+p-1) with equal F and B = {expected_bubble_fraction(name, p, m):.4f}")
    elif name == "interleaved" and not args.overlap and args.forward_time is None and args.backward_time is None:
        print(f"expected bubble (p-1)/(v*m+p-1) with equal F and B = "
              f"{expected_bubble_fraction(name, p, m, vpp):.4f}")
    elif name == "zb-h1":
        print(f"expected idle per rank (p-1)(F+I-W) (Qi et al. 2024, ZB-H1) = "
              f"{zb_h1_idle(p, forward, backward - weight, weight):g}; 1F1B's (p-1)(F+B) = "
              f"{one_f_one_b_idle(p, forward, backward):g}; simulated {idle:g}")
    elif name == "dualpipev":
        print(f"expected idle per rank (PP/2-1)(F&B+B-3W) (deepseek-ai/DualPipe, PP = {2 * p} stages) = "
              f"{dualpipev_idle(p, overlapped, backward, weight):g}; simulated {idle:g}; activations per rank "
              f"PP+1 = {2 * p + 1} chunk-micro-batches published, simulated peak {max(result.peak_in_flight)}; "
              f"parameters per rank 2x a {2 * p}-stage 1F1B's (2 chunks)")
    if layout is not None:
        scaled = "; chunk times scaled by their layers" if costs is not None else ""
        print(f"layout {layout.text} (pp {layout.pp} x vpp {layout.vpp}{scaled}):")
        print(layout.describe())
    if args.plot:
        print(f"wrote {plot_png(schedule, result, args.plot)}")
    return 0
