"""Attention inside packed documents, forward + backward: moefold's block plan against a dense-mask baseline (CPU).

    python benchmarks/packed_documents.py                               # S = 2048, 4096, 8192, documents ~512
    python benchmarks/packed_documents.py --seqs 4096 16384 --window 256 --cpu-time
    python benchmarks/packed_documents.py --seqs 4096 --window 256 --profile     # where the documents' time goes

Both compute causal attention inside the documents of one packed sample (lengths drawn around ``--doc-length``,
seeded): ``documents`` is ``dense.document_attention`` (what ``--reset-attention-mask`` runs: flash-kernel calls
planned from the document starts, no mask of the sequence); ``dense mask`` is SDPA with a boolean ``[S, S]``
same-document causal mask (what a framework without a varlen path builds: Megatron-LM's
``_get_ltor_masks_and_position_ids`` with ``create_attention_mask``). Each (method, length) runs in a fresh
process: median time over ``--iters`` after one warm-up (wall clock, or the process CPU time with ``--cpu-time``),
and the peak resident memory the attention added (``/proc/self/status`` VmHWM after resetting it through
``/proc/self/clear_refs``, minus VmRSS before; inputs already allocated). Prints the machine line and the largest
output difference between the two (the same function).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _documents(S: int, mean: int, seed: int = 0) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    starts, pos = [0], 0
    while True:
        pos += int(torch.randint(mean // 4, 2 * mean - mean // 4, (1,), generator=g))
        if pos >= S:
            return tuple(starts)
        starts.append(pos)


def _inputs(args, S: int):
    g = torch.Generator().manual_seed(1)
    shapes = [(1, args.heads, S, args.head_dim), (1, args.kv_heads, S, args.head_dim),
              (1, args.kv_heads, S, args.head_dim)]
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _dense_mask(starts: tuple[int, ...], S: int, window: int | None) -> torch.Tensor:
    from moefold.dense.context_parallel import position_mask

    doc = torch.zeros(S, dtype=torch.long)
    for s in starts[1:]:
        doc[s:] += 1
    pos = torch.arange(S)
    return position_mask(pos, pos, window) & (doc[:, None] == doc[None, :])


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args) -> None:
    from moefold.dense.context_parallel import sdpa
    from moefold.dense.document_attention import document_attention
    from moefold.dense.documents import Documents

    if args.threads:
        torch.set_num_threads(args.threads)
    S = args.child_seq
    starts = _documents(S, args.doc_length)
    q, k, v = _inputs(args, S)
    scale = args.head_dim ** -0.5

    def run() -> torch.Tensor:
        if args.child == "documents":
            return document_attention(q, k, v, Documents((starts,), S), scale=scale, sliding_window=args.window)
        return sdpa(q, k, v, scale=scale, attn_mask=_dense_mask(starts, S, args.window))

    clock = time.process_time if args.cpu_time else time.perf_counter
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset the peak resident size to the current one
    before = _status("VmRSS")
    times, out = [], None
    for i in range(args.iters + 1):
        for t in (q, k, v):
            t.grad = None
        start = clock()
        out = run()
        (out * 0.01).sum().backward()
        if i:
            times.append(clock() - start)
    peak = _status("VmHWM") - before
    torch.save(out.detach(), args.child_out)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "peak_mib": peak / 2**20, "documents": len(starts)}))


def profile(args) -> None:
    from torch.profiler import profile as torch_profile

    from moefold.dense.document_attention import document_attention, document_calls
    from moefold.dense.documents import Documents

    S = args.seqs[0]
    starts = _documents(S, args.doc_length)
    q, k, v = _inputs(args, S)
    docs = Documents((starts,), S)
    calls = document_calls(docs.starts, S, 0, 1, None, args.window)
    print(f"# S={S}, {len(starts)} documents, window {args.window}: {len(calls)} kernel calls")
    for _ in range(2):   # warm-up, then the profiled run
        with torch_profile() as prof:
            start = time.perf_counter()
            out = document_attention(q, k, v, docs, scale=args.head_dim ** -0.5, sliding_window=args.window)
            middle = time.perf_counter()
            out.sum().backward()
            end = time.perf_counter()
    print(f"# forward {1e3 * (middle - start):.1f} ms, backward {1e3 * (end - middle):.1f} ms (wall, profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--doc-length", type=int, default=512, help="mean document length (drawn in [L/4, 7L/4))")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=None, help="sliding window (default: none)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall clock")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--profile", action="store_true",
                   help="instead: torch.profiler's table of one documents forward + backward at the first --seqs")
    p.add_argument("--child", choices=("documents", "dense mask"), help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.profile:
        profile(args)
        return
    import tempfile

    from moefold.training.observe.machine import describe_machine

    print(describe_machine())
    print(f"# B=1, heads {args.heads}/{args.kv_heads} kv, head dim {args.head_dim}, window {args.window}, documents "
          f"~{args.doc_length} tokens; fp32; forward + backward, median of {args.iters}; "
          f"{'process CPU time' if args.cpu_time else 'wall clock'}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'S':>6} {'docs':>5} {'method':<11} {'ms':>9} {'peak MiB':>9} {'time vs dense':>14} {'max |diff|':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for S in args.seqs:
            rows, outs = {}, {}
            for method in ("dense mask", "documents"):
                path = f"{tmp}/{method.replace(' ', '_')}_{S}.pt"
                flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                         if k in ("doc_length", "heads", "kv_heads", "head_dim", "iters") or
                         (k in ("window", "threads") and v is not None)]
                cmd = [sys.executable, __file__, *flags, "--child", method, "--child-seq", str(S), "--child-out", path]
                if args.cpu_time:
                    cmd.append("--cpu-time")
                result = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows[method] = json.loads(result.stdout.strip().splitlines()[-1])
                outs[method] = torch.load(path)
            diff = (outs["documents"] - outs["dense mask"]).abs().max().item()
            for method, r in rows.items():
                ratio = r["ms"] / rows["dense mask"]["ms"]
                print(f"{S:>6} {r['documents']:>5} {method:<11} {r['ms']:>9.1f} {r['peak_mib']:>9.1f} "
                      f"{ratio:>13.2f}x {diff if method == 'documents' else float('nan'):>11.2g}")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
