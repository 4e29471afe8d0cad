"""One MoE layer, forward + backward, against the dense-GEMM ceiling of the same work (world 1).

    python benchmarks/moe_layer.py                       # T=4096 H=512, bf16 + fp32, both configs
    python benchmarks/moe_layer.py --dtypes bf16 --configs 16,2,1024 --iters 7

For each (dtype, E/k/F config, GEMM backend) it prints the median time of

- layer:   the whole MoELayer (router, local permutation, experts, unpermutation), fwd + bwd
- experts: the grouped experts alone on already-permuted rows (GEMMs + SwiGLU + probs), fwd + bwd

and their achieved GFLOP/s counting only the expert GEMMs (3 projections x (fwd + 2 bwd) x
2*N*H*F, N = T*k). The ceiling is measured in the same run: plain dense matmuls doing exactly
that work as if every routed copy went to one expert ([N, H] x [H, 2F], [N, F] x [F, H] and their
four backward products). The ratio layer/ceiling is the figure of merit (target >= 0.6).
Routing is near-uniform (random router weights, dropless). Prints the load average (the
machine may be shared) and any MALLOC_* / LD_PRELOAD allocator settings: with glibc's defaults
every freed buffer over 32 MB goes back to the OS and the next one is page-faulted in again,
which on CPU costs as much as a good part of the GEMMs (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from moefold.moe.config import MoEConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
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


def bench(T: int, H: int, E: int, k: int, F: int, dtype: torch.dtype, backend: str, iters: int) -> tuple[float, float]:
    router = RouterConfig(num_experts=E, topk=k, load_balancing_type="none")
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, router=router, dispatcher="local", gemm_backend=backend)
    layer = MoELayer(cfg, H, ParallelDims.single(), dtype=dtype)
    init_parameters(layer, seed=0)
    x = torch.randn(T, 1, H, dtype=dtype, requires_grad=True)
    gy = torch.randn(T, 1, H, dtype=dtype)

    def layer_step() -> None:
        layer.zero_grad(set_to_none=True)  # as a trainer does: no gradient accumulation in the timing
        x.grad = None
        y, _ = layer(x)
        y.backward(gy)

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
        layer.experts(rows, d.probs_N, d.tokens_per_expert_e).backward(g_rows)

    return t_layer, median_time(experts_step, iters)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--configs", default="16,2,1024;64,8,256", help="E,k,F;E,k,F;...")
    p.add_argument("--backends", default="grouped_mm,loop")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time instead of wall-clock (use with --threads 1 "
                        "on a shared, loaded machine)")
    a = p.parse_args(argv)
    global CPU_CLOCK
    CPU_CLOCK = a.cpu_time
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, H = a.tokens, a.hidden
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
          f"load average at start {os.getloadavg()[0]:.1f}, clock: {'process CPU' if a.cpu_time else 'wall'}")
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    print(f"# T={T} H={H}; GFLOP/s count expert GEMMs only; ratio = layer / dense ceiling; "
          f"allocator settings: {malloc or 'glibc defaults'}")
    print(f"{'dtype':5} {'E':>3} {'k':>2} {'F':>5} {'backend':10} {'layer ms':>9} {'GF/s':>7} {'experts ms':>10} "
          f"{'GF/s':>7} {'ceiling GF/s':>12} {'layer/ceil':>10} {'experts/ceil':>12}")
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        for spec in a.configs.split(";"):
            E, k, F = (int(v) for v in spec.split(","))
            N = T * k
            flops = 3 * 3 * 2 * N * H * F
            t_dense = dense_ceiling(N, H, F, dtype, a.iters)
            ceil = flops / t_dense / 1e9
            for backend in a.backends.split(","):
                t_layer, t_exp = bench(T, H, E, k, F, dtype, backend, a.iters)
                gl, ge = flops / t_layer / 1e9, flops / t_exp / 1e9
                print(f"{dname:5} {E:>3} {k:>2} {F:>5} {backend:10} {t_layer * 1e3:>9.1f} {gl:>7.0f} "
                      f"{t_exp * 1e3:>10.1f} {ge:>7.0f} {ceil:>12.0f} {gl / ceil:>10.2f} {ge / ceil:>12.2f}",
                      flush=True)
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
