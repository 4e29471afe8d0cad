"""``moefold bench-dispatch``: time dispatchers' dispatch + combine against the raw collectives they are built on.

Runs on N CPU ranks that it spawns itself (gloo), or under ``torchrun`` (NCCL on GPUs). Every
rank routes ``--num-tokens`` random tokens (uniform or Zipf-skewed expert popularity); for each
dispatcher and skew given (comma-separated lists: one command, one world, every row) it measures:

* phases: route, permute, communicate, sort, unpermute (with a per-phase timer that
  synchronises the device, on separate iterations so the end-to-end figure is not disturbed);
* end to end: dispatch + combine (the probs travel with the rows; the combine sums), median over ``--iters`` after
  ``--warmup``;
* raw: the collectives the dispatcher is built on, moving exactly its token bytes, measured in
  the same run the same way (after a barrier, receive buffers allocated inside the timed region
  as the dispatcher's are): ``all_to_all_single`` there and back with the dispatch's split sizes
  (alltoall; flex against an even one of the same copies), an all-gather of the (padded) tokens
  and a reduce-scatter of the outputs over the etp x ep group (allgather);
* local: the dispatcher's permute + unpermute of the same rows alone (what it does
  besides communicating), so that the ratio can be split into local work and exchange overhead;
* bytes: what the dispatcher's token collectives send per rank (dispatch + combine) against the
  ideal: the copies whose expert lives on another rank, there and back;
* ``--moe-latent-size L`` (latent experts, ``moe.latent``): every row again with the tokens projected to L before
  the dispatch (routed at H, so both rows route the same copies), its bytes and time beside the full width's, and
  the two projections' GEMMs ([T, H] x [H, L] and back) timed on their own.

Times are the slowest rank's median. Nothing is asserted: this prints, ending with one summary
table; the first line names the machine (``moefold.training.observe.machine``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
from moefold.tools.bench_dispatch_timing import PhaseTimes, median_max, raw_exchange, sum_ranks, time_round_trip

PHASES = ("route", "permute", "communicate", "sort", "unpermute")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = tuple(k.value for k in DispatcherKind)
SKEWS = ("uniform", "zipf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dispatcher", default="alltoall",
                        help=f"one or more of {', '.join(KINDS)}, comma-separated (e.g. alltoall,allgather)")
    parser.add_argument("--num-tokens", type=int, default=4096, help="tokens per rank (T)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (H)")
    parser.add_argument("--num-experts", type=int, default=16, help="experts (E)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (K)")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=1, help="expert-tensor-parallel size")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="CPU ranks to spawn (default ep*etp); ignored under torchrun")
    parser.add_argument("--skew", default="uniform",
                        help="expert popularity, comma-separated: uniform, zipf (logit bias -4 log(i+1) for expert i)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="token dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokens and router logits")
    parser.add_argument("--max-chunked-experts", type=int, default=None,
                        help="alltoall only: chunk the exchange per local expert up to this many local experts "
                             "(0: one exchange + sort); default: the dispatcher's")
    parser.add_argument("--moe-latent-size", type=int, default=None,
                        help="also time each row at this latent width (tokens projected down before the dispatch)")
    parser.add_argument("--fp8", action="store_true", help="also time FP8 dispatch (--moe-fp8-dispatch): bytes "
                                                           "and time against --dtype (tools.bench_dispatch_fp8)")


def _list(value: str, valid: tuple[str, ...], flag: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    bad = [v for v in items if v not in valid]
    if bad or not items:
        raise ValueError(f"{flag}={value!r}: valid values are {', '.join(valid)} (comma-separated)")
    return items


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_tokens", "hidden", "num_experts", "topk", "ep", "etp", "iters"):
        if getattr(args, name) < (0 if name == "num_tokens" else 1):
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.moe_latent_size is not None and args.moe_latent_size < 1:
        raise ValueError(f"--moe-latent-size={args.moe_latent_size} must be positive")
    if args.topk > args.num_experts:
        raise ValueError(f"--topk={args.topk} exceeds --num-experts={args.num_experts}")
    if args.num_experts % args.ep:
        raise ValueError(f"--num-experts={args.num_experts} is not divisible by --ep={args.ep}")
    _list(args.dispatcher, KINDS, "--dispatcher")
    _list(args.skew, SKEWS, "--skew")


def _route(x, w_gate, bias, topk):
    from moefold.dispatch.permutation import count_keys
    from moefold.dispatch.routing import Routing

    logits = (x.float() @ w_gate) + bias
    probs, ids = torch.softmax(logits, -1).topk(topk, -1)
    return Routing(probs, ids, count_keys(ids.reshape(-1), w_gate.shape[1]))


def _bench_inputs(skew_name: str, args: argparse.Namespace, dims, device: torch.device):
    """(x [T, H], router weight [H, E], expert popularity skew [E], generator) of this rank: drawn on the CPU (the
    same values on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(args.seed + dims.rank)
    H, E, cpu = args.hidden, args.num_experts, torch.device("cpu")
    x = torch.randn(args.num_tokens, H, generator=gen, device=cpu).to(device, DTYPES[args.dtype])
    w_gate = (torch.randn(H, E, generator=torch.Generator().manual_seed(args.seed), device=cpu) / H ** 0.5).to(device)
    skew = (torch.zeros(E, device=cpu) if skew_name == "uniform"
            else -torch.log(torch.arange(1, E + 1, dtype=torch.float, device=cpu)))
    return x, w_gate, (skew * 4).to(device), gen  # Zipf-like popularity, sharpened to survive the random logits


def _dispatch_config(kind: str, args: argparse.Namespace, num_tokens: int, fp8: bool = False) -> DispatchConfig:
    """The ``--dispatcher`` ``kind``'s config: ``--max-chunked-experts`` for alltoall; flex's DeepEP V2 buffer sized
    by the layout's worst case (``num_tokens`` per rank)."""
    chunks = {} if args.max_chunked_experts is None else {"max_chunked_experts": args.max_chunked_experts}
    return DispatchConfig(DispatcherKind(kind), FlexOptions(max_tokens_per_rank=num_tokens), fp8=fp8, **chunks)


def _latent_tokens(x: torch.Tensor, width: int, args: argparse.Namespace, device: torch.device,
                   ) -> tuple[torch.Tensor, float]:
    """(x projected to ``width`` [T, width], median seconds of the down and up projections' GEMMs)."""
    H = x.shape[1]
    g = torch.Generator().manual_seed(args.seed + 1)
    down = (torch.randn(H, width, generator=g) / H ** 0.5).to(device, x.dtype)
    up = (torch.randn(width, H, generator=g) / width ** 0.5).to(device, x.dtype)
    times = []
    for i in range(args.warmup + args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        lat = x @ down
        lat @ up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return (x @ down).contiguous(), median_max(times, device)


def _bench_one(kind: str, skew_name: str, args: argparse.Namespace, dims, device: torch.device,
               width: int | None = None) -> dict:
    """One row: ``kind`` on ``skew_name``'s routing; ``width``: the tokens' width at the dispatch (None: H; a
    latent width: routed at H, projected down before the dispatch)."""
    from moefold.dispatch import build_dispatcher
    from moefold.dispatch.permutation import permute, unpermute

    rank0 = dims.rank == 0
    dtype = DTYPES[args.dtype]
    T, E, K = args.num_tokens, args.num_experts, args.topk
    x_route, w_gate, skew, gen = _bench_inputs(skew_name, args, dims, device)
    H = width or args.hidden
    x, proj = (x_route, None) if args.hidden == H else _latent_tokens(x_route, H, args, device)

    timer = PhaseTimes(device)
    config = _dispatch_config(kind, args, T)
    timed = build_dispatcher(config, E, dims, hidden_size=H, timer=timer)
    plain = build_dispatcher(config, E, dims, hidden_size=H)
    barrier = (lambda: dist.barrier()) if dist.is_initialized() else (lambda: None)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    tag = f"{kind} {skew_name}" + ("" if args.hidden == H else f" latent {H}")

    def progress(what: str, i: int, n: int) -> None:
        if rank0:
            print(f"\r  {tag} {what}: {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    # phases (timed iterations, synchronised per phase); the experts pass rows through unchanged
    for i in range(args.warmup + args.iters):
        timer.enabled = i >= args.warmup
        with timer("route"):
            routing = _route(x_route, w_gate, skew, K)
        barrier()
        out = timed.dispatch(x, routing)
        timed.combine(out.tokens_NH, out.handle)
        progress("phases", i + 1, args.warmup + args.iters)
    phase_ms = {p: 1e3 * timer.seconds[p] / args.iters for p in PHASES}

    # end to end, the raw collectives with the same bytes, and the dispatcher's local work alone.
    # Like with like: each timed region starts right after a barrier, and both the dispatcher and
    # the raw exchange allocate their receive buffers inside it (the raw one sends from a buffer
    # that is ready, as the dispatcher's permute output is).
    e2e, raw, local = [], [], []
    raw_name, raw_bytes, handle, routing = None, 0, None, None
    for i in range(args.warmup + args.iters):
        routing = _route(x_route, w_gate, skew, K)
        seconds, handle = time_round_trip(plain, x, routing, sync, barrier)
        exchange = raw_exchange(kind, handle, dims, T, K, H, dtype, device, gen)
        if exchange is not None:
            raw_name, run_raw, raw_bytes = exchange
            sync()
            barrier()
            t2 = time.perf_counter()
            run_raw()
            sync()
            raw.append(time.perf_counter() - t2)
        row_map = getattr(handle, "row_map", None)
        if kind != "flex" and row_map is not None and row_map.num_tokens % max(T, 1) == 0 and T:
            # permute + unpermute of the same rows, no communication (allgather: over the gathered tokens,
            # stood in for by copies of this rank's; flex's map is over received tokens); the combine's sum is
            # unweighted (the experts apply the probs)
            xs = x.repeat(row_map.num_tokens // T, 1)
            barrier()
            t4 = time.perf_counter()
            unpermute(permute(xs, row_map), row_map)
            sync()
            local.append(time.perf_counter() - t4)
        if i >= args.warmup:
            e2e.append(seconds)
        progress("end to end + raw", i + 1, args.warmup + args.iters)
        if i < args.warmup:
            raw.clear()
            local.clear()

    # ideal bytes: the copies whose expert is on another ep rank, there and back
    e_local = E // dims.ep
    ids = routing.expert_ids_TK.reshape(-1)
    remote = int(((ids // e_local) != dims.ep_rank).sum()) if dims.ep > 1 else 0
    es = torch.finfo(dtype).bits // 8
    world = max(1, dims.world_size)
    ideal = sum_ranks(2 * remote * H * es, device) / world
    moved = sum_ranks(raw_bytes, device) / world
    t_e2e = median_max(e2e, device)
    return {"kind": kind, "skew": skew_name, "phases": {p: median_max([v], device) for p, v in phase_ms.items()},
            "e2e": t_e2e, "raw": median_max(raw, device) if raw else None, "raw_name": raw_name,
            "local": median_max(local, device) if local else None, "ideal_bytes": ideal, "moved_bytes": moved,
            "remote_rows": remote, "width": H, "proj": proj}


def _fp8_one(r: dict, args: argparse.Namespace, dims, device: torch.device) -> None:
    """``--fp8``: the same dispatcher with FP8 dispatch, on the same inputs, against ``r``'s time."""
    rank0 = dims.rank == 0
    if r["kind"] == "flex":
        if rank0:
            print("  fp8: not timed for flex (DeepEP V2 dispatches FP8 with --moe-fp8-dispatch, one row per "
                  "destination rank: not this table's per-copy bytes; the legacy backend has no FP8 dispatch)")
        return
    from moefold.tools.bench_dispatch_fp8 import report_fp8

    x, w_gate, skew, _ = _bench_inputs(r["skew"], args, dims, device)
    report_fp8(_dispatch_config(r["kind"], args, args.num_tokens, fp8=True), args, dims, x,
               lambda: _route(x, w_gate, skew, args.topk), r["e2e"], r["remote_rows"])


def _rank_main(args: argparse.Namespace) -> None:
    from moefold.parallel import ParallelConfig, ParallelDims
    from moefold.parallel.init import default_device
    from moefold.training.observe.machine import describe_machine

    device = default_device()
    dims = ParallelDims.build(ParallelConfig(ep=args.ep, etp=args.etp), device_type=device.type)
    rank0 = dims.rank == 0
    if rank0:
        print(describe_machine())
        print(f"# bench-dispatch: ranks={dims.world_size} ep={args.ep} etp={args.etp} T={args.num_tokens} "
              f"H={args.hidden} E={args.num_experts} k={args.topk} dtype={args.dtype} device={device.type} "
              f"iters={args.iters} (per rank: {torch.get_num_threads()} torch threads)", flush=True)
    rows = []
    for kind in _list(args.dispatcher, KINDS, "--dispatcher"):
        for skew in _list(args.skew, SKEWS, "--skew"):
            r = _bench_one(kind, skew, args, dims, device)
            rows.append(r)
            if rank0:
                _print_one(r)
            if args.fp8:
                _fp8_one(r, args, dims, device)
            if args.moe_latent_size is not None:
                lat = _bench_one(kind, skew, args, dims, device, width=args.moe_latent_size)
                rows.append(lat)
                if rank0:
                    _print_one(lat)
                    share = lat["moved_bytes"] / max(r["moved_bytes"], 1)
                    print(f"  latent {lat['width']} / hidden {r['width']}: bytes {share:.2f}x, "
                          f"dispatch+combine {lat['e2e'] / r['e2e']:.2f}x; the projections' GEMMs add "
                          f"{1e3 * lat['proj']:.2f} ms")
    if rank0 and len(rows) > 1:
        print("\nsummary (ms, slowest rank's median; ratio = dispatcher / raw collectives of the same bytes)")
        print(f"{'dispatcher':10} {'skew':8} {'width':>5} {'disp+comb':>9} {'raw':>8} {'ratio':>6} {'floor':>6} "
              f"{'MB moved':>9} {'MB ideal':>9}  raw collectives")
        for r in rows:
            raw, local = r["raw"], r["local"]
            ratio = f"{r['e2e'] / raw:.2f}" if raw else "-"
            floor = f"{(raw + local) / raw:.2f}" if raw and local is not None else "-"
            print(f"{r['kind']:10} {r['skew']:8} {r['width']:>5} {1e3 * r['e2e']:>9.2f} "
                  f"{(f'{1e3 * raw:.2f}' if raw else '-'):>8} {ratio:>6} {floor:>6} "
                  f"{r['moved_bytes'] / 1e6:>9.2f} {r['ideal_bytes'] / 1e6:>9.2f}  {r['raw_name'] or '-'}")


def _print_one(r: dict) -> None:
    print(f"dispatcher={r['kind']} skew={r['skew']} width={r['width']}")
    print("  phases (ms per dispatch+combine, slowest rank): " +
          "  ".join(f"{p} {r['phases'][p]:.2f}" for p in PHASES))
    print(f"  dispatch+combine: {1e3 * r['e2e']:.2f} ms")
    if r["raw"] is None:
        print("  raw collectives: one rank in the group, nothing to exchange")
        return
    print(f"  raw {r['raw_name']} (same token bytes): {1e3 * r['raw']:.2f} ms")
    print(f"  ratio dispatcher / raw: {r['e2e'] / r['raw']:.2f}x")
    print(f"  token bytes sent per rank (dispatch+combine): {r['moved_bytes'] / 1e6:.2f} MB; ideal exchange "
          f"(remote copies there and back): {r['ideal_bytes'] / 1e6:.2f} MB "
          f"({r['moved_bytes'] / max(r['ideal_bytes'], 1):.2f}x)")
    if r["local"] is not None:
        print(f"  local permute+unpermute alone: {1e3 * r['local']:.2f} ms; (raw + local) / raw: "
              f"{(r['raw'] + r['local']) / r['raw']:.2f}x (the floor for a dispatcher that does not overlap them)")


def _release_deepep() -> None:
    """The flex rows' DeepEP buffers, destroyed (collectively) before the process group goes."""
    from moefold.dispatch.flex_backend import destroy_deepep_buffers

    destroy_deepep_buffers()


def _spawned(rank: int, world: int, store_path: str, args: argparse.Namespace, reports: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        _rank_main(args)
        _release_deepep()
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
        _release_deepep()
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
    parser = argparse.ArgumentParser(description="Benchmark a token dispatcher against a raw all-to-all.",
                                     allow_abbrev=False)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
