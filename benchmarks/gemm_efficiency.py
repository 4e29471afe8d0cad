"""GEMM throughput on this device at the planner's published shapes, and the roofline fitted to it.

    python benchmarks/gemm_efficiency.py --cluster h100                 # on a GPU: bf16, and FP8 where it runs
    python benchmarks/gemm_efficiency.py --device cpu --peak-tflops 2 --hbm-gbps 20 --scale 16 --dtypes bf16

For every shape of ``planner.gemm_efficiency``'s published points (``BF16_H100``, ``FP8_H800``: ``groups`` x
``[m, k] @ [k, n]``; grouped points as one ``bmm``) it prints the measured TFLOP/s beside what the planner's
constants predict, then fits the same model to the measurements (``fit_model``) against the device's peaks
(``--cluster``'s preset or ``--peak-tflops`` / ``--fp8-peak-tflops`` / ``--hbm-gbps``) and prints the fitted
constants: the values to put in ``gemm_efficiency.BF16`` / ``FP8`` once a GPU has been measured. FP8 uses
``torch._scaled_mm`` (e4m3 inputs, per-tensor scales, bf16 output) and is skipped, with the reason, where it
does not run. ``--scale N`` divides every dimension by N (a quick run; the fit is then of small shapes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from moefold.planner.cluster import CLUSTERS, load_cluster
from moefold.planner.gemm_efficiency import BF16_H100, FP8_H800, MODELS, GemmPoint, fit_model
from moefold.training.observe.machine import describe_machine

POINTS = {"bf16": BF16_H100, "fp8": FP8_H800}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(dtype: str, p: GemmPoint, device: torch.device):
    if dtype == "bf16":
        a = torch.randn(p.groups, p.m, p.k, device=device, dtype=torch.bfloat16)
        b = torch.randn(p.groups, p.k, p.n, device=device, dtype=torch.bfloat16)
        return (lambda: torch.bmm(a, b)) if p.groups > 1 else (lambda: a[0] @ b[0])
    a = torch.randn(p.groups, p.m, p.k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(p.groups, p.n, p.k, device=device).to(torch.float8_e4m3fn)   # column-major B for _scaled_mm
    one = torch.ones((), device=device)

    def run() -> None:
        for g in range(p.groups):
            torch._scaled_mm(a[g], b[g].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return run


def measure(dtype: str, p: GemmPoint, device: torch.device, iters: int) -> float:
    """Median TFLOP/s of ``p`` in ``dtype`` on ``device``."""
    run = _runner(dtype, p, device)
    run()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return p.flops / statistics.median(times) / 1e12


def fp8_skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "FP8 GEMMs (torch._scaled_mm) need a CUDA GPU with FP8 tensor cores"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute capability < 8.9)"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--cluster", default=None, help=f"the device's peaks from a preset: {', '.join(CLUSTERS)}")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (instead of --cluster)")
    p.add_argument("--fp8-peak-tflops", type=float, default=None, help="dense FP8 peak (instead of --cluster)")
    p.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth, GB/s (instead of --cluster)")
    p.add_argument("--dtypes", default="bf16,fp8", help="comma-separated: bf16, fp8")
    p.add_argument("--scale", type=int, default=1, help="divide every GEMM dimension by this (quick runs)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per shape (median)")
    a = p.parse_args(argv)
    dtypes = [d for d in a.dtypes.split(",") if d]
    if not dtypes or not set(dtypes) <= set(POINTS):
        p.error(f"--dtypes={a.dtypes!r}: valid values are bf16, fp8 (comma-separated)")
    if a.scale < 1 or a.iters < 1:
        p.error(f"--scale={a.scale} and --iters={a.iters} must be positive")
    if a.cluster is not None:
        c = load_cluster(a.cluster)
        peaks = {"bf16": c.bf16_tflops, "fp8": c.fp8_tflops or c.bf16_tflops}
        hbm = c.hbm_gbps
    elif a.peak_tflops and a.hbm_gbps:
        peaks = {"bf16": a.peak_tflops, "fp8": a.fp8_peak_tflops or a.peak_tflops}
        hbm = a.hbm_gbps
    else:
        p.error("give --cluster NAME or --peak-tflops and --hbm-gbps (the peaks the fit's shares are of)")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"moefold gemm_efficiency: --device {a.device}: no CUDA device here (use --device cpu with "
              "--peak-tflops and --hbm-gbps)", file=sys.stderr)
        return 2
    print(describe_machine())
    print(f"# peaks: bf16 {peaks['bf16']:g} TFLOP/s, fp8 {peaks['fp8']:g}, HBM {hbm:g} GB/s; scale 1/{a.scale}")
    for dtype in dtypes:
        reason = fp8_skip_reason(device) if dtype == "fp8" else None
        if reason:
            print(f"# {dtype} skipped: {reason}")
            continue
        model = MODELS[dtype]
        measured = []
        print(f"{'dtype':5} {'groups':>6} {'m':>6} {'n':>6} {'k':>6} {'TFLOP/s':>9} {'planner':>9}")
        for q in POINTS[dtype]:
            s = GemmPoint(max(1, q.m // a.scale), max(1, q.n // a.scale), max(1, q.k // a.scale), 0.0, q.groups)
            tflops = measure(dtype, s, device, a.iters)
            predicted = s.flops / model.seconds_at(peaks[dtype], hbm, s.m, s.n, s.k, s.groups) / 1e12
            measured.append(GemmPoint(s.m, s.n, s.k, tflops, s.groups))
            print(f"{dtype:5} {s.groups:>6} {s.m:>6} {s.n:>6} {s.k:>6} {tflops:>9.1f} {predicted:>9.1f}", flush=True)
        fit = fit_model(dtype, measured, (peaks[dtype], hbm), model.input_bytes, model.output_bytes)
        print(f"# fitted {dtype}: compute_share={fit.compute_share}, memory_share={fit.memory_share}, "
              f"overlap={fit.overlap}, launch_s={fit.launch_s:g} (planner: {model.compute_share}, "
              f"{model.memory_share}, {model.overlap}, {model.launch_s:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
