"""Context-parallel attention, forward + backward: the math reference against the fused kernels (CPU, gloo).

    python benchmarks/cp_attention.py                          # S=8192, cp 2, both exchange modes, fp32
    python benchmarks/cp_attention.py --window 1024 --dtype bf16 --modes p2p

For each exchange mode and implementation it starts a fresh world of ``--cp`` gloo ranks (spawned
processes, one torch thread each), builds this rank's q, k, v (``[B, heads, S/cp, dim]``) and the
output gradient, and times ``context_parallel_attention`` forward + backward (median over
``--iters`` after one warm-up; the slowest rank, each timed region starting at a barrier; wall-clock,
or each rank's process CPU time with ``--cpu-time`` on a loaded machine).

Peak memory: the process's resident-set high-water mark (Linux ``VmHWM``), reset to the current
RSS after the warm-up step (``/proc/self/clear_refs`` <- 5; the warm-up faults in code pages and
communication buffers), minus the RSS at that moment: the most memory the timed forward+backward
steps held on top of their inputs, whatever allocated it (glibc hands large freed blocks back to
the OS, so RSS follows the live tensors). A fresh process per variant keeps one variant's peak out
of the other's. Printed as the max over ranks. If the kernel refuses the reset, the figure is the
peak since process start minus the RSS after the warm-up (said in the output).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank(rank: int, world: int, store_path: str, args: dict, fused: bool, mode: str, results: mp.Queue) -> None:
    from moefold.dense.context_parallel import context_parallel_attention, context_parallel_positions
    from moefold.parallel.dims import ParallelConfig, ParallelDims

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    try:
        dims = ParallelDims.build(ParallelConfig(cp=world))
        S, B, h, g, d, dv = args["seq"], args["batch"], args["heads"], args["kv_heads"], args["head_dim"], args["v_dim"]
        dtype, window = DTYPES[args["dtype"]], args["window"]
        gen = torch.Generator().manual_seed(rank)
        s_local = S // world
        q = torch.randn(B, h, s_local, d, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(B, g, s_local, d, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(B, g, s_local, dv, generator=gen).to(dtype).requires_grad_()
        grad_out = torch.randn(B, h, s_local, dv, generator=gen).to(dtype)
        pos = context_parallel_positions(S, dims.cp_rank, world)

        def step() -> None:
            for t in (q, k, v):
                t.grad = None
            out = context_parallel_attention(q, k, v, pos, dims.cp_group, mode=mode, scale=d ** -0.5,
                                             sliding_window=window, fused=fused)
            out.backward(grad_out)

        clock = time.process_time if args["cpu_time"] else time.perf_counter
        step()  # warm-up: faults in the kernels' code pages and the process group's buffers
        rss_before = _status_kb("VmRSS")
        reset = _reset_peak()
        times = []
        for _ in range(args["iters"]):
            dist.barrier(dims.cp_group)
            t0 = clock()
            step()
            times.append(clock() - t0)
        peak = _status_kb("VmHWM")
        results.put((rank, statistics.median(times), (peak - rss_before) / 1024, peak / 1024, reset))
    finally:
        dist.destroy_process_group()


def run_variant(args: dict, fused: bool, mode: str) -> tuple[float, float, float, bool]:
    """(median seconds, peak MiB over the inputs, peak RSS MiB, reset worked), slowest / largest rank."""
    world = args["cp"]
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="moefold-bench-cp-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), args, fused, mode, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = [results.get(timeout=3600) for _ in range(world)]
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"a rank exited with code {p.exitcode}")
    return (max(r[1] for r in rows), max(r[2] for r in rows), max(r[3] for r in rows), all(r[4] for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--v-dim", type=int, default=None, help="value head dim (default: --head-dim; MLA: smaller)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--window", type=int, default=None, help="sliding window (default: plain causal)")
    p.add_argument("--modes", default="p2p,all_gather")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--cpu-time", action="store_true",
                   help="time with each rank's process CPU time instead of wall-clock (a shared, loaded machine; "
                        "leaves out time spent waiting for the other rank)")
    a = p.parse_args(argv)
    args = {"seq": a.seq, "cp": a.cp, "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "v_dim": a.v_dim or a.head_dim, "dtype": a.dtype, "window": a.window,
            "iters": a.iters, "cpu_time": a.cpu_time}
    from moefold.training.observe.machine import bf16_skip_reason, describe_machine

    print(describe_machine())
    print(f"# {a.cp} gloo ranks x 1 torch thread, clock: {'process CPU' if a.cpu_time else 'wall'}")
    skip = bf16_skip_reason() if a.dtype == "bf16" else None
    if skip is not None:
        print(f"# bf16 skipped: {skip}")
        return 0
    print(f"# S={a.seq} cp={a.cp} B={a.batch} heads={a.heads}/{a.kv_heads} head_dim={a.head_dim}/{args['v_dim']} "
          f"dtype={a.dtype} window={a.window}; fwd+bwd median of {a.iters} (slowest rank); peak memory = RSS "
          "high-water mark over the inputs (max over ranks)")
    print(f"{'mode':10} {'impl':6} {'time s':>8} {'peak MiB':>9} {'peak RSS MiB':>12} {'time fused/math':>15} "
          f"{'mem fused/math':>14}")
    for mode in a.modes.split(","):
        measured = {}
        for impl, fused in (("math", False), ("fused", True)):
            t, mem, rss, reset = run_variant(args, fused, mode)
            measured[impl] = (t, mem)
            ratios = ""
            if impl == "fused":
                ratios = f"{t / measured['math'][0]:>15.2f} {mem / measured['math'][1]:>14.3f}"
            print(f"{mode:10} {impl:6} {t:>8.2f} {mem:>9.0f} {rss:>12.0f} {ratios}"
                  + ("" if reset else "  (peak not reset: since process start)"), flush=True)
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
