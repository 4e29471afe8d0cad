"""Muon's optimizer step beside AdamW's on the same model (world 1, CPU).

    python benchmarks/muon_step.py                       # the 57.7M-parameter MoE, 1 thread
    python benchmarks/muon_step.py --iters 9 --threads 2 --cpu-time

Model: ``benchmarks/optimizer_step.py``'s (Qwen3-MoE shape, hidden 512, 4 layers, 16 experts top-2, expert FFN
512, 8 heads of 64, vocabulary 4096: 57.7M parameters). Each side times, per step, what the trainer runs:
``GradSync.start_step``, ``grad_norm()`` and its host read, ``step()`` (clip, update, parameter sync):

- ``adamw``: ``DistributedAdamW`` over every parameter (``--optimizer adam``);
- ``muon fp32``: ``DistributedMuon`` (``--optimizer muon --muon-fp32-matmul-prec highest``): Newton-Schulz (5
  quintic steps) on every matrix (the 64 experts' gate, up and down matrices one by one, batched), AdamW on the
  embedding, output layer, norms and routers;
- ``muon bf16``: the same with the iteration in bf16 (``medium``, Megatron's default), where the CPU has bf16
  matmul units (else skipped, and the machine line says why).

The gradients are refilled with the same random values before each step (not timed). The sides alternate, so
machine noise hits all; medians and the ratios to AdamW are printed after the machine line. Muon's extra cost is
the iteration: per matrix ``[m, n]`` (m <= n) 5 x (2 m^2 n + m^3 + ...) flops; sharded over dp, each rank computes
only the matrices it owns (``training.optim.muon``), so the cost per rank falls with dp.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moefold.models.decoder import MoEDecoder
from moefold.parallel.dims import ParallelDims
from moefold.training.observe.machine import bf16_skip_reason, describe_machine
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.muon import DistributedMuon, MuonOptions, is_muon_matrix
from moefold.training.optim.optimizer import DistributedAdamW

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimizer_step import config_57m, timing_parser  # the same model and flags as the AdamW benchmark


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Flops of ``steps`` Newton-Schulz iterations on one ``rows x cols`` matrix (m = the smaller side: X X^T,
    A A and B X, 2 flops per multiply-add)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def _side(kind: str) -> tuple[Callable[[Callable[[], float]], float], int, int]:
    """(one timed step, number of Muon matrices, their Newton-Schulz flops) of a fresh model with ``kind``."""
    dims = ParallelDims.single()
    model = MoEDecoder(config_57m(), dims)
    model.init_weights(0)
    if kind == "adamw":
        sync = GradSync(model.named_parameters(), dims)
        opt = DistributedAdamW(sync, dims, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        matrices = flops = 0
    else:
        sync = GradSync(model.named_parameters(), dims, whole=is_muon_matrix)
        prec = "highest" if kind == "muon fp32" else "medium"
        opt = DistributedMuon(sync, dims, options=MuonOptions(fp32_matmul_prec=prec), weight_decay=0.1)
        counts = [(m.param.numel() // (m.param.size(-1) * m.param.size(-2)), m.param.shape[-2:])
                  for m in opt.matrices]
        matrices = sum(c for c, _ in counts)
        flops = sum(c * ns_flops(*shape) for c, shape in counts)
    grads = [torch.randn(g.grad_data.shape, generator=torch.Generator().manual_seed(i))
             for i, g in enumerate(sync.groups)]

    def step(clock: Callable[[], float]) -> float:
        t0 = clock()
        sync.start_step(1)
        t1 = clock()
        for g, values in zip(sync.groups, grads):   # not timed
            g.grad_data.copy_(values)
        t2 = clock()
        norm = float(opt.grad_norm())
        opt.step(1e-3, min(1.0, 1.0 / (norm + 1e-6)))
        return t1 - t0 + clock() - t2

    return step, matrices, flops


def main(argv: list[str] | None = None) -> None:
    args = timing_parser(__doc__, 5).parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(describe_machine())
    kinds = ["adamw", "muon fp32", "muon bf16"]
    skip = bf16_skip_reason()
    if skip:
        kinds.remove("muon bf16")
        print(f"# muon bf16 skipped: {skip}")
    sides = {k: _side(k) for k in kinds}
    print(f"# clock: {'process CPU time' if args.cpu_time else 'wall'}; 57.7M parameters, fp32 parameters, world 1; "
          f"{sides['muon fp32'][1]} matrices orthogonalised ({sides['muon fp32'][2] / 1e9:.0f} GFLOP of Newton-Schulz "
          f"a step); medians of {args.iters} steps, alternating")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:   # warm-up: state allocation, kernel selection
        sides[k][0](clock)
    for _ in range(args.iters):
        for k in kinds:
            times[k].append(sides[k][0](clock))
    base = statistics.median(times["adamw"])
    for k in kinds:
        m = statistics.median(times[k])
        rate = f"   {sides[k][2] / m / 1e9:5.1f} GFLOP/s" if sides[k][2] else ""
        print(f"{k:10s} zero+norm+clip+update+param sync {m * 1e3:9.1f} ms   {m / base:6.1f}x adamw{rate}")


if __name__ == "__main__":
    main()
