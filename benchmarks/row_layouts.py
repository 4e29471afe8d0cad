"""The experts' row layouts as training meets them: new routing, so new per-expert row counts, on every step.

    python benchmarks/row_layouts.py --cpu-time                       # bf16, a and b, 60 steps per layout
    python benchmarks/row_layouts.py --cpu-time --steps 160 --configs 16,2,1024 --plot row_layouts.png

``benchmarks/moe_layer.py`` times one layer on the same input every round: the same routing, so the same GEMM
shapes on every call. That flatters exact row counts (``packed``) on a CPU whose bf16 GEMMs are compiled per shape
(AMX: oneDNN JIT-compiles a kernel for each new shape, ~6-7 ms each on the Intel Xeon, against ~1 ms for the GEMM,
and keeps them in a cache of 1024), and it is the case ``moe.cpu.rows_gemm._rule`` was decided for. Here each
step of the trainer's MoE layer (``GradSync`` main grads, gradient-accumulation fusion, fwd + bwd, world 1) takes a
new input, so its routing and the experts' row counts change as they do between training steps, and every layout
(``packed``, ``aligned``, ``uniform``; ``--layouts``) runs ``--steps`` steps in its own fresh layer. Printed per
layout: the first step (start-up and first compilations), the medians of each quarter of the steps (whether the
compilations fade as the kernel cache fills) and of the last half. ``--plot`` draws every step's time.

The first line names the machine (its bf16 matmul units decide which layout wins).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from moefold.moe.cpu.expert_rows import RowLayout
from moefold.training.observe.machine import describe_machine

try:
    from benchmarks.moe_layer import DTYPES, trainer_layer
except ImportError:   # run as a script: benchmarks/ itself is on sys.path
    from moe_layer import DTYPES, trainer_layer


def run(T: int, H: int, E: int, k: int, F: int, dtype: torch.dtype, layout: str, steps: int,
        clock: Callable[[], float]) -> list[float]:
    """Seconds of each of ``steps`` steps, each on a new input (new routing)."""
    _, _, step = trainer_layer(H, E, k, F, dtype, row_layout=layout)
    gen = torch.Generator().manual_seed(2)
    gy = torch.randn(T, 1, H, dtype=dtype, generator=gen)
    times = []
    for s in range(steps):
        x = torch.randn(T, 1, H, generator=gen, dtype=dtype).requires_grad_()
        t0 = clock()
        step(x, gy)
        times.append(clock() - t0)
        if sys.stderr.isatty():
            print(f"\r  {layout}: step {s + 1}/{steps}", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="16,2,1024;64,8,256", help="E,k,F;... (moe_layer.py's a and b)")
    ap.add_argument("--layouts", default="packed,aligned,uniform")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-time", action="store_true", help="time with this process's CPU time (a shared machine)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw every step's time per layout and config")
    a = ap.parse_args(argv)
    if a.steps < 4:
        ap.error(f"--steps={a.steps}; valid: an integer >= 4 (the table reports quarters)")
    layouts = [str(RowLayout(x)) for x in a.layouts.split(",")]
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.cpu_time else time.perf_counter
    print(describe_machine())
    print(f"# clock: {'process CPU' if a.cpu_time else 'wall'}; T={a.tokens} H={a.hidden} {a.dtype}; {a.steps} steps "
          f"per layout, a new input (new routing) every step; ms")
    print(f"{'E':>3} {'k':>2} {'F':>5} {'layout':8} {'first':>7} {'q1':>7} {'q2':>7} {'q3':>7} {'q4':>7} "
          f"{'last half':>9}")
    curves: dict[str, list[float]] = {}
    for spec in a.configs.split(";"):
        E, k, F = (int(v) for v in spec.split(","))
        for layout in layouts:
            t = run(a.tokens, a.hidden, E, k, F, DTYPES[a.dtype], layout, a.steps, clock)
            q = a.steps // 4
            quarters = [statistics.median(t[i * q:(i + 1) * q]) * 1e3 for i in range(4)]
            print(f"{E:>3} {k:>2} {F:>5} {layout:8} {t[0] * 1e3:>7.0f} "
                  + " ".join(f"{v:>7.1f}" for v in quarters)
                  + f" {statistics.median(t[a.steps // 2:]) * 1e3:>9.1f}", flush=True)
            curves[f"E{E} k{k} F{F} {layout}"] = [v * 1e3 for v in t]
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, ys in curves.items():
            ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1)
        ax.set_xlabel("step (a new routing each)")
        ax.set_ylabel(f"layer fwd + bwd, ms ({'CPU' if a.cpu_time else 'wall'})")
        ax.set_ylim(0, 2 * max(statistics.median(ys) for ys in curves.values()))
        parts = [p.strip() for p in describe_machine().removeprefix("# machine: ").split(",")]
        ax.set_title(", ".join(parts[:1] + parts[2:4]), fontsize=9)   # the CPU and its bf16 matmul units
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"# plot: {a.plot}")


if __name__ == "__main__":
    main()
