"""One MoE layer, forward + backward, against the dense-GEMM ceiling, Megatron-Core's and TorchTitan's layers (world 1).

    python benchmarks/moe_layer.py      # T=4096 H=512, fp32 + bf16, E/k/F 16/2/1024, 64/8/256, 256/8/256, 2 allocators
    python benchmarks/moe_layer.py --dtypes fp32 --configs 16,2,1024 --rounds 7 --allocators default --profile 12

For each (dtype, E/k/F config) it times, side by side in rotated rounds (each round runs every candidate once,
the order shifted by one per round; medians reported):

- ceiling:  plain dense matmuls doing exactly the expert GEMMs' work, as if every routed copy went to one
            expert ([N, H] x [H, 2F], [N, F] x [F, H] and their four backward products), N = T*k;
- moefold:  the whole ``MoELayer`` (router, local permutation, experts, weighted unpermutation), fwd + bwd, as the
            trainer runs it: ``GradSync`` main-grad buffers with gradient-accumulation fusion (the weight
            gradients written into the fp32 buffer), the experts' row layout ``--row-layout`` (auto: the rule;
            several, comma-separated, run side by side in the same rounds, one row each);
- experts:  moefold's grouped experts alone on already-permuted rows;
- megatron: Megatron-Core's ``MoELayer`` with ``SequentialMLP`` experts (its local, non-Transformer-Engine
            spec: TopKRouter in fp32, allgather dispatcher; ``megatron-core`` installed, else skipped), fwd + bwd
            with its parameters' ``.grad`` reset each call (Megatron's fused wgrad kernel is CUDA-only);
- titan:    TorchTitan 0.3's ``MoE`` (``torchtitan.models.common.moe``: ``TokenChoiceTopKRouter`` softmax top-k
            renormalised, ``LocalTokenDispatcher``, ``GroupedExperts`` on ``torch._grouped_mm``, which on a CPU
            loops over the experts with ``mm``), bf16 parameters and ``.grad`` (no main grads), fwd + bwd, the
            scores applied to the experts' outputs as in the other two; bf16 rows only (its experts cast their
            inputs and weights to bf16 whatever the parameters' dtype); ``torchtitan`` installed
            (``pip install --no-deps torchtitan==0.3.0 spmd-types==0.3.1 tyro==1.0.17 docstring-parser==0.18.0
            typeguard==4.6.1``: docs/benchmarks.md), else skipped with the reason.

GFLOP/s count the expert GEMMs only (3 projections x (fwd + 2 bwd) x 2*N*H*F). The figures of merit are
moefold / ceiling and megatron (titan) time / moefold time, all from the same rounds. Routing is near-uniform
(random router weights, dropless). ``--profile N`` prints the N top ops (self CPU time) of one step of moefold
and of each peer, and the rate of its ``aten::mm`` calls (GFLOP/s from their shapes).

The first line names the machine (CPU, bf16 matmul units, threads, allocator). ``--allocators default,tuned``
(the default) runs the whole table twice, the second time in a child process started with glibc's
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at 4 GiB (freed memory kept for reuse), so one
command shows whether the allocator still matters. bf16 rows are skipped, with the reason, on a CPU without
bf16 matmul units. ``--compile`` adds rows for what ``moefold train --compile`` does to the layer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import torch

from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.execution.compile import compile_moe_layer, compile_unavailable
from moefold.execution.grad_accumulation import enable_grad_accumulation_fusion
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig
from moefold.moe.cpu.expert_rows import RowLayout
from moefold.moe.cpu.rows_gemm import chosen_layouts
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters
from moefold.training.observe.machine import bf16_skip_reason, describe_machine
from moefold.training.optim.grad_sync import GradSync

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def _clock(cpu_time: bool) -> Callable[[], float]:
    return time.process_time if cpu_time else time.perf_counter


def rotated_medians(steps: dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float],
                    warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each step, run round-robin (round r starts at candidate r mod n)."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            steps[name]()
            times[name].append(clock() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def dense_ceiling(N: int, H: int, F: int, dtype: torch.dtype) -> Callable[[], None]:
    """The six dense matmuls of one gated MLP over N rows, fwd + bwd."""
    x, gy = torch.randn(N, H, dtype=dtype), torch.randn(N, H, dtype=dtype)
    w13, w2 = torch.randn(H, 2 * F, dtype=dtype), torch.randn(F, H, dtype=dtype)
    h, dh = torch.randn(N, F, dtype=dtype), torch.randn(N, 2 * F, dtype=dtype)

    def step() -> None:
        x @ w13          # gate + up
        h @ w2           # down
        gy @ w2.T        # d act
        h.T @ gy         # d w2
        dh @ w13.T       # d x
        x.T @ dh         # d w13

    return step


def trainer_layer(H: int, E: int, k: int, F: int, dtype: torch.dtype, compiled: bool = False,
                  row_layout: str = "auto") -> tuple[MoELayer, GradSync, Callable[[torch.Tensor, torch.Tensor], None]]:
    """(layer, its GradSync, step): a world-1 MoE layer on the trainer's path (GradSync main grads with
    gradient-accumulation fusion); ``step(x [T, 1, H], gy)`` runs its fwd + bwd on ``x`` (a leaf needing grad)."""
    router = RouterConfig(num_experts=E, topk=k, load_balancing_type="none")
    cfg = MoEConfig(num_experts=E, router=router, experts=ExpertsConfig(F, row_layout=RowLayout(row_layout)),
                    dispatch=DispatchConfig(DispatcherKind.LOCAL))
    layer = build_moe_layer(cfg, H, ParallelDims.single(), dtype=dtype)
    init_parameters(layer, seed=0)
    if compiled:
        compile_moe_layer(layer)
    sync = GradSync(layer.named_parameters(), ParallelDims.single(), overlap=False)
    enable_grad_accumulation_fusion(layer)

    def step(x: torch.Tensor, gy: torch.Tensor) -> None:
        sync.start_step(1)
        x.grad = None
        y, _ = layer(x)
        y.backward(gy)
        sync.finish()

    return layer, sync, step


def moefold_steps(T: int, H: int, E: int, k: int, F: int, dtype: torch.dtype, compiled: bool,
                  row_layout: str = "auto") -> tuple[Callable[[], None], Callable[[], None], MoELayer]:
    """(layer step, experts-only step, layer): the trainer's path (``trainer_layer``) on one fixed input."""
    layer, sync, step = trainer_layer(H, E, k, F, dtype, compiled, row_layout)
    x = torch.randn(T, 1, H, dtype=dtype, requires_grad=True)
    gy = torch.randn(T, 1, H, dtype=dtype)

    def layer_step() -> None:
        step(x, gy)

    with torch.no_grad():
        routed = layer.router(x.view(T, H))
        d = layer.dispatcher.dispatch(x.view(T, H).detach(), routed.routing)
    rows = d.tokens_NH.detach().requires_grad_()
    g_rows = torch.randn_like(rows)

    def experts_step() -> None:
        sync.start_step(1)
        rows.grad = None
        layer.experts(rows, d.tokens_per_expert_e, None, d.probs_N).backward(g_rows)   # weighted, as in the layer
        sync.finish()

    return layer_step, experts_step, layer


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def megatron_available() -> str | None:
    """None when megatron-core can run here, else why not."""
    try:
        with _quiet():
            import megatron.core  # noqa: F401
    except ImportError:
        return "megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)"
    return None


_MEGATRON_READY = False


def _megatron_setup() -> None:
    """World-1 gloo group and Megatron's parallel state; its CUDA-only calls (device queries, RNG forks, TE's
    GEMM name) pointed at the CPU, nothing that computes a value."""
    global _MEGATRON_READY
    if _MEGATRON_READY:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    with _quiet():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.moe import moe_utils
    parallel_state.initialize_model_parallel(1, 1)
    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    _MEGATRON_READY = True


def megatron_step(T: int, H: int, E: int, k: int, F: int, dtype: torch.dtype) -> Callable[[], None]:
    """Megatron-Core 0.16.1's MoELayer (SequentialMLP experts, local spec), fwd + bwd."""
    _megatron_setup()
    with _quiet():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=F, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, num_moe_experts=E, moe_ffn_hidden_size=F,
        moe_router_topk=k, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_router_dtype="fp32",
        use_cpu_initialization=True, perform_initialization=True, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    with _quiet():
        mlp = build_module(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp,
                           config=cfg)
    x = torch.randn(T, 1, H, dtype=dtype, requires_grad=True)
    gy = torch.randn(T, 1, H, dtype=dtype)
    params = list(mlp.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        y, _ = mlp(x)
        y.backward(gy)

    return step


def titan_available() -> str | None:
    """None when TorchTitan 0.3's MoE layer can be imported here, else why not."""
    try:
        _titan_modules()
    except ImportError as err:
        return (f"torchtitan 0.3 is not importable ({err}; pip install --no-deps torchtitan==0.3.0 "
                "spmd-types==0.3.1 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)")
    return None


def _titan_modules():
    """TorchTitan 0.3's ``moe`` module, its ``Linear`` and ``LocalTokenDispatcher``. Its token dispatcher module
    imports the expert-parallel Triton kernels (``distributed.minimal_async_ep.kernels``) at load; without
    triton (a CPU machine) that one module is stood in by one whose every kernel raises if called: the local
    dispatcher (world 1) calls none of them."""
    import importlib.util
    import types

    kernels = "torchtitan.distributed.minimal_async_ep.kernels"
    if importlib.util.find_spec("torchtitan") is None:
        raise ImportError("torchtitan is not installed")
    if importlib.util.find_spec("triton") is None and kernels not in sys.modules:
        def kernel(name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def refuse(*args, **kwargs):
                raise RuntimeError(f"{name} is TorchTitan's Triton kernel (expert parallelism on a GPU)")
            return refuse
        stand_in = types.ModuleType(kernels)
        stand_in.__getattr__ = kernel
        sys.modules[kernels] = stand_in
    with _quiet():
        from torchtitan.models.common import moe
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    return moe, Linear, LocalTokenDispatcher


def titan_step(T: int, H: int, E: int, k: int, F: int, dtype: torch.dtype) -> Callable[[], None]:
    """TorchTitan 0.3's MoE layer (softmax top-k renormalised, as moefold's and Megatron's routers), fwd + bwd."""
    moe, Linear, LocalTokenDispatcher = _titan_modules()
    experts = moe.RoutedExperts.Config(inner_experts=moe.GroupedExperts.Config(dim=H, hidden_dim=F, num_experts=E),
                                       token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k))
    router = moe.TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=H, out_features=E),
                                              top_k=k, score_func="softmax", route_norm=True)
    layer = moe.MoE.Config(num_experts=E, routed_experts=experts, router=router, load_balance_coeff=None).build()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    layer = layer.to(dtype).train()
    x = torch.randn(1, T, H, dtype=dtype, requires_grad=True)
    gy = torch.randn(1, T, H, dtype=dtype)
    params = list(layer.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        with _quiet():   # its router asks CPU autocast for fp32, which warns and runs the gate in bf16
            y = layer(x)
        y.backward(gy)

    return step


def profile_top(step: Callable[[], None], top: int) -> None:
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1
    print(f"#   top ops of one step (self CPU, {total / 1e3:.0f} ms profiled):")
    for e in events[:top]:
        share = 100 * e.self_cpu_time_total / total
        print(f"#     {e.key[:44]:44} {e.self_cpu_time_total / 1e3:8.1f} ms {share:5.1f}% x{e.count}")
    # the GEMMs' own rate: every aten::mm's 2*m*k*n over its time (equal calls on two sides should run equally)
    mms = [e for e in prof.events() if e.name == "aten::mm" and len(e.input_shapes) >= 2]
    mm_us = sum(e.cpu_time_total for e in mms)
    if mm_us:
        flop = sum(2 * e.input_shapes[0][0] * e.input_shapes[0][1] * e.input_shapes[1][1] for e in mms)
        print(f"#   aten::mm: {mm_us / 1e3:.1f} ms in {len(mms)} calls, {flop / mm_us / 1e3:.1f} GFLOP/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens T per layer call")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--configs", default="16,2,1024;64,8,256;256,8,256", help="E,k,F;E,k,F;...")
    p.add_argument("--rounds", type=int, default=5, help="rotated rounds (medians)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--compile", action="store_true", help="add rows with the layer compiled as --compile does")
    p.add_argument("--no-megatron", action="store_true", help="skip the Megatron-Core peer")
    p.add_argument("--no-torchtitan", action="store_true", help="skip the TorchTitan peer")
    p.add_argument("--row-layout", default="auto",
                   help="the experts' CPU row layout (moe.cpu.rows_gemm.choose_layout; measured: timed per shape); "
                        "comma-separated layouts run side by side in the same rounds, one row each; valid: "
                        + ", ".join(RowLayout))
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N top ops of one step of moefold and of each peer")
    p.add_argument("--allocators", default="default,tuned",
                   help="default: this process's allocator settings; tuned: again in a child process with "
                        "glibc's mmap and trim thresholds at 4 GiB")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time instead of wall-clock (with --threads 1 on a shared, "
                        "loaded machine)")
    a = p.parse_args(argv)
    allocators = [v for v in a.allocators.split(",") if v]
    if not set(allocators) <= {"default", "tuned"} or not allocators:
        p.error(f"--allocators={a.allocators!r}: valid values are default, tuned (comma-separated)")
    for d in a.dtypes.split(","):
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    layouts = [v for v in a.row_layout.split(",") if v]
    for v in layouts:
        if v not in tuple(RowLayout):
            p.error(f"--row-layout: {v!r} is not one of {', '.join(RowLayout)}")
    if not layouts:
        p.error("--row-layout: give at least one layout")
    if allocators != ["default"]:  # the tuned table runs in a child with the allocator set from its start
        args = list(sys.argv[1:] if argv is None else argv)
        args = [v for i, v in enumerate(args) if v != "--allocators" and (i == 0 or args[i - 1] != "--allocators")
                and not v.startswith("--allocators=")]
        if "default" in allocators:
            main([*args, "--allocators", "default"])
            print()
        if "tuned" not in allocators:
            return 0
        return subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--allocators", "default"],
                              env={**os.environ, **TUNED_MALLOC}).returncode
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    clock = _clock(a.cpu_time)
    T, H = a.tokens, a.hidden
    modes = [False]
    if a.compile:
        reason = compile_unavailable("cpu")
        if reason is None:
            modes.append(True)
        else:
            print(f"# compiled rows skipped: {reason}")
    peer = None if a.no_megatron else megatron_available()
    titan = None if a.no_torchtitan else titan_available()
    print(describe_machine())
    print(f"# clock: {'process CPU' if a.cpu_time else 'wall'}; T={T} H={H}; medians of {a.rounds} rotated rounds; "
          f"GFLOP/s count expert GEMMs only; megatron: {'skipped' if a.no_megatron else peer or 'megatron-core'}; "
          f"titan: {'skipped' if a.no_torchtitan else titan or 'torchtitan 0.3'}")
    mw = 8 if len(layouts) == 1 else 9 + max(len(v) for v in layouts)   # "compiled/<layout>"
    print(f"{'dtype':5} {'E':>3} {'k':>2} {'F':>5} {'mode':{mw}} {'ceil GF/s':>9} {'layer ms':>9} {'layer/ceil':>10} "
          f"{'experts/ceil':>12} {'megatron ms':>11} {'megatron/moefold':>16} {'titan ms':>9} {'titan/moefold':>13}")
    for dname in a.dtypes.split(","):
        dtype = DTYPES[dname]
        skip = bf16_skip_reason() if dtype == torch.bfloat16 else None
        if skip is not None:
            print(f"{dname:5} skipped: {skip}")
            continue
        for spec in a.configs.split(";"):
            E, k, F = (int(v) for v in spec.split(","))
            N = T * k
            flops = 3 * 3 * 2 * N * H * F
            for compiled in modes:
                steps = {"ceiling": dense_ceiling(N, H, F, dtype)}
                for lay in layouts:
                    steps[f"moefold {lay}"], steps[f"experts {lay}"], _ = moefold_steps(T, H, E, k, F, dtype,
                                                                                        compiled, lay)
                if not compiled and peer is None and not a.no_megatron:
                    steps["megatron"] = megatron_step(T, H, E, k, F, dtype)
                if not compiled and titan is None and not a.no_torchtitan and dtype == torch.bfloat16:
                    steps["titan"] = titan_step(T, H, E, k, F, dtype)
                t = rotated_medians(steps, a.rounds, clock)
                ceil = flops / t["ceiling"] / 1e9
                for lay in layouts:
                    mode = ("compiled" if compiled else "eager") + ("" if len(layouts) == 1 else f"/{lay}")
                    ours = t[f"moefold {lay}"]
                    meg = (f"{t['megatron'] * 1e3:>11.1f} {t['megatron'] / ours:>16.2f}" if "megatron" in t
                           else f"{'-':>11} {'-':>16}")
                    meg += (f" {t['titan'] * 1e3:>9.1f} {t['titan'] / ours:>13.2f}" if "titan" in t
                            else f" {'-':>9} {'-':>13}")
                    print(f"{dname:5} {E:>3} {k:>2} {F:>5} {mode:{mw}} {ceil:>9.0f} {ours * 1e3:>9.1f} "
                          f"{t['ceiling'] / ours:>10.2f} {t['ceiling'] / t[f'experts {lay}']:>12.2f} {meg}", flush=True)
                if a.profile and not compiled:
                    for name in (f"moefold {layouts[0]}", "megatron", "titan"):
                        if name in steps:
                            print(f"#   {name}:")
                            profile_top(steps[name], a.profile)
                del steps
    measured = {f"{k[1]} E{k[2]} {k[3]}x{k[4]} ~{k[5]} rows": v for k, v in chosen_layouts().items()}
    if measured:
        print(f"# expert row layouts measured: {measured}")
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
