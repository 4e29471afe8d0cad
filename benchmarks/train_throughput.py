"""End-to-end training tokens/s, eager against ``--compile``, on the built-in corpus (world 1).

    python benchmarks/train_throughput.py                  # qwen3_moe_tiny and a ~50M-parameter Qwen3-MoE
    python benchmarks/train_throughput.py --models tiny --steps 30

Each model trains from the configuration ``moefold train --recipe qwen3_moe_tiny [--compile]`` builds
(its flags, defaults and built-in corpus; the "50m" model overrides the recipe's sizes: hidden 512,
4 layers, 8 heads of 64 (4 KV groups), 16 experts of FFN 384, top-2, vocabulary 8192), eager first,
then compiled, in this process. tokens/s is the median step time over the steps after
``--skip`` (the first steps compile, and the global aux loss recompiles once at the second
micro-batch); the first step's time and the compile time are printed beside it. On a shared,
loaded machine use ``--threads 1 --cpu-time`` (this process's CPU time: idle waits and other jobs'
time slices left out; with several threads, OpenMP's barriers make wall time erratic there).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time

import torch

from moefold.execution.compile import compile_unavailable
from moefold.parallel.dims import ParallelDims
from moefold.training.cli import build_parser
from moefold.training.cli.train import config_from_args
from moefold.training.config import RunConfig
from moefold.training.observe.machine import describe_machine
from moefold.training.run import build_dataset
from moefold.training.trainer import Trainer

MODEL_50M = {"hidden_size": 512, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4, "head_dim": 64,
             "num_experts": 16, "moe_ffn_hidden_size": 384, "moe_topk": 2, "vocab_size": 8192}


def run_config(model: str, compile: bool, steps: int, data_cache_dir: str | None) -> RunConfig:
    argv = ["train", "--recipe", "qwen3_moe_tiny", "--train-iters", str(steps), "--no-save", "--no-balance-report"]
    argv += ["--compile"] if compile else []
    argv += ["--data-cache-dir", data_cache_dir] if data_cache_dir else []
    config = config_from_args(build_parser("train").parse_args(argv))
    if model == "50m":
        config = dataclasses.replace(config, model=config.model.with_(**MODEL_50M))
    return config


def measure(config: RunConfig, skip: int, clock) -> dict:
    dims = ParallelDims.single()
    dataset = build_dataset(config, dims)
    logs: list[str] = []
    trainer = Trainer(config, dims, log=logs.append)
    stamps = [clock()]
    trainer.fit(dataset, on_step=lambda _r: stamps.append(clock()))
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    t = config.train
    tokens = t.global_batch_size * t.seq_length
    steady = statistics.median(steps[skip:])
    compiled = getattr(trainer, "compiled", None)
    return {"params": sum(p.numel() for p in trainer.model.parameters()), "first": steps[0],
            "tok_s": tokens / steady, "step": steady,
            "compile_s": compiled.seconds() if compiled is not None else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,50m", help="tiny (qwen3_moe_tiny) and/or 50m, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the steady-state median")
    p.add_argument("--data-cache-dir", default=None, help="where the built-in corpus is cached (moefold's default)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--cpu-time", action="store_true", help="time steps with this process's CPU time (loaded machine)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.process_time if a.cpu_time else time.perf_counter
    if a.steps <= a.skip:
        p.error(f"--steps={a.steps} must exceed --skip={a.skip}")
    print(describe_machine())
    reason = compile_unavailable("cpu")
    modes = [False] + ([True] if reason is None else [])
    if reason is not None:
        print(f"# compiled runs skipped: {reason}")
    print(f"# world 1, cpu, fp32, clock: {'process CPU' if a.cpu_time else 'wall'}; steady state = median step "
          f"time of steps {a.skip + 1}..{a.steps}")
    print(f"{'model':6} {'params':>8} {'mode':8} {'tokens/s':>9} {'step s':>7} {'first step s':>12} "
          f"{'compile s':>9} {'compiled/eager':>14}")
    for model in a.models.split(","):
        eager = None
        for compile in modes:
            r = measure(run_config(model, compile, a.steps, a.data_cache_dir), a.skip, clock)
            eager = eager or r["tok_s"]
            compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
            print(f"{model:6} {r['params'] / 1e6:>7.1f}M {'compiled' if compile else 'eager':8} {r['tok_s']:>9.0f} "
                  f"{r['step']:>7.3f} {r['first']:>12.1f} {compile_s:>9} {r['tok_s'] / eager:>14.2f}", flush=True)
    print(f"# torch threads {torch.get_num_threads()}, load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
