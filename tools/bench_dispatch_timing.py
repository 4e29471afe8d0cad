"""``moefold bench-dispatch``'s measuring pieces: per-phase timers, the slowest rank's median, sums over ranks, the
raw collectives a dispatcher is built on (with its token bytes) and one timed dispatch + combine round trip."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from moefold.parallel.comm import all_gather_single, reduce_scatter_single


class PhaseTimes:
    """``timer(phase)`` context managers that add synchronised wall time per phase."""

    def __init__(self, device: torch.device):
        self.device, self.enabled = device, False
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.seconds[phase] += time.perf_counter() - t0


def median_max(values: list[float], device: torch.device) -> float:
    t = torch.tensor([statistics.median(values)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())


def raw_exchange(kind: str, handle, dims, T: int, K: int, H: int, dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> tuple[str, Callable[[], None], int] | None:
    """(name, one timed call of the collectives ``kind`` is built on with its token bytes, bytes sent per rank)."""
    es = torch.finfo(dtype).bits // 8
    if kind == "allgather":
        group, W = dims.etp_ep_group, dims.ep * dims.etp
        if W == 1:
            return None
        Tm = handle.max_tokens
        x = torch.randn(Tm, H, generator=gen, device="cpu").to(device, dtype)   # gen is a CPU generator
        partial = torch.randn(W * Tm, H, generator=gen, device="cpu").to(device, dtype)

        def run() -> None:
            out = torch.empty(W * Tm, H, dtype=dtype, device=device)
            all_gather_single(out, x, group)
            reduce_scatter_single(torch.empty(Tm, H, dtype=dtype, device=device), partial, group)

        # ring algorithms: each rank sends (W-1)/W of the gathered / reduced buffer
        return "all_gather + reduce_scatter", run, 2 * (W - 1) * Tm * H * es
    if dims.ep == 1:
        return None
    if hasattr(handle, "plan"):
        send, recv = list(handle.plan.send), list(handle.plan.recv)
    else:  # flex: an even all-to-all of this rank's copies, what an ideal exchange would move
        n = -(-T * K // dims.ep)
        send = recv = [n] * dims.ep
    buf = torch.randn(sum(send), H, generator=gen, device="cpu").to(device, dtype)
    group = dims.ep_group

    def run() -> None:
        back = torch.empty(sum(recv), H, dtype=dtype, device=device)
        dist.all_to_all_single(back, buf, recv, send, group=group)
        home = torch.empty(sum(send), H, dtype=dtype, device=device)
        dist.all_to_all_single(home, back, send, recv, group=group)

    return "all_to_all_single x2", run, 2 * sum(n for r, n in enumerate(send) if r != dims.ep_rank) * H * es


def time_round_trip(dispatcher, x: torch.Tensor, routing, sync: Callable[[], None], barrier: Callable[[], None],
                    ) -> tuple[float, object]:
    """(seconds of dispatch + combine with the rows passed straight back, the handle). Dispatch and combine
    are each timed from a barrier, so one rank's skew in the untimed gap does not count."""
    sync()
    barrier()
    t0 = time.perf_counter()
    out = dispatcher.dispatch(x, routing)
    sync()
    t1 = time.perf_counter()
    barrier()
    t2 = time.perf_counter()
    dispatcher.combine(out.tokens_NH, out.handle)
    sync()
    return (t1 - t0) + (time.perf_counter() - t2), out.handle


__all__ = ["PhaseTimes", "median_max", "raw_exchange", "sum_ranks", "time_round_trip"]
