"""The simulator's bubble and activation table for every pipeline schedule (no computation, a few seconds).

    python benchmarks/schedule_bubbles.py                     # pp 4 and 8, m = 2pp and 4pp, F 1, B 2 (I 1 + W 1)
    python benchmarks/schedule_bubbles.py --pp 8 --microbatches 32 64 --overlapped 0.8

Per schedule (each on ``pipeline.simulator``'s clock with one chunk's forward 1 for a pp-stage model; the
two-chunk schedules run chunks of half a stage, so their times are halved): the bubble fraction, the idle time per
rank, the published formula where there is one, and the peak (micro-batch, stage) activations in stage units. The
FB steps of DualPipeV and of the overlap take ``--overlapped`` x (F + B) (1: no overlap gain). Printed as a
Markdown table (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse

from moefold.pipeline.schedules import (
    build_schedule,
    dualpipev_idle,
    one_f_one_b_idle,
    zb_h1_idle,
)
from moefold.pipeline.simulator import simulate

# name -> (schedule, vpp, overlap)
SCHEDULES = {"1f1b": ("1f1b", 1, False), "zb-h1": ("zb-h1", 1, False), "interleaved v2": ("interleaved", 2, False),
             "interleaved v2 + overlap": ("interleaved", 2, True), "zbv": ("zbv", 2, False),
             "dualpipev": ("dualpipev", 2, False)}


def rows(pp: int, m: int, overlapped: float) -> list[str]:
    out = []
    for label, (name, vpp, overlap) in SCHEDULES.items():
        f, w = 1.0 / vpp, 1.0 / vpp   # a stage's forward 1, its weight GEMMs 1 (B = 2 = I + W)
        b = 2.0 / vpp
        fb = overlapped * (f + b)
        times = {"F": f, "B": b, "I": b - w, "W": w, "FB": fb}
        schedule = build_schedule(name, pp, m, vpp, overlap=overlap, backward_ratio=b / f, weight_ratio=w / f,
                                  overlapped_ratio=fb / f)
        result = simulate(schedule, duration=lambda _r, a, t=times: t[a.kind])
        idle = max(result.makespan - busy for busy in result.busy)
        formula = {"1f1b": f"(p-1)(F+B) = {one_f_one_b_idle(pp, f, b):g}",
                   "zb-h1": f"(p-1)(F+I-W) = {zb_h1_idle(pp, f, b - w, w):g}",
                   "dualpipev": f"(PP/2-1)(F&B+B-3W) = {dualpipev_idle(pp, fb, b, w):g}"}.get(label, "")
        activations = max(result.peak_in_flight) / vpp   # in stage units
        out.append(f"| {pp} | {m} | {label} | {result.bubble_fraction:.3f} | {idle:g} | {formula} | "
                   f"{activations:g} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--microbatches", type=int, nargs="+", default=None, help="default: 2 pp and 4 pp")
    p.add_argument("--overlapped", type=float, default=1.0, help="an FB step's time / (F + B) (default 1)")
    args = p.parse_args(argv)
    print(f"F&B = {args.overlapped:g} x (F + B); stage times F 1, B 2 (I 1 + W 1)")
    print("| pp | m | schedule | bubble | idle per rank | published | peak activations (stages) |")
    print("|---|---|---|---|---|---|---|")
    for pp in args.pp:
        for m in args.microbatches or (2 * pp, 4 * pp):
            print("\n".join(rows(pp, m, args.overlapped)))


if __name__ == "__main__":
    main()
