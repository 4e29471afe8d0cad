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

Memory savers past ZeRO-1 (``--savers``, on by default; ``--no-savers`` skips them): two spawned gloo ranks (dp2),
each setting side by side with the plain run (the distributed optimizer, no offloading): every activation offload
set, FSDP2 and optimizer offload (fraction 0.5 and 1). Per rank: the parameter, gradient and optimizer-state bytes
on the device (``static_bytes``; buckets of 2^14 elements, so that the offload fraction cuts the tiny models' few
buckets), the host bytes (offloaded optimizer states, and the activations' host copies
when the forward ends), the activations left for the backward and the peak of one forward + backward
(``TensorMemoryTracker``, host copies counted apart), and the median step time of ``--steps`` training steps
(process CPU time with ``--cpu-time``; the settings' steps interleaved round by round, each until its parameters are
ready) against the plain run's. On this CPU the offload copies are plain
synchronous copies and the "CPU" optimizer runs on the same cores as everything else, so the step-time costs here
are upper bounds of what side streams and a host CPU hide on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moefold.dense.activation_offload import OFFLOAD_MODULES
from moefold.dense.recompute import RECOMPUTE_MODULES
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.machine import describe_machine
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


OFFLOAD_SETS = {"offload core_attn attn_proj": ("core_attn", "attn_proj"),
                "offload expert_fc1 moe_act": ("expert_fc1", "moe_act"),
                "offload attn_norm mlp_norm": ("attn_norm", "mlp_norm"),
                "offload qkv_linear": ("qkv_linear",), "offload shared_experts": ("shared_experts",),
                "offload all": OFFLOAD_MODULES}
SAVERS: dict[str, tuple[dict, dict]] = {   # name -> (ModelOptions fields, TrainConfig fields)
    "plain (ZeRO-1)": ({}, {}),
    **{name: ({"offload_modules": mods, "min_offloaded_tensor_size": 0}, {}) for name, mods in OFFLOAD_SETS.items()},
    "recompute layernorm moe_act + offload core_attn attn_proj expert_fc1": (
        {"recompute": "selective", "recompute_modules": ("layernorm", "moe_act"),
         "offload_modules": ("core_attn", "attn_proj", "expert_fc1"), "min_offloaded_tensor_size": 0}, {}),
    "FSDP2": ({}, {"use_torch_fsdp2": True}),
    "optimizer offload 0.5": ({}, {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}),
    "optimizer offload 1": ({}, {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}),
}


def _saver_rank(rank: int, world: int, store: str, args: dict, results: mp.Queue) -> None:
    """One dp rank: every ``SAVERS`` setting's bytes, memory and step time (rank 0 reports)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCH_GLOO_LAZY_INIT="1")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=3600))
    try:
        dims = ParallelDims.build(ParallelConfig())
        model = get_recipe(args["recipe"])
        clock = time.process_time if args["cpu_time"] else time.perf_counter
        rows, trainers, batches = {}, {}, {}
        for name, (options, extra) in SAVERS.items():
            train = TrainConfig(micro_batch_size=args["micro_batch"], global_batch_size=args["micro_batch"] * world,
                                seq_length=args["seq"], train_iters=args["steps"] + 2, lr_warmup_iters=0,
                                bucket_numel=2**14, **extra)   # small buckets: a fraction of a tiny model offloads
            config = RunConfig(model=model, options=ModelOptions(**options), train=train, recipe=args["recipe"])
            trainer = Trainer(config, dims, log=lambda _m: None)
            static = static_bytes(trainer.sync, trainer.optimizer)
            gen = torch.Generator().manual_seed(rank)
            batch = torch.randint(0, model.vocab_size, (args["micro_batch"], args["seq"] + 1), generator=gen)
            trainer.train_step([batch])   # warm-up (and the optimizer's first step)
            trainer.optimizer.finish_param_sync()
            trainer.sync.start_step(1)
            got = {}
            with TensorMemoryTracker() as tracker:
                out = trainer.model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
                got.update(after_fwd=tracker.current, host_act=tracker.offloaded)
                out.loss.backward()
            trainer.sync.finish()
            trainers[name], batches[name] = trainer, batch
            rows[name] = {"params": static["params"], "grads": static["grads"], "states": static["optimizer"],
                          "host": static["host_optimizer"] + got["host_act"], "after_fwd": got["after_fwd"],
                          "peak": tracker.peak, "times": []}
        # Timed in rounds, one step of every setting per round, so that the load other jobs put on the machine
        # drifts over all settings alike. A step ends when its parameters are ready (the optimizer offload's CPU
        # update and deferred gathers included), so that no setting's work runs inside another's timing.
        for _ in range(args["steps"]):
            for name, trainer in trainers.items():
                dist.barrier()
                t0 = clock()
                trainer.train_step([batches[name]])
                trainer.optimizer.finish_param_sync()
                rows[name]["times"].append(clock() - t0)
        for name, trainer in trainers.items():
            trainer.optimizer.close()
            rows[name]["step_s"] = statistics.median(rows[name].pop("times"))
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def savers_table(recipe: str, micro_batch: int, seq: int, steps: int, cpu_time: bool) -> dict[str, dict]:
    """``SAVERS`` measured on 2 spawned gloo ranks (dp2): rank 0's rows."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    args = {"recipe": recipe, "micro_batch": micro_batch, "seq": seq, "steps": steps, "cpu_time": cpu_time}
    with tempfile.TemporaryDirectory(prefix="moefold-bench-memory-") as tmp:
        procs = [ctx.Process(target=_saver_rank, args=(r, 2, os.path.join(tmp, "store"), args, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        rows = results.get(timeout=7200)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"a rank exited with code {p.exitcode}")
    return rows


def print_savers(recipe: str, rows: dict[str, dict]) -> None:
    plain = rows["plain (ZeRO-1)"]
    print(f"\n{recipe}, dp2 (2 gloo ranks), per rank, MiB; step time median, s\n")
    print("| setting | params | grads | optimizer states | host | activations after fwd | peak fwd+bwd | step s | "
          "step vs plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['params'] / MIB:.2f} | {r['grads'] / MIB:.2f} | {r['states'] / MIB:.2f} | "
              f"{r['host'] / MIB:.2f} | {r['after_fwd'] / MIB:.2f} | {r['peak'] / MIB:.2f} | {r['step_s']:.3f} | "
              f"{r['step_s'] / plain['step_s']:.2f}x |")


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
    p.add_argument("--savers", action=argparse.BooleanOptionalAction, default=True,
                   help="the memory savers past ZeRO-1 on 2 spawned ranks (activation offload sets, FSDP2, optimizer "
                        "offload), side by side with the plain run")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="the recompute table (world 1)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per saver setting")
    p.add_argument("--cpu-time", action="store_true", help="time steps with each rank's process CPU time")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(describe_machine())
    print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}; world 1, fp32, micro-batch {args.micro_batch} x {args.seq} tokens; "
          "MiB per rank; activations measured with TensorMemoryTracker (tensor bytes)")
    if args.savers:
        for recipe in args.recipes:
            print_savers(recipe, savers_table(recipe, args.micro_batch, args.seq, args.steps, args.cpu_time))
        print(f"# load average after the savers: {os.getloadavg()[0]:.1f}")
    for recipe in args.recipes if args.recompute else ():
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
