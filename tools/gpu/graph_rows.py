"""CUDA graphs in the GPU check: training step time with and without them, on one model and the same data.

    python -m moefold.tools.gpu.graph_rows                      # CUDA, the "small" size
    python -m moefold.tools.gpu.graph_rows --device cpu --size tiny --warmup 1 --steps 2   # the rehearsal

Rows (``ROWS``), each a ``Trainer`` built in this process from the same config but ``--cuda-graph-impl`` /
``--cuda-graph-modules`` (bf16, ``--no-gradient-accumulation-fusion`` in every row, the graphs need it):
``eager`` (no graphs), ``local layer`` (each whole layer: qwen3's dropless local dispatch is sync-free in bf16),
``local attn+router+preprocess`` (Megatron's MoE recommendation), ``full_iteration`` (each step's forward and
backward of every micro-batch in one graph), and ``eager`` again last (the faster eager row is the baseline: the
first row of a process also pays what the process does once).

``--size small`` is ``qwen3_moe_tiny`` (hidden 64, 2 layers of 8 experts) at 4 micro-batches of 2 x 256 tokens:
small kernels, so the step is bound by kernel launches, where graphs matter most (a proxy-size step is bound by
its GEMMs). Each row runs ``--warmup`` + ``--steps`` steps (the graphs are captured after ``--warmup`` eager
steps); its step time is the median of the last ``--steps`` (each step ends with the trainer's one host copy, so
the device has finished). Printed: the step time, the speed-up over ``eager``, the last loss, and the largest
per-step loss difference to ``eager``; a row fails when it raises, when its loss is not finite, or when a loss
differs from eager's by more than ``LOSS_RTOL`` (the same kernels replay: bf16 rounding noise at most).
``--deadline S``: no row starts after S seconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from moefold.tools.gpu.steps import fmt

LOSS_RTOL = 2e-2
# row -> (--cuda-graph-impl, --cuda-graph-modules)
ROWS: dict[str, tuple[str, tuple[str, ...]]] = {
    "eager": ("none", ()),
    "local layer": ("local", ()),
    "local attn+router+preprocess": ("local", ("attn", "moe_router", "moe_preprocess")),
    "full_iteration": ("full_iteration", ()),
}
# size -> (seq length, micro-batch size, micro-batches per step)
SIZES = {"small": (256, 2, 4), "tiny": (32, 1, 2)}


def _config(impl: str, modules: tuple[str, ...], size: str, steps: int, warmup: int):
    from moefold.models.options import ModelOptions
    from moefold.models.recipes import get_recipe
    from moefold.training.config import RunConfig, TrainConfig

    seq, mbs, micro = SIZES[size]
    train = TrainConfig(micro_batch_size=mbs, global_batch_size=mbs * micro, seq_length=seq, train_iters=steps,
                        lr=1e-3, lr_warmup_iters=1, seed=5, bf16=True, gradient_accumulation_fusion=False,
                        cuda_graph_impl=impl, cuda_graph_modules=modules, cuda_graph_warmup_steps=warmup)
    return RunConfig(model=get_recipe("qwen3_moe_tiny").with_(vocab_size=512), options=ModelOptions(), train=train,
                     recipe="qwen3_moe_tiny")


def run_row(impl: str, modules: tuple[str, ...], size: str, device: str, warmup: int,
            steps: int) -> tuple[list[float], list[float]]:
    """(losses of every step, seconds of the timed steps) of one row."""
    from moefold.parallel.dims import ParallelDims
    from moefold.training.trainer import Trainer

    config = _config(impl, modules, size, warmup + steps, warmup)
    trainer = Trainer(config, ParallelDims.single(device), device=device, log=lambda _m: None)
    seq, mbs, micro = SIZES[size]
    data = torch.randint(0, 512, ((warmup + steps) * micro * mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    losses, seconds = [], []
    for s in range(warmup + steps):
        batch = data[s * micro * mbs:(s + 1) * micro * mbs]
        t0 = time.perf_counter()
        result = trainer.train_step(list(batch.split(mbs)))   # ends with the step's one device->host copy
        if s >= warmup:
            seconds.append(time.perf_counter() - t0)
        losses.append(result.loss_lm)
    return losses, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m moefold.tools.gpu.graph_rows",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="small", choices=tuple(SIZES))
    p.add_argument("--warmup", type=int, default=3, help="eager steps before the capture (default 3)")
    p.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up (default 6)")
    p.add_argument("--deadline", type=float, default=None, help="no row starts after this many seconds")
    args = p.parse_args(argv)
    start, ok = time.monotonic(), True
    print(f"device {args.device}, qwen3_moe_tiny bf16, {SIZES[args.size][2]} micro-batches of "
          f"{SIZES[args.size][1]} x {SIZES[args.size][0]} tokens, {args.warmup} warm-up + {args.steps} timed steps")
    if torch.device(args.device).type != "cuda":
        print("(not CUDA: no graphs, the capture-equivalent path; the times measure nothing, the losses do)")
    print("| row | step ms | speed-up vs eager | last loss | max loss diff vs eager | result |")
    print("|---|---|---|---|---|---|")
    measured: dict[str, tuple[list[float], float] | str] = {}
    for row in (*ROWS, "eager again"):   # eager twice: first and last, the faster is the baseline
        if args.deadline is not None and time.monotonic() - start > args.deadline:
            measured[row] = "skipped: out of time"
            continue
        try:
            losses, seconds = run_row(*ROWS[row.removesuffix(" again")], args.size, args.device, args.warmup,
                                      args.steps)
            measured[row] = (losses, 1e3 * statistics.median(seconds))
        except Exception as err:   # a row's failure is its verdict; the other rows still run
            measured[row] = f"failed: {type(err).__name__}: {str(err)[:160]}"
    eager = [m for r, m in measured.items() if r.startswith("eager") and not isinstance(m, str)]
    base_ms = min(ms for _, ms in eager) if eager else None
    base_losses = eager[0][0] if eager else None
    for row, m in measured.items():
        if isinstance(m, str):
            print(f"| {row} | | | | | {m} |")
            ok = ok and m.startswith("skipped")
            continue
        losses, ms = m
        diff = max(abs(a - b) for a, b in zip(losses, base_losses))
        verdict = "passed"
        if not all(math.isfinite(x) for x in losses):
            verdict = "failed: non-finite loss"
        elif diff > LOSS_RTOL * max(abs(x) for x in base_losses):
            verdict = f"failed: loss differs from eager by {diff:.3g}"
        ok = ok and verdict == "passed"
        speedup = fmt(base_ms / ms, ".2f")
        print(f"| {row} | {fmt(ms, '.2f')} | {speedup}x | {fmt(losses[-1], '.4f')} | {fmt(diff, '.2e')} | {verdict} |",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
