"""``moefold schedule``: print a pipeline schedule's timeline and bubble fraction (and plot it)."""

from __future__ import annotations

import argparse

from moefold.pipeline.schedules import SCHEDULES, build_schedule, expected_bubble_fraction
from moefold.pipeline.simulator import simulate
from moefold.pipeline.stages import StageLayout
from moefold.pipeline.timeline import plot_png, render_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=4,
                        help="pipeline ranks (default 4)")
    parser.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp", type=int, default=1,
                        help="virtual chunks per rank (default 1; > 1 selects the interleaved schedule)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--schedule", choices=SCHEDULES, default=None,
                        help="default: interleaved when --vpp > 1, else 1f1b")
    parser.add_argument("--forward-time", type=float, default=None,
                        help="time of one forward on one chunk (default 1/vpp)")
    parser.add_argument("--backward-time", type=float, default=None,
                        help="time of one backward on one chunk (default 1/vpp)")
    parser.add_argument("--num-layers", type=int, default=None, help="also print the layer split")
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        help="with --num-layers: layers on the first stage (default: even split)")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                        help="with --num-layers: layers on the last stage (default: even split)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the timeline as a PNG")


def main(args: argparse.Namespace) -> int:
    name = args.schedule or ("interleaved" if args.vpp > 1 else "1f1b")
    try:
        schedule = build_schedule(name, args.pp, args.microbatches, args.vpp)
        layout = None
        if args.num_layers is not None:
            layout = StageLayout(args.num_layers, args.pp, args.vpp, args.decoder_first_pipeline_num_layers,
                                 args.decoder_last_pipeline_num_layers)
    except ValueError as exc:
        print(f"moefold schedule: error: {exc}")
        return 2
    chunk_time = 1.0 / schedule.vpp
    forward = args.forward_time if args.forward_time is not None else chunk_time
    backward = args.backward_time if args.backward_time is not None else chunk_time
    result = simulate(schedule, forward, backward)
    print(render_text(schedule, result))
    if args.forward_time is None and args.backward_time is None:
        v = schedule.vpp
        formula = "(p-1)/(v*m+p-1)" if name == "interleaved" else "(p-1)/(m+p-1)"
        print(f"expected {formula} = {expected_bubble_fraction(name, args.pp, args.microbatches, v):.4f} "
              f"(equal forward and backward times)")
    if layout is not None:
        print(layout.describe())
    if args.plot:
        print(f"wrote {plot_png(schedule, result, args.plot)}")
    return 0
