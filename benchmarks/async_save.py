"""Step time with checkpoints written synchronously against ``--async-save`` (world 1), side by side.

    python benchmarks/async_save.py                       # a ~33M-parameter Qwen3-MoE, a checkpoint every 4 steps
    python benchmarks/async_save.py --steps 12 --save-interval 3 --threads 1

Three runs of the same model and data in this process: no checkpoints, a synchronous save every
``--save-interval`` steps, and ``--async-save`` at the same interval (``training.checkpoint.save``: the state is
copied to host memory, a background thread writes it, then the manifest, rename and tracker). The figure is the
mean time per step over the steps after the first (the interval saves fall inside them; the final save, which
waits in both modes, is left out), and the longest step (a step that carries a save). Each run writes into its
own temporary directory (``--dir``: where; the disk matters). On a shared CPU machine the background writer
competes with training for the same cores; on GPUs it competes only for host memory bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from moefold.parallel.dims import ParallelDims
from moefold.training.cli import build_parser
from moefold.training.cli.train import config_from_args
from moefold.training.config import RunConfig
from moefold.training.observe.machine import describe_machine
from moefold.training.trainer import Trainer

MODEL = {"hidden_size": 256, "num_layers": 4, "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 64,
         "num_experts": 16, "moe_ffn_hidden_size": 512, "moe_topk": 2, "vocab_size": 8192}


def config(steps: int, save: str | None, interval: int, async_save: bool) -> RunConfig:
    argv = ["train", "--recipe", "qwen3_moe_tiny", "--train-iters", str(steps), "--seq-length", "128",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--no-balance-report", "--keep-last", "2"]
    argv += ["--save", save, "--save-interval", str(interval)] if save else ["--no-save"]
    argv += ["--async-save"] if async_save else []
    c = config_from_args(build_parser("train").parse_args(argv))
    return dataclasses.replace(c, model=c.model.with_(**MODEL), train=dataclasses.replace(c.train, run_dir="unused"))


def measure(c: RunConfig, data: np.ndarray) -> dict:
    trainer = Trainer(c, ParallelDims.single(), log=lambda _m: None)
    stamps = [time.perf_counter()]
    trainer.fit(data, on_step=lambda _r: stamps.append(time.perf_counter()))
    steps = [b - a for a, b in itertools.pairwise(stamps)][1:]   # the first step warms up
    n = sum(p.numel() for p in trainer.model.parameters())
    return {"mean": statistics.mean(steps), "max": max(steps), "median": statistics.median(steps), "params": n}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=17)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    print(f"# load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rng = np.random.default_rng(0)
    data = rng.integers(0, MODEL["vocab_size"], (args.steps * 2 + 8, 129), dtype=np.int64)
    rows = []
    for name, save, async_save in (("no checkpoints", False, False), ("synchronous save", True, False),
                                   ("--async-save", True, True)):
        root = tempfile.mkdtemp(prefix="moefold-async-bench-", dir=args.dir)
        try:
            r = measure(config(args.steps, os.path.join(root, "ckpt") if save else None, args.save_interval,
                               async_save), data)
            size = sum(e.stat().st_size for e in _files(os.path.join(root, "ckpt"))) if save else 0
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append((name, r, size))
        print(f"{name:>18}: {r['mean'] * 1e3:8.1f} ms/step mean, {r['median'] * 1e3:8.1f} median, "
              f"{r['max'] * 1e3:8.1f} longest" + (f" (checkpoints on disk at the end {size / 2**20:.0f} MiB)"
                                                   if size else ""))
    base, sync, asyn = (r for _, r, _ in rows)
    print(f"# {rows[0][1]['params'] / 1e6:.1f}M parameters, a save every {args.save_interval} steps; "
          f"mean step: sync / none {sync['mean'] / base['mean']:.2f}x, async / none {asyn['mean'] / base['mean']:.2f}x,"
          f" async / sync {asyn['mean'] / sync['mean']:.2f}x; longest step async / sync "
          f"{asyn['max'] / sync['max']:.2f}x")


def _files(path: str):
    for e in os.scandir(path):
        if e.is_dir():
            yield from _files(e.path)
        else:
            yield e


if __name__ == "__main__":
    main()
