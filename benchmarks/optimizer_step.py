"""The optimizer step against the library's, on the same tensors (world 1).

    python benchmarks/optimizer_step.py                  # the 57.7M-parameter MoE, fp32, 1 thread
    python benchmarks/optimizer_step.py --iters 9 --threads 2

Model: Qwen3-MoE shape, hidden 512, 4 layers, 16 experts top-2 (expert FFN 512), 8 heads of 64 (4 kv groups),
vocabulary 4096: 57.7M parameters. Both sides time, per step,

- moefold: ``GradSync.start_step`` (zero the main-grad buffer), ``DistributedAdamW.grad_norm`` and the host
  read of the norm, ``DistributedAdamW.step`` (clip, fused AdamW on the flat shard views, parameter sync);
- reference: ``optimizer.zero_grad(set_to_none=False)``, ``torch.nn.utils.clip_grad_norm_`` and
  ``torch.optim.AdamW(fused=True).step()`` over the same parameters and the same gradient tensors.

The gradients are refilled with the same random values before each step (not timed), large enough that
clipping is active. The two alternate, so machine noise hits both; medians and their ratio are printed with
the machine (``torch.backends.cpu.get_cpu_capability()``, threads, load average).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelDims
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.optimizer import DistributedAdamW


def config_57m():
    """The issue's model: hidden 512, 4 layers, 16 experts top-2 (57.7M parameters)."""
    return get_recipe("qwen3_moe_tiny").with_(
        name="qwen3_moe_57m", vocab_size=4096, hidden_size=512, num_layers=4, num_attention_heads=8,
        num_query_groups=4, head_dim=64, num_experts=16, moe_topk=2, moe_ffn_hidden_size=512)


def machine(threads: int) -> str:
    return (f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{threads} threads, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")


def timing_parser(doc: str, iters: int) -> argparse.ArgumentParser:
    """The optimizer benchmarks' flags: --iters, --threads, --cpu-time."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-time", action="store_true", help="time with this process's CPU time (a shared machine)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = timing_parser(__doc__, 7).parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    model = MoEDecoder(config_57m(), ParallelDims.single())
    model.init_weights(0)
    dims = ParallelDims.single()
    sync = GradSync(model.named_parameters(), dims)
    ours = DistributedAdamW(sync, dims, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = [p for g in sync.groups for p in g.params]
    ref = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    n = sum(p.numel() for p in params)
    grads = [torch.randn(g.grad_data.shape, generator=torch.Generator().manual_seed(i)) for i, g in
             enumerate(sync.groups)]

    def fill() -> None:   # the same gradient values for both, in the same tensors (p.grad is p.main_grad)
        for g, values in zip(sync.groups, grads):
            g.grad_data.copy_(values)

    def moefold_step() -> float:
        t0 = clock()
        sync.start_step(1)
        t1 = clock()
        fill()
        t2 = clock()
        norm = float(ours.grad_norm())   # the trainer's one host read of the step
        ours.step(1e-4, min(1.0, 1.0 / (norm + 1e-6)))
        return t1 - t0 + clock() - t2

    def reference_step() -> float:
        for p in params:   # moefold's start_step may leave .grad None (fused GEMMs write main_grad themselves)
            p.grad = p.main_grad
        t0 = clock()
        ref.zero_grad(set_to_none=False)
        t1 = clock()
        fill()
        t2 = clock()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        ref.step()
        return t1 - t0 + clock() - t2

    print(f"# {machine(args.threads)}; clock: {'process CPU time' if args.cpu_time else 'wall'}")
    print(f"# {n / 1e6:.1f}M parameters, fp32, world 1; medians of {args.iters} steps each, alternating")
    moefold_step(), reference_step()   # warm-up: state allocation, kernel selection
    mine, lib = [], []
    for _ in range(args.iters):
        mine.append(moefold_step())
        lib.append(reference_step())
    a, b = statistics.median(mine), statistics.median(lib)
    print(f"moefold zero+norm+clip+AdamW+param sync  {a * 1e3:8.1f} ms")
    print(f"torch   zero_grad+clip_grad_norm_+AdamW   {b * 1e3:8.1f} ms   (fused=True)")
    print(f"ratio moefold / torch: {a / b:.2f}x (target <= 1.1x); load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
