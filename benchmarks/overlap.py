"""Step time with and without the batch-level overlap (--overlap-moe-expert-parallel-comm --delay-wgrad-compute).

    python benchmarks/overlap.py                          # CPU, gloo: ep2 and ep4, 4 micro-batches, 5 rounds
    python benchmarks/overlap.py --ep 2 --rounds 9 --plot overlap.png
    python benchmarks/overlap.py --device cuda --dtype bf16 --ep 4 8   # GPUs: NCCL, one rank per GPU
    python benchmarks/overlap.py --engine-overhead --rounds 7          # one process: what the engine costs the host

One world per expert-parallel size (ranks = ep, pp = 1, dp = ep, every layer MoE): two trainers of the same model
on the same micro-batches, plain gradient accumulation and the overlap (F0, FB(1, 0), ..., B(m-1): each
micro-batch's dispatch/combine in flight while another computes), alternate step by step, a barrier before and
after each step; medians over the rounds and their ratio are printed, with the share of a plain step the expert
exchange takes (the exchange timed alone, the same bytes). The PNG shows one overlapped step of rank 0 as recorded
by ``pipeline.overlap.Trace``: each micro-batch's computes and, below them, its exchanges in flight, so the
exchange under the other micro-batch's computation is visible. On CPU the collectives run on gloo's threads (the
machine's cores are shared with the computation, and with other jobs: the load average is printed); on CUDA on
NCCL's stream.

``--engine-overhead``: one process, no exchange to hide (the overlap engine forced on at ep1, which the config
refuses, with the identity exchange): process CPU time of a plain step, of the same step run as pieces, and with
the weight gradients delayed, alternating, medians; the host work the overlap adds (one backward per piece).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moefold.dense.split_backward import WeightGradStore
from moefold.execution.split_backward import install_weight_grad_store
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.pipeline.overlap import OverlapConfig, Trace
from moefold.pipeline.schedules import build_schedule
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.machine import describe_machine
from moefold.training.trainer import Trainer


def run_config(args: argparse.Namespace, ep: int, overlap: bool) -> RunConfig:
    model = get_recipe("qwen3_moe_tiny").with_(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=max(1, args.heads // 2), head_dim=args.head_dim,
        num_experts=args.experts, moe_topk=2, moe_ffn_hidden_size=args.ffn, vocab_size=256, first_k_dense_replace=0)
    train = TrainConfig(micro_batch_size=args.micro_batch, global_batch_size=args.micro_batch * args.micro_batches * ep,
                        seq_length=args.seq, train_iters=args.rounds + 2, lr=1e-4, min_lr=1e-5, lr_warmup_iters=0,
                        log_interval=1, bf16=args.dtype == "bf16", overlap_moe_expert_parallel_comm=overlap,
                        delay_wgrad_compute=overlap)
    return RunConfig(model=model, parallel=ParallelConfig(ep=ep), options=ModelOptions(dispatcher="alltoall"),
                     train=train)


def exchange_time(args: argparse.Namespace, ep: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds of one step's expert exchanges alone: per layer and micro-batch, the tokens' all-to-all there and
    back, forward and backward (4 all-to-alls of the routed rows; uniform routing)."""
    rows = args.micro_batch * args.seq * 2   # top-2 copies
    x = torch.randn(rows, args.hidden, device=device, dtype=dtype)
    out = torch.empty_like(x)
    for _ in range(2):
        dist.all_to_all_single(out, x)
    dist.barrier()
    t0 = time.perf_counter()
    n = 4 * args.layers * args.micro_batches
    for _ in range(n):
        dist.all_to_all_single(out, x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _rank(rank: int, ep: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ep, timeout=timedelta(seconds=600))
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dims = ParallelDims.build(ParallelConfig(ep=ep))
    log = (lambda m: None)
    plain = Trainer(run_config(args, ep, False), dims, device=device, log=log)
    overlapped = Trainer(run_config(args, ep, True), dims, device=device, log=log)
    gen = torch.Generator().manual_seed(100 + rank)
    steps = [[torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=gen)
              for _ in range(args.micro_batches)] for _ in range(args.rounds + 1)]

    def timed(trainer: Trainer, batches: list[torch.Tensor]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(batches)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    timed(plain, steps[0]), timed(overlapped, steps[0])   # warm-up (and compile-free first step costs)
    times = {"plain": [], "overlap": []}
    for batches in steps[1:]:   # alternating: both see the same load
        times["plain"].append(timed(plain, batches))
        times["overlap"].append(timed(overlapped, batches))
    exchange = exchange_time(args, ep, device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    trace = Trace()
    overlapped.overlap = dataclasses.replace(overlapped.overlap, trace=trace)
    timed(overlapped, steps[1])
    if rank == 0:
        results.put((ep, times, exchange, trace.events))
    dist.destroy_process_group()


def engine_overhead(args: argparse.Namespace) -> None:
    """Process CPU time per step at world size 1: plain, pieces, pieces + delayed weight gradients."""
    torch.set_num_threads(args.threads)

    def trainer(pieces: bool, delay: bool) -> Trainer:
        tr = Trainer(run_config(args, 1, False), ParallelDims.single(), log=lambda m: None)
        if pieces:   # what Trainer.__init__ does for --overlap-moe-expert-parallel-comm at pp = 1, here at ep1
            tr.layout = tr.config.pipeline_layout(1)
            tr.pipeline = build_schedule("1f1b", 1, args.micro_batches, overlap=True)
            if delay:
                tr.weight_store = WeightGradStore()
                install_weight_grad_store(tr.model, tr.weight_store)
            tr.overlap = OverlapConfig(delay, tr.weight_store)
        return tr

    trainers = {"plain": trainer(False, False), "pieces": trainer(True, False), "pieces + delay": trainer(True, True)}
    gen = torch.Generator().manual_seed(0)
    times = {name: [] for name in trainers}
    for step in range(args.rounds + 1):
        batches = [torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=gen)
                   for _ in range(args.micro_batches)]
        for name, tr in trainers.items():
            t0 = time.process_time()
            tr.train_step(batches)
            if step:   # the first is a warm-up
                times[name].append(time.process_time() - t0)
    plain = statistics.median(times["plain"])
    for name, ts in times.items():
        print(f"{name:15s} {statistics.median(ts) * 1e3:8.1f} ms CPU/step ({statistics.median(ts) / plain - 1:+.0%}; "
              f"rounds {[round(t * 1e3) for t in ts]})")


def plot(events: list[tuple[str, str, str, float]], ep: int, path: str) -> None:
    """One overlapped step of rank 0: per micro-batch a row of its computes (forward blue, backward green) and a
    row of its exchanges in flight (orange), against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opened: dict[tuple[str, str], float] = {}
    bars: list[tuple[int, str, float, float, str]] = []
    microbatches = sorted({int(tag.split(".")[0][2:]) for _, tag, _, _ in events})
    for what, tag, phase, t in events:
        mb = int(tag.split(".")[0][2:])
        direction = "backward" if "backward" in phase else "forward"
        key = (tag, direction)
        if phase.endswith("start"):
            opened[key] = t
        elif key in opened:
            start = opened.pop(key)
            kind = "exchange" if what == "exchange" else direction
            bars.append((mb, kind, start, t, tag.split(".", 2)[-1]))
    t0 = min(b[2] for b in bars)
    fig, ax = plt.subplots(figsize=(14, 1.1 * len(microbatches) + 1.5))
    colors = {"forward": "tab:blue", "backward": "tab:green", "exchange": "tab:orange"}
    for mb, kind, start, end, _ in bars:
        y = 2 * microbatches.index(mb) + (1 if kind == "exchange" else 0)
        ax.broken_barh([((start - t0) * 1e3, max((end - start) * 1e3, 0.05))], (y - 0.4, 0.8),
                       facecolors=colors[kind], edgecolors="black", linewidth=0.3)
    ax.set_yticks([2 * i + j for i in range(len(microbatches)) for j in (0, 1)],
                  [f"mb{mb} {row}" for mb in microbatches for row in ("compute", "exchange")])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first piece (forward blue, backward green, exchange in flight orange)")
    ax.set_title(f"one overlapped step, rank 0 of ep{ep}: each micro-batch's dispatch/combine in flight while the "
                 f"other micro-batch computes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="expert-parallel sizes (ranks) to run")
    p.add_argument("--rounds", type=int, default=5, help="timed steps of each (alternating)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn", type=int, default=64, help="per expert (default 64: with hidden 1024 and narrow attention "
                                                       "the exchange is a large share of the step, as at scale)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--engine-overhead", action="store_true", help="one process: plain vs pieces vs pieces + delayed "
                   "weight gradients, process CPU time (the host work the engine adds)")
    p.add_argument("--plot", default="overlap_timeline.png", help="timeline PNG of one overlapped step (of the "
                                                                  "largest ep)")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < max(args.ep):
        sys.exit(f"--ep {max(args.ep)} needs as many GPUs, found {torch.cuda.device_count()}")
    torch.set_num_threads(args.threads)   # each rank sets its own; this one is for the machine line
    print(describe_machine())
    print(f"# {args.layers} MoE layers, hidden {args.hidden}, {args.heads} heads of {args.head_dim}, {args.experts} "
          f"experts top-2 of FFN {args.ffn}, "
          f"{args.micro_batches} micro-batches of {args.micro_batch} x {args.seq} tokens per rank, {args.dtype}, "
          f"{args.device}; medians of {args.rounds} steps, plain and overlap alternating; load average "
          f"{os.getloadavg()[0]:.1f}")
    if args.engine_overhead:
        engine_overhead(args)
        print(f"load average at end {os.getloadavg()[0]:.1f}")
        return
    ctx = mp.get_context("spawn")
    last_events = None
    for ep in args.ep:
        results = ctx.SimpleQueue()
        port = 29500 + (os.getpid() + ep) % 2000
        mp.start_processes(_rank, args=(ep, args, port, results), nprocs=ep, start_method="spawn", join=True)
        _, times, exchange, events = results.get()
        plain, overlap = statistics.median(times["plain"]), statistics.median(times["overlap"])
        print(f"ep{ep}: plain {plain * 1e3:8.1f} ms/step, overlap {overlap * 1e3:8.1f} ms/step, ratio overlap / plain "
              f"{overlap / plain:.3f} (rounds plain {[round(t * 1e3) for t in times['plain']]}, overlap "
              f"{[round(t * 1e3) for t in times['overlap']]}); the exchange alone {exchange * 1e3:.1f} ms = "
              f"{exchange / plain:.0%} of a plain step")
        last_events = (ep, events)
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    if args.plot and last_events is not None:
        plot(last_events[1], last_events[0], args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
