"""Memory per rank for each recompute setting: parameters, gradients, optimizer states, activations.

    python benchmarks/memory_table.py                              # tiny recipes measured, proxies counted
    python benchmarks/memory_table.py --recipes qwen3_moe_tiny --seq 512 --micro-batch 2

Tiny recipes (world 1, fp32, one micro-batch of ``--micro-batch`` x ``--seq`` tokens): the trainer is built and
its static memory counted from its tensors (``training.observe.memory.static_bytes``: the flat parameter and main-grad
buffers, the optimizer's slices); one forward + backward runs under ``TensorMemoryTracker`` for every recompute
setting: "after fwd" is what the forward left alive for the backward (the activations), "peak" the largest
amount of tensor memory the forward + backward allocated on top of the static memory.

Proxy recipes are too large for this machine: their static parts are counted on the meta device (parameter
counts x bytes per parameter, world 1, fp32 parameters and states; and, for the usual bf16 setting, bf16
parameters with fp32 grads, master and moments sharded over dp=8), and no activation is measured.
"""

from __future__ import annotations

import argparse
import os

import torch

from moefold.dense.recompute import RECOMPUTE_MODULES
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelDims
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.memory import TensorMemoryTracker, bytes_per_parameter, static_bytes
from moefold.training.optim.precision import OptimizerPrecision
from moefold.training.trainer import Trainer

SETTINGS = {"none": ModelOptions(),
            **{f"selective {m}": ModelOptions(recompute="selective", recompute_modules=(m,))
               for m in RECOMPUTE_MODULES},
            "selective all": ModelOptions(recompute="selective", recompute_modules=RECOMPUTE_MODULES),
            "full (uniform 1)": ModelOptions(recompute="full")}
MIB = 2**20


def measure(recipe: str, options: ModelOptions, micro_batch: int, seq: int) -> dict[str, float]:
    model = get_recipe(recipe)
    train = TrainConfig(micro_batch_size=micro_batch, global_batch_size=micro_batch, seq_length=seq, train_iters=1,
                        lr_warmup_iters=0)
    trainer = Trainer(RunConfig(model=model, options=options, train=train, recipe=recipe), ParallelDims.single(),
                      log=lambda _m: None)
    static = static_bytes(trainer.sync, trainer.optimizer)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.vocab_size, (micro_batch, seq + 1), generator=gen)
    trainer.sync.start_step(1)
    with TensorMemoryTracker() as tracker:
        out = trainer.model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        after_forward = tracker.current
        out.loss.backward()
    return {"params": static["params"] / MIB, "grads": static["grads"] / MIB,
            "optimizer": static["optimizer"] / MIB, "after_fwd": after_forward / MIB, "peak": tracker.peak / MIB}


def proxy_static(recipe: str) -> str:
    with torch.device("meta"):
        model = MoEDecoder(get_recipe(recipe))
    n = sum(p.numel() for p in model.parameters())
    fp32 = bytes_per_parameter("fp32", OptimizerPrecision(), 1)
    bf16 = bytes_per_parameter("bf16", OptimizerPrecision(), 8)
    return (f"| {recipe} | {n / 1e9:.2f}B | {4 * n / 2**30:.1f} GiB | {4 * n / 2**30:.1f} GiB | "
            f"{8 * n / 2**30:.1f} GiB | {fp32:g} B ({fp32 * n / 2**30:.0f} GiB) | "
            f"{bf16:g} B ({bf16 * n / 2**30:.0f} GiB) |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=["qwen3_moe_tiny", "deepseek_v3_tiny", "mixtral_tiny"])
    p.add_argument("--proxies", nargs="*", default=["qwen3_moe_proxy", "deepseek_v3_proxy", "mixtral_proxy"])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}; world 1, fp32, micro-batch {args.micro_batch} x {args.seq} tokens; "
          "MiB per rank; activations measured with TensorMemoryTracker (tensor bytes)")
    for recipe in args.recipes:
        print(f"\n{recipe}\n")
        print("| recompute | params | grads | optimizer | activations after fwd | peak fwd+bwd |")
        print("|---|---|---|---|---|---|")
        for name, options in SETTINGS.items():
            m = measure(recipe, options, args.micro_batch, args.seq)
            print(f"| {name} | {m['params']:.2f} | {m['grads']:.2f} | {m['optimizer']:.2f} | {m['after_fwd']:.2f} | "
                  f"{m['peak']:.2f} |")
    if args.proxies:
        print("\nproxy recipes: static parts counted on the meta device (world 1), activations not measured here\n")
        print("| recipe | parameters | fp32 params | fp32 grads | fp32 exp_avg + exp_avg_sq | bytes/param fp32, "
              "world 1 | bytes/param bf16 + fp32 master, dp 8 |")
        print("|---|---|---|---|---|---|---|")
        for recipe in args.proxies:
            print(proxy_static(recipe))


if __name__ == "__main__":
    main()
