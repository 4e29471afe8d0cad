"""``moefold bench-dispatch --fp8``: the FP8 dispatch's bytes and time against the plain one, same run.

Called by ``tools.bench_dispatch`` on every rank after its own measurements: times dispatch + combine of an
FP8 dispatcher (``--moe-fp8-dispatch``) on fresh routings the way the bench times the plain one (after
a barrier, untimed expert work between, median over ``--iters``, slowest rank), and counts the bytes
each rank sends to the others: FP8 rows (``H`` e4m3 bytes + 4 per 128-channel scale) going out,
``--dtype`` rows coming back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist

from moefold.dispatch.config import DispatchConfig
from moefold.dispatch.fp8_exchange import row_bytes
from moefold.dispatch.routing import Routing
from moefold.parallel.dims import ParallelDims
from moefold.tools.bench_dispatch_timing import median_max, time_round_trip


def _mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        return float(t.item()) / dist.get_world_size()
    return value


def report_fp8(config: DispatchConfig, args: argparse.Namespace, dims: ParallelDims, x: torch.Tensor,
               route: Callable[[], Routing], plain_seconds: float, rows_to_others: int) -> None:
    """Time the FP8 dispatcher ``config`` asks for and print its bytes and time against ``plain_seconds`` (rank 0
    prints).

    ``rows_to_others``: token copies this rank's dispatch sends to experts on other ranks (the bench's count).
    """
    from moefold.dispatch import build_dispatcher

    device, H = x.device, x.shape[1]
    fp8 = build_dispatcher(config, args.num_experts, dims)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    barrier = (lambda: dist.barrier()) if dist.is_initialized() else (lambda: None)
    seconds, rows = [], rows_to_others
    for i in range(args.warmup + args.iters):
        t, _ = time_round_trip(fp8, x, route(), sync, barrier)
        if i >= args.warmup:
            seconds.append(t)
    t_fp8 = median_max(seconds, device)
    hp_row = H * x.element_size()
    plain_bytes = _mean_over_ranks(2 * rows * hp_row, device)
    fp8_bytes = _mean_over_ranks(rows * (row_bytes(H) + hp_row), device)
    if dims.rank == 0:
        dtype = str(x.dtype).removeprefix("torch.")
        print(f"  fp8 {config.kind} dispatch+combine: {1e3 * t_fp8:.2f} ms, {t_fp8 / plain_seconds:.2f}x the {dtype} "
              "time; "
              f"dispatch bytes {row_bytes(H) / hp_row:.2f}x, dispatch+combine bytes "
              f"{fp8_bytes / 1e6:.2f} MB = {fp8_bytes / max(plain_bytes, 1):.2f}x "
              f"(FP8 rows out: {row_bytes(H)} B per token copy vs {hp_row} B; combine stays {dtype})")


__all__ = ["report_fp8"]
