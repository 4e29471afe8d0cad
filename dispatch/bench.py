"""``moefold bench-dispatch``: time one dispatcher's dispatch + combine against a raw all-to-all.

Runs on N CPU ranks that it spawns itself (gloo), or under ``torchrun`` (NCCL on GPUs). Every
rank routes ``--num-tokens`` random tokens (uniform or Zipf-skewed expert popularity), then:

* phases: route, permute, communicate, sort, unpermute (with a per-phase timer that
  synchronises the device, on separate iterations so the end-to-end figure is not disturbed);
* end to end: dispatch + combine, median over ``--iters`` after ``--warmup``;
* raw: ``all_to_all_single`` there and back with exactly the split sizes the dispatch used
  (the bytes a perfect dispatcher would move), measured in the same run the same way (after a
  barrier, receive buffers allocated inside the timed region as the dispatcher's are);
* local: the dispatcher's permute + unpermute of the same rows alone (what it does besides
  communicating), so that the ratio can be split into local work and exchange overhead;
* bytes that left each rank (dispatch + combine), achieved GB/s, dispatcher / raw ratio.

Times are the slowest rank's median. Nothing is asserted: this prints.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

PHASES = ("route", "permute", "communicate", "sort", "unpermute")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dispatcher", default="alltoall", choices=("local", "allgather", "alltoall", "flex"))
    parser.add_argument("--num-tokens", type=int, default=4096, help="tokens per rank (T)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (H)")
    parser.add_argument("--num-experts", type=int, default=16, help="experts (E)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (K)")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=1, help="expert-tensor-parallel size")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="CPU ranks to spawn (default ep*etp); ignored under torchrun")
    parser.add_argument("--skew", default="uniform", choices=("uniform", "zipf"),
                        help="expert popularity: uniform, or Zipf-like (logit bias -4 log(i+1) for expert i)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chunked-experts", type=int, default=None,
                        help="alltoall only: chunk the exchange per local expert up to this many local experts "
                             "(0: one exchange + sort); default: the dispatcher's")
    parser.add_argument("--fp8", action="store_true", help="also time FP8 dispatch (--moe-fp8-dispatch): bytes "
                                                           "and time against --dtype (dispatch.fp8_bench)")


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_tokens", "hidden", "num_experts", "topk", "ep", "etp", "iters"):
        if getattr(args, name) < (0 if name == "num_tokens" else 1):
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.topk > args.num_experts:
        raise ValueError(f"--topk={args.topk} exceeds --num-experts={args.num_experts}")
    if args.num_experts % args.ep:
        raise ValueError(f"--num-experts={args.num_experts} is not divisible by --ep={args.ep}")


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


def _route(x, w_gate, bias, topk):
    from moefold.dispatch.permutation import count_keys
    from moefold.moe.routing import Routing

    logits = (x.float() @ w_gate) + bias
    probs, ids = torch.softmax(logits, -1).topk(topk, -1)
    return Routing(probs, ids, count_keys(ids.reshape(-1), w_gate.shape[1]))


def _median_max(values: list[float], device: torch.device) -> float:
    t = torch.tensor([statistics.median(values)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank_main(args: argparse.Namespace) -> None:
    from moefold.dispatch import build_dispatcher
    from moefold.dispatch.permutation import permute, unpermute
    from moefold.parallel import ParallelConfig, ParallelDims
    from moefold.parallel.init import default_device

    device = default_device()
    dims = ParallelDims.build(ParallelConfig(ep=args.ep, etp=args.etp), device_type=device.type)
    rank0 = dims.rank == 0
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed + dims.rank)
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.topk
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    w_gate = (torch.randn(H, E, generator=torch.Generator().manual_seed(args.seed)) / H ** 0.5).to(device)
    skew = torch.zeros(E) if args.skew == "uniform" else -torch.log(torch.arange(1, E + 1, dtype=torch.float))
    skew = (skew * 4).to(device)  # Zipf-like popularity, sharpened so it survives the random logits

    timer = PhaseTimes(device)
    options = {} if args.max_chunked_experts is None else {"max_chunked_experts": args.max_chunked_experts}
    timed = build_dispatcher(args.dispatcher, E, dims, timer=timer, **options)
    plain = build_dispatcher(args.dispatcher, E, dims, **options)
    barrier = (lambda: dist.barrier()) if dist.is_initialized() else (lambda: None)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def progress(what: str, i: int, n: int) -> None:
        if rank0:
            print(f"\r  {what}: {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    # phases (timed iterations, synchronised per phase)
    for i in range(args.warmup + args.iters):
        timer.enabled = i >= args.warmup
        with timer("route"):
            routing = _route(x, w_gate, skew, K)
        barrier()
        out = timed.dispatch(x, routing)
        timed.combine(out.tokens_NH * out.probs_N.unsqueeze(1).to(dtype), out.handle)
        progress("phases", i + 1, args.warmup + args.iters)
    phase_ms = {p: 1e3 * timer.seconds[p] / args.iters for p in PHASES}

    # end to end, the raw exchange with the same split sizes, and the dispatcher's local work alone.
    # Like with like: each timed region starts right after a barrier, and both the dispatcher and
    # the raw exchange allocate their receive buffers inside it (the raw one sends from a buffer
    # that is ready, as the dispatcher's permute output is).
    e2e, raw, local, handle = [], [], [], None
    for i in range(args.warmup + args.iters):
        routing = _route(x, w_gate, skew, K)
        sync()
        barrier()
        t0 = time.perf_counter()
        out = plain.dispatch(x, routing)
        sync()
        t1 = time.perf_counter()
        # the experts' work is not the dispatcher's (untimed): rows pass through, scaled by their prob;
        # the barrier keeps that untimed work's rank skew out of the combine's exchange
        expert_out = out.tokens_NH * out.probs_N.unsqueeze(1).to(dtype)
        sync()
        barrier()
        t1b = time.perf_counter()
        y = plain.combine(expert_out, out.handle)
        sync()
        seconds = (t1 - t0) + (time.perf_counter() - t1b)
        handle = out.handle
        send, recv = _splits(handle, dims, T * K)
        buf = torch.randn(sum(send), H, generator=gen).to(device, dtype)
        sync()
        barrier()
        t2 = time.perf_counter()
        if dims.ep_group is not None and dims.ep > 1:
            back = torch.empty(sum(recv), H, dtype=dtype, device=device)
            dist.all_to_all_single(back, buf, recv, send, group=dims.ep_group)
            home = torch.empty(sum(send), H, dtype=dtype, device=device)
            dist.all_to_all_single(home, back, send, recv, group=dims.ep_group)
        sync()
        t3 = time.perf_counter()
        row_map = getattr(handle, "row_map", None)
        if row_map is not None and row_map.num_tokens == T:  # permute + unpermute of the same rows, no communication
            # (alltoall/local; the allgather and flex maps index gathered / received tokens instead)
            barrier()
            t4 = time.perf_counter()
            unpermute(permute(x, row_map), row_map)
            sync()
            local.append(time.perf_counter() - t4)
        if i >= args.warmup:
            e2e.append(seconds)
            raw.append(t3 - t2)
        progress("end to end + raw", i + 1, args.warmup + args.iters)
    del y
    send, _ = _splits(handle, dims, T * K)
    ep_rank = dims.ep_rank
    moved = 2 * sum(n for s, n in enumerate(send) if s != ep_rank) * H * torch.finfo(dtype).bits // 8
    moved_t = torch.tensor([moved], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(moved_t)
    moved_avg = float(moved_t.item()) / max(1, dims.world_size)
    t_e2e, t_raw = _median_max(e2e, device), _median_max(raw, device)
    t_local = _median_max(local[args.warmup:], device) if len(local) > args.warmup else None
    phase_max = {p: _median_max([v], device) for p, v in phase_ms.items()}
    if rank0:
        print(f"dispatcher={args.dispatcher} ranks={dims.world_size} ep={args.ep} etp={args.etp} T={T} H={H} "
              f"E={E} k={K} skew={args.skew} dtype={args.dtype} device={device.type} iters={args.iters}")
        print("phases (ms per dispatch+combine, slowest rank): " +
              "  ".join(f"{p} {phase_max[p]:.2f}" for p in PHASES))
        what = "" if hasattr(handle, "send_splits") else ", of an ideal exchange: this dispatcher moves more"
        print(f"bytes sent per rank (dispatch+combine, tokens only{what}): {moved_avg / 1e6:.2f} MB")
        print(f"dispatch+combine: {1e3 * t_e2e:.2f} ms  {moved_avg / t_e2e / 1e9:.3f} GB/s")
        if dims.ep > 1:
            print(f"raw all_to_all_single x2, same splits: {1e3 * t_raw:.2f} ms  {moved_avg / t_raw / 1e9:.3f} GB/s")
            print(f"ratio dispatcher / raw: {t_e2e / t_raw:.2f}x")
            if t_local is not None:
                print(f"local permute+unpermute alone: {1e3 * t_local:.2f} ms; (raw + local) / raw: "
                      f"{(t_raw + t_local) / t_raw:.2f}x (the floor for a dispatcher that does not overlap them)")
        else:
            print("raw all_to_all_single: ep=1, nothing to exchange")
    if args.fp8:
        from moefold.dispatch.fp8_bench import report_fp8

        others = lambda h: sum(n for s, n in enumerate(_splits(h, dims, T * K)[0]) if s != ep_rank)
        report_fp8(args, dims, x, lambda: _route(x, w_gate, skew, K), t_e2e, others, **options)


def _splits(handle, dims, copies: int) -> tuple[list[int], list[int]]:
    """Rows this rank sends to / receives from each ep rank in the token exchange.

    Dispatchers without per-rank splits (allgather, flex) are compared with an even all-to-all
    of this rank's ``copies`` token copies: what an ideal exchange would move.
    """
    if hasattr(handle, "send_splits"):
        return list(handle.send_splits), list(handle.recv_splits)
    n = -(-copies // max(1, dims.ep))
    return [n] * dims.ep, [n] * dims.ep


def _spawned(rank: int, world: int, store_path: str, args: argparse.Namespace, reports: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        _rank_main(args)
        dist.barrier()
        reports.put((rank, None))
    except BaseException as exc:
        reports.put((rank, f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    _validate(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        from moefold.parallel import ParallelConfig
        from moefold.parallel.init import init_distributed

        init_distributed(ParallelConfig(ep=args.ep, etp=args.etp))
        _rank_main(args)
        return 0
    world = args.nprocs or args.ep * args.etp
    if world == 1:
        _rank_main(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="moefold-bench-") as tmp:
        ctx = mp.get_context("spawn")
        reports: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(r, world, os.path.join(tmp, "store"), args, reports))
                 for r in range(world)]
        for p in procs:
            p.start()
        # success is every rank reporting in (a crash while tearing gloo down afterwards is not a failure)
        done: dict[int, str | None] = {}
        while len(done) < world:
            try:
                rank, error = reports.get(timeout=1.0)
                done[rank] = error
                if error is not None:
                    break
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if (dead or all(p.exitcode is not None for p in procs)) and reports.empty():
                    break
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        errors = [e for e in done.values() if e is not None]
        if errors or len(done) < world:
            print(errors[0] if errors else f"ranks {sorted(set(range(world)) - set(done))} died", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Benchmark a token dispatcher against a raw all-to-all.")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
