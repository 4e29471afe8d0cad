"""The gated delta rule, forward + backward: the token-by-token recurrence against the chunked form (CPU or CUDA).

    python benchmarks/gated_delta_rule.py                       # S=2048, Qwen3-Next's head sizes scaled down
    python benchmarks/gated_delta_rule.py --seq 4096 --chunk-sizes 32 64 --cpu-time

Times ``recurrent_gated_delta_rule`` and ``chunk_gated_delta_rule`` (``dense.gated_delta_rule``) on the same
inputs (``[B, S, heads, d]``, fp32 inside both), forward and backward of one random projection of the output,
median over ``--iters`` after one warm-up; wall clock, or the process CPU time with ``--cpu-time`` (a shared
machine). Prints the machine line, each variant's time and the ratio to the recurrence measured in the same run,
and the largest output difference (the two forms compute the same function).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moefold.dense.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from moefold.training.observe.machine import describe_machine


def _inputs(args, device: str):
    g = torch.Generator().manual_seed(0)
    B, S, hk, hv, dk, dv = args.batch, args.seq, args.key_heads, args.value_heads, args.key_dim, args.value_dim
    q, k = (torch.randn(B, S, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, S, hv, dv, generator=g)
    decay = -torch.rand(B, S, hv, generator=g) * 0.2
    beta = torch.rand(B, S, hv, generator=g)
    return [t.to(device).requires_grad_() for t in (q, k, v, decay, beta)]


def _time(fn, inputs, iters: int, cpu_time: bool, device: str) -> tuple[float, torch.Tensor]:
    clock = time.process_time if cpu_time else time.perf_counter
    times, out = [], None
    for i in range(iters + 1):
        for t in inputs:
            t.grad = None
        start = clock()
        out, _ = fn(*inputs)
        (out * 0.01).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:   # the first call warms up
            times.append(clock() - start)
    return statistics.median(times), out.detach()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--key-heads", type=int, default=2)
    p.add_argument("--value-heads", type=int, default=4)
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall clock")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    print(f"# B={args.batch} S={args.seq} heads {args.key_heads}/{args.value_heads} dims {args.key_dim}/"
          f"{args.value_dim}, forward + backward, {'CPU time' if args.cpu_time else 'wall clock'}, median of "
          f"{args.iters}")
    inputs = _inputs(args, args.device)
    ref_s, ref = _time(recurrent_gated_delta_rule, inputs, args.iters, args.cpu_time, args.device)
    print(f"recurrent (token by token)   {ref_s * 1e3:9.1f} ms   1.00x")
    for chunk in args.chunk_sizes:
        s, out = _time(lambda *a, c=chunk: chunk_gated_delta_rule(*a, chunk_size=c), inputs, args.iters,
                       args.cpu_time, args.device)
        print(f"chunked, chunk {chunk:<4}          {s * 1e3:9.1f} ms   {ref_s / s:5.1f}x faster   "
              f"max |out diff| {(out - ref).abs().max().item():.2g}")


if __name__ == "__main__":
    main()
