"""One MoE layer, forward + backward, against the dense-GEMM ceiling of the same work (world 1).

    python benchmarks/moe_layer.py        # T=4096 H=512, bf16 + fp32, both configs, eager + compiled, both allocators
    python benchmarks/moe_layer.py --dtypes bf16 --configs 16,2,1024 --iters 7 --no-compile --allocators default

For each (dtype, E/k/F config, GEMM backend, eager or ``--compile``d) it prints the median time of

- layer:   the whole MoELayer (router, local permutation, experts, weighted unpermutation), fwd + bwd
- experts: the grouped experts alone on already-permuted rows (GEMMs + activation), fwd + bwd

and their achieved GFLOP/s counting only the expert GEMMs (3 projections x (fwd + 2 bwd) x
2*N*H*F, N = T*k). The ceiling is measured in the same run: plain dense matmuls doing exactly
that work as if every routed copy went to one expert ([N, H] x [H, 2F], [N, F] x [F, H] and their
four backward products). The ratio layer/ceiling is the figure of merit. "compiled" is what
``--compile`` does to an MoE layer (``training.compile.compile_moe_layer``: router compiled, the
experts' SwiGLU one fused kernel per direction); its compile time is printed once.
Routing is near-uniform (random router weights, dropless).

The first line names the machine (CPU capability, bf16 matmul units, threads, allocator
settings: with glibc's defaults every freed buffer over 32 MB goes back to the OS and the next
one is page-faulted in again, which on CPU costs as much as a good part of the GEMMs; see
RESULTS.md). ``--allocators default,tuned`` (the default) runs the whole table twice, the second
time in a child process started with ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at
4 GiB (glibc keeps freed memory for reuse), so one command shows both. bf16 rows are skipped, with
the reason, on a CPU without bf16 matmul units.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from moefold.moe.config import MoEConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.machine import bf16_skip_reason, describe_machine
from moefold.parallel.sharding import init_parameters
from moefold.training.compile import compile_moe_layer, compile_unavailable

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
CPU_CLOCK = False  # --cpu-time


def median_time(fn: Callable[[], None], iters: int, warmup: int = 1) -> float:
    """Median seconds per call: wall-clock, or this process's CPU time with ``CPU_CLOCK`` (a loaded machine)."""
    clock = time.process_time if CPU_CLOCK else time.perf_counter
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def dense_ceiling(N: int, H: int, F: int, dtype: torch.dtype, iters: int) -> float:
    """Seconds for the six dense matmuls of one gated MLP over N rows, fwd + bwd."""
    x, gy = torch.randn(N, H, dtype=dtype), torch.randn(N, H, dtype=dtype)
    w13, w2 = torch.randn(H, 2 * F, dtype=dtype), torch.randn(F, H, dtype=dtype)
    h, dh = torch.randn(N, F, dtype=dtype), torch.randn(N, 2 * F, dtype=dtype)

    def step() -> None:
        x @ w13          # gate + up
        h @ w2           # down
        gy @ w2.T        # d act
        h.T @ gy         # d w2
        dh @ w13.T       # d x
        x.T @ dh         # d w13

    return median_time(step, iters)


def bench(T: int, H: int, E: int, k: int, F: int, dtype: torch.dtype, backend: str, iters: int,
          compiled: bool) -> tuple[float, float, float]:
    """(layer seconds, experts seconds, seconds the first layer step took beyond a timed one: compiling)."""
    router = RouterConfig(num_experts=E, topk=k, load_balancing_type="none")
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, router=router, dispatcher="local", gemm_backend=backend)
    layer = MoELayer(cfg, H, ParallelDims.single(), dtype=dtype)
    init_parameters(layer, seed=0)
    if compiled:
        compile_moe_layer(layer)
    x = torch.randn(T, 1, H, dtype=dtype, requires_grad=True)
    gy = torch.randn(T, 1, H, dtype=dtype)

    def layer_step() -> None:
        layer.zero_grad(set_to_none=True)  # as a trainer does: no gradient accumulation in the timing
        x.grad = None
        y, _ = layer(x)
        y.backward(gy)

    t0 = time.perf_counter()
    layer_step()  # compiles, when compiled
    t_first = time.perf_counter() - t0
    t_layer = median_time(layer_step, iters)
    # the experts alone, on the rows the dispatcher produced
    with torch.no_grad():
        routed = layer.router(x.view(T, H))
        d = layer.dispatcher.dispatch(x.view(T, H).detach(), routed.routing)
    rows = d.tokens_NH.detach().requires_grad_()
    g_rows = torch.randn_like(rows)

    def experts_step() -> None:
        layer.zero_grad(set_to_none=True)
        rows.grad = None
        layer.experts(rows, d.tokens_per_expert_e).backward(g_rows)

    return t_layer, median_time(experts_step, iters), max(0.0, t_first - t_layer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--configs", default="16,2,1024;64,8,256", help="E,k,F;E,k,F;...")
    p.add_argument("--backends", default="grouped_mm")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--allocators", default="default,tuned",
                   help="default: this process's allocator settings; tuned: again in a child process with "
                        "glibc's mmap and trim thresholds at 4 GiB")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time instead of wall-clock (use with --threads 1 "
                        "on a shared, loaded machine)")
    a = p.parse_args(argv)
    allocators = [v for v in a.allocators.split(",") if v]
    if not set(allocators) <= {"default", "tuned"} or not allocators:
        p.error(f"--allocators={a.allocators!r}: valid values are default, tuned (comma-separated)")
    if allocators != ["default"]:  # the tuned table runs in a child with the allocator set from its start
        args = list(sys.argv[1:] if argv is None else argv)
        args = [v for i, v in enumerate(args) if v != "--allocators" and (i == 0 or args[i - 1] != "--allocators")
                and not v.startswith("--allocators=")]
        if "default" in allocators:
            main([*args, "--allocators", "default"])
            print()
        return subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--allocators", "default"],
                              env={**os.environ, **TUNED_MALLOC}).returncode
    global CPU_CLOCK
    CPU_CLOCK = a.cpu_time
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, H = a.tokens, a.hidden
    modes = [False]
    if not a.no_compile:
        reason = compile_unavailable("cpu")
        if reason is None:
            modes.append(True)
        else:
            print(f"# compiled rows skipped: {reason}")
    print(describe_machine())
    print(f"# clock: {'process CPU' if a.cpu_time else 'wall'}; T={T} H={H}; GFLOP/s count expert GEMMs only; "
          f"ratio = layer / dense ceiling")
    print(f"{'dtype':5} {'E':>3} {'k':>2} {'F':>5} {'backend':10} {'mode':8} {'layer ms':>9} {'GF/s':>7} "
          f"{'experts ms':>10} {'GF/s':>7} {'ceiling GF/s':>12} {'layer/ceil':>10} {'experts/ceil':>12}")
    compile_s = 0.0
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        skip = bf16_skip_reason() if dtype == torch.bfloat16 else None
        if skip is not None:
            print(f"{dname:5} skipped: {skip}")
            continue
        for spec in a.configs.split(";"):
            E, k, F = (int(v) for v in spec.split(","))
            N = T * k
            flops = 3 * 3 * 2 * N * H * F
            t_dense = dense_ceiling(N, H, F, dtype, a.iters)
            ceil = flops / t_dense / 1e9
            for backend in a.backends.split(","):
                for compiled in modes:
                    t_layer, t_exp, t_compile = bench(T, H, E, k, F, dtype, backend, a.iters, compiled)
                    compile_s += t_compile if compiled else 0.0
                    gl, ge = flops / t_layer / 1e9, flops / t_exp / 1e9
                    mode = "compiled" if compiled else "eager"
                    print(f"{dname:5} {E:>3} {k:>2} {F:>5} {backend:10} {mode:8} {t_layer * 1e3:>9.1f} {gl:>7.0f} "
                          f"{t_exp * 1e3:>10.1f} {ge:>7.0f} {ceil:>12.0f} {gl / ceil:>10.2f} {ge / ceil:>12.2f}",
                          flush=True)
    if len(modes) > 1:
        print(f"# compiling (first compiled step minus a timed one, all rows): {compile_s:.1f} s")
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
