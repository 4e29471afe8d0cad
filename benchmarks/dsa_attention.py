"""DeepSeek sparse attention against dense MLA as the sequence grows: time and memory, forward + backward (CPU).

    python benchmarks/dsa_attention.py                     # S = 1024 .. 16384 (dense to 4096), index_topk 512
    python benchmarks/dsa_attention.py --seqs 2048 4096 --topk 256 --iters 3

One attention layer of a scaled-down DeepSeek-V3.2 (hidden 1024, 16 heads, q/kv latents 256/128, nope 64, rope 32, v 64;
indexer 8 heads x 64), batch 1, fp32, one torch thread, three rows per length:

- ``dense``: ``dense.mla.MLAttention`` (every causal key; SDPA: on the CPU MLA's unequal head dims take the math
  kernel, which keeps the ``[h, S, S]`` probabilities for the backward);
- ``dsa``: ``dense.dsa.DSAttention``, the lightning indexer (scores ``[chunk, S]`` at a time, top-k) and attention
  over each query's ``--topk`` keys, with the indexer's loss;
- ``dsa core``: the sparse attention alone (``sparse_latent_attention`` over the selected keys, the indexer's
  selection made beforehand and not timed): what the top-k bounds.

Time: the median of ``--iters`` forward + backward steps after one warm-up, in the process's CPU time (one thread:
the compute, whatever else loads the shared machine; ``--wall`` for wall-clock). Memory: ``saved``, the bytes autograd
keeps for the backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once; deterministic); ``peak``, the
process's resident-set high-water mark over the timed steps above the RSS after the warm-up (Linux ``VmHWM`` reset
through ``/proc/self/clear_refs``), each row in a fresh process. ``--iters 0``: memory only (the warm-up step).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch

DIMS = dict(hidden_size=1024, num_heads=16, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, q_lora_rank=256)


def _vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _layer(kind: str, topk: int):
    from moefold.dense.attention_config import MLAConfig
    from moefold.dense.dsa import DSAttention
    from moefold.dense.dsa_indexer import DSAConfig
    from moefold.dense.mla import MLAttention

    torch.manual_seed(0)
    config = MLAConfig(**DIMS)
    if kind == "dense":
        return MLAttention(config)
    return DSAttention(config, DSAConfig(index_n_heads=8, index_head_dim=64, index_topk=topk, loss_coeff=1.0))


def _step_fn(kind: str, S: int, topk: int):
    """A function running one forward + backward of ``kind`` at length ``S``."""
    layer = _layer(kind, topk)
    x = torch.randn(S, 1, DIMS["hidden_size"], requires_grad=True)
    pos = torch.arange(S)
    if kind != "dsa core":
        return lambda: layer(x, pos).sum().backward()
    from moefold.dense.dsa import sparse_latent_attention

    with torch.no_grad():
        kv, k_pos, iq, iw, ik = layer._project(x, pos)[2:]
        idx, valid = layer.indexer.select(iq, iw, ik, pos, k_pos)
    q = torch.randn(S, 1, DIMS["num_heads"], DIMS["kv_lora_rank"] + DIMS["qk_rope_head_dim"], requires_grad=True)
    kv = kv.transpose(0, 1).detach().requires_grad_()

    def step() -> None:   # the chunks as DSAttention runs them (checkpointed, query_chunk at a time)
        from moefold.dense.recompute import checkpointed

        outs = [checkpointed(sparse_latent_attention, q[s:s + 512], kv, idx[:, s:s + 512], valid[:, s:s + 512],
                             0.1, DIMS["kv_lora_rank"])[0] for s in range(0, S, 512)]
        torch.cat(outs).sum().backward()
    return step


def measure_step(step: Callable[[], None], iters: int, wall: bool = False) -> tuple[float, int, int]:
    """(the median seconds of ``iters`` calls of ``step`` after one warm-up, the bytes autograd saved for the
    warm-up's backward (each storage once), the resident-set high-water mark above the RSS after the warm-up)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:   # each storage once (the chunks all save the same keys)
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()   # warm-up, and the saved bytes of one step
    base = _vm_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    clock = time.perf_counter if wall else time.process_time
    times = []
    for _ in range(iters):
        start = clock()
        step()
        times.append(clock() - start)
    return (statistics.median(times) if times else float("nan"), sum(saved.values()),
            max(_vm_kb("VmHWM") - base, 0) * 1024)


def _measure(kind: str, S: int, topk: int, iters: int, wall: bool, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    out.put(measure_step(_step_fn(kind, S, topk), iters, wall))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--wall", action="store_true", help="wall-clock time (default: the process's CPU time)")
    parser.add_argument("--dense-max", type=int, default=4096,
                        help="longest sequence of the dense rows (its [h, S, S] scores: ~3 GiB at 4096, 4x a doubling)")
    args = parser.parse_args()
    from moefold.training.observe.machine import describe_machine

    print(describe_machine())
    print(f"# DSA vs dense MLA, forward + backward, fp32, batch 1, one thread, index_topk={args.topk}; {DIMS}")
    print(f"| S | kind | {'wall' if args.wall else 'CPU'} time ms | saved for backward MiB | peak above inputs MiB |")
    print("|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for S in args.seqs:
        kinds = ("dense", "dsa", "dsa core")
        for kind in kinds if args.dense_max >= S else kinds[1:]:
            q = ctx.Queue()
            p = ctx.Process(target=_measure, args=(kind, S, args.topk, args.iters, args.wall, q))
            p.start()
            seconds, saved, peak = q.get()
            p.join()
            print(f"| {S} | {kind} | {seconds * 1e3:.0f} | {saved / 2**20:.1f} | {peak / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
