"""Sparse attention against dense attention as the sequence grows: DeepSeek sparse attention (DeepSeek-V3.2, GLM-5)
and DeepSeek-V4's compressed sparse / heavily compressed layers; time and memory, forward + backward (CPU).

    python benchmarks/sparse_attention.py                       # S = 1024 .. 16384, dense rows to --dense-max
    python benchmarks/sparse_attention.py --seqs 2048 4096 --iters 3 --plot sparse.png

One attention layer with tiny heads, batch 1, fp32, one torch thread, each row in a fresh process:

- ``mla dense``: ``dense.mla.MLAttention`` (every causal key; SDPA's math kernel on the CPU, MLA's unequal head dims:
  it keeps the ``[h, S, S]`` probabilities); ``dsa``: ``dense.dsa.DSAttention`` with the same MLA, its lightning
  indexer (scores over every causal key, top-k) and attention over each query's ``index_topk`` keys, with the
  indexer's loss. MLA hidden 256, 8 heads, q/kv latents 128/64, nope 32, rope 16, v 32; indexer 4 heads x 32.
- ``v4 dense``: ``dense.compressed_attention.CompressedAttention`` as a sliding layer whose window is the whole
  sequence (every causal key: dense attention with V4's queries, shared KV head and sinks); ``v4 sliding``: the
  128-token window alone; ``v4 csa``: compressed sparse (rate 4, its indexer 4 heads x 32 choosing ``index_topk``
  entries, plus the window); ``v4 hca``: heavily compressed (rate 128: every closed entry, plus the window).
  Hidden 256, 8 heads x 64, q rank 128, 2 output groups of 64, rope 16.

The published design bounds what each query reads: ``index_topk`` keys (DSA) or ``window + index_topk`` entries
(CSA), so their time and memory grow linearly with S; HCA reads S / 128 entries per query (quadratic with a
1/128 factor); the indexers score every key (DSA) or entry (CSA): quadratic, cheap per pair.

Time: the median of ``--iters`` forward + backward steps after one warm-up, in the process's CPU time (one thread:
the compute, whatever else loads the shared machine). Memory: ``saved``, the bytes autograd keeps for the backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once; deterministic); ``peak``, the process's
resident-set high-water mark over the timed steps above the RSS after the warm-up (Linux ``VmHWM`` reset through
``/proc/self/clear_refs``). ``--plot FILE``: both against S, log-log.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsa_attention import measure_step  # the DSA-only benchmark's time and memory measurement

MLA = dict(hidden_size=256, num_heads=8, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
           q_lora_rank=128)
V4 = dict(hidden=256, heads=8, head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, rope_dim=16,
          index_heads=4, index_head_dim=32)
KINDS = ("mla dense", "dsa", "v4 dense", "v4 sliding", "v4 csa", "v4 hca")
DENSE = ("mla dense", "v4 dense")


def _layer(kind: str, S: int, topk: int) -> tuple[torch.nn.Module, int]:
    """(the layer, its hidden size)."""
    torch.manual_seed(0)
    if kind in ("mla dense", "dsa"):
        from moefold.dense.attention_config import MLAConfig
        from moefold.dense.dsa import DSAttention
        from moefold.dense.dsa_indexer import DSAConfig
        from moefold.dense.mla import MLAttention

        config = MLAConfig(**MLA)
        if kind == "mla dense":
            return MLAttention(config), MLA["hidden_size"]
        return DSAttention(config, DSAConfig(index_n_heads=4, index_head_dim=32, index_topk=topk,
                                             loss_coeff=1.0)), MLA["hidden_size"]
    from moefold.dense.compressed_attention import CompressedAttention, V4AttentionConfig, V4AttentionKind

    kinds = {"v4 dense": (V4AttentionKind.SLIDING, 1), "v4 sliding": (V4AttentionKind.SLIDING, 1),
             "v4 csa": (V4AttentionKind.COMPRESSED_SPARSE, 4), "v4 hca": (V4AttentionKind.HEAVILY_COMPRESSED, 128)}
    attention_kind, rate = kinds[kind]
    window = S if kind == "v4 dense" else 128
    return CompressedAttention(V4AttentionConfig(**V4, window=window, kind=attention_kind, rate=rate,
                                                 index_topk=topk)), V4["hidden"]


def _measure(kind: str, S: int, topk: int, iters: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    layer, hidden = _layer(kind, S, topk)
    x = torch.randn(S, 1, hidden, requires_grad=True)
    pos = torch.arange(S)

    def step() -> None:
        layer(x, pos).sum().backward()

    out.put(measure_step(step, iters))


def _plot(rows: list[tuple[int, str, float, int, int]], path: str, topk: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind in KINDS:
        pts = [(S, t, saved) for S, k, t, saved, _ in rows if k == kind]
        if not pts:
            continue
        style = "--" if kind in DENSE else "-"
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=kind)
        ax_m.plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], style, marker="o", label=kind)
    for ax, label in ((ax_t, "CPU time per forward + backward (s)"), (ax_m, "saved for backward (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"one attention layer, fp32, one thread, index_topk={topk} (dashed: dense)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--dense-max", type=int, default=8192,
                        help="longest sequence of the dense rows (mla dense keeps [8, S, S] fp32: 2 GiB at 8192)")
    parser.add_argument("--plot", default=None, help="write the figure to this PNG")
    args = parser.parse_args()
    from moefold.training.observe.machine import describe_machine

    print(describe_machine())
    print(f"# sparse vs dense attention, forward + backward, fp32, batch 1, one thread, index_topk={args.topk}")
    print("| S | kind | CPU time ms | saved for backward MiB | peak above inputs MiB |")
    print("|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    rows = []
    for S in args.seqs:
        for kind in args.kinds:
            if kind in DENSE and args.dense_max < S:
                continue
            q = ctx.Queue()
            p = ctx.Process(target=_measure, args=(kind, S, args.topk, args.iters, q))
            p.start()
            seconds, saved, peak = q.get()
            p.join()
            rows.append((S, kind, seconds, saved, peak))
            print(f"| {S} | {kind} | {seconds * 1e3:.0f} | {saved / 2**20:.1f} | {peak / 2**20:.0f} |", flush=True)
    if args.plot:
        _plot(rows, args.plot, args.topk)


if __name__ == "__main__":
    main()
