"""FP8 / FP4 recipes (``--fp8-backend torchao``) against bf16 and fp32: one linear and one MoE layer, fwd + bwd.

    python benchmarks/fp8.py                                   # sizes for the device found, every recipe
    python benchmarks/fp8.py --tokens 8192 --hidden 4096 --configs "64,8,1536;16,2,4096" --iters 20
    python benchmarks/fp8.py --recipes e4m3:blockwise,e2m1:nvfp4 --outliers 3e4

Recipes (``format:recipe``): per-tensor ``hybrid:tensorwise``, ``e4m3:tensorwise``, ``e4m3:rowwise``; block-scaled
``e4m3:blockwise`` (DeepSeek-V3: 1x128 / 128x128), ``e4m3:mxfp8`` (32-element e8m0 blocks), ``e2m1:nvfp4``
(``--fp4-format e2m1``). For each case it runs the fp32 module, the bf16 module and the recipe's module (same
weights, same input) side by side in one run and prints

- the relative error of the output and the input gradient against fp32, next to bf16's own (every device:
  the recipe's numerics); with ``--outliers F`` a second linear line where 1/64 of the tokens are F times
  larger, its error measured on the other tokens (what one scale per tensor loses and blocks keep);
- the median time of the bf16 and the recipe's module and their ratio. On a GPU with the recipe's tensor cores
  that is the speed-up (and TFLOP/s counting the GEMMs only); on a CPU every recipe is EMULATED: the ratio is
  the emulation's cost, not a speed. (The per-tensor / row-wise recipes run torch's CPU ``_scaled_mm``, which
  is ~300x slower than an fp32 matmul in torch 2.13; the block recipes multiply dequantised fp32 operands.)

The linear is a [T, H] x [H, 4H] projection; the MoE layer a local (ep 1) layer with E experts, top-k, expert
FFN F. It names the machine (``training.observe.machine.describe_machine``, then threads and load, or the GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from moefold.dense.linear import ColumnParallelLinear
from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8 import FP8Config
from moefold.training.observe.machine import describe_machine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], None], device: torch.device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(module: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def step() -> tuple[torch.Tensor, torch.Tensor]:
        module.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = module(xi)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(gy)
        return y.detach(), xi.grad
    return step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def parse_recipe(pair: str) -> FP8Config:
    fmt, recipe = pair.split(":")
    return FP8Config(fp4=fmt, recipe=recipe) if fmt == "e2m1" else FP8Config(fmt, recipe)


def compare(name: str, build: Callable[[FP8Config, torch.dtype], nn.Module], x: torch.Tensor, gy: torch.Tensor,
            flops: float, fp8: FP8Config, timed: bool, iters: int, rows: slice = slice(None)) -> None:
    """One line: errors against fp32 (of the recipe and of plain bf16) on ``rows``, then the times."""
    f32, ref, mod = build(FP8Config(), torch.float32), build(FP8Config(), torch.bfloat16), build(fp8, torch.bfloat16)
    ref.load_state_dict(f32.state_dict())
    mod.load_state_dict(f32.state_dict())
    y32, gx32 = _fwd_bwd(f32, x.float(), gy.float())()
    (y_ref, gx_ref), (y, gx) = _fwd_bwd(ref, x, gy)(), _fwd_bwd(mod, x, gy)()
    fmt = fp8.fp4 or fp8.format
    line = (f"{name:38} {fmt:6} {fp8.recipe:10} vs fp32: y {_rel(y[rows], y32[rows]):.2e} dx "
            f"{_rel(gx[rows], gx32[rows]):.2e} (bf16: y {_rel(y_ref[rows], y32[rows]):.1e} dx "
            f"{_rel(gx_ref[rows], gx32[rows]):.1e})")
    warmup = 2 if x.is_cuda else 0   # CPU: the emulation is slow (torch's CPU _scaled_mm above all); the first
    t_ref = median_seconds(_fwd_bwd(ref, x, gy), x.device, iters, warmup)   # call above warmed up
    t_fp8 = median_seconds(_fwd_bwd(mod, x, gy), x.device, iters, warmup)
    if timed:
        line += (f" | bf16 {t_ref * 1e3:8.2f} ms {flops / t_ref / 1e12:6.0f} TFLOP/s | {fmt} {t_fp8 * 1e3:8.2f} ms "
                 f"{flops / t_fp8 / 1e12:6.0f} TFLOP/s | speed-up {t_ref / t_fp8:.2f}x")
    else:
        line += f" | emulated {t_fp8 * 1e3:7.1f} ms vs bf16 {t_ref * 1e3:6.1f} ms: emulation cost {t_fp8 / t_ref:.1f}x"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384 if cuda else 256)
    p.add_argument("--hidden", type=int, default=4096 if cuda else 256)
    p.add_argument("--configs", default="64,8,1536;16,2,4096" if cuda else "8,2,256", help="E,k,F;E,k,F;...")
    p.add_argument("--recipes", default="hybrid:tensorwise,e4m3:rowwise,e4m3:tensorwise,e4m3:blockwise,e4m3:mxfp8,"
                                        "e2m1:nvfp4", help="format:recipe pairs (e2m1:nvfp4 is --fp4-format e2m1)")
    p.add_argument("--outliers", type=float, default=3e4,
                   help="also a linear whose every 64th token is this much larger (0: skip)")
    p.add_argument("--iters", type=int, default=20 if cuda else 1)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if cuda else "cpu")
    print(describe_machine(), flush=True)
    if cuda:
        props = torch.cuda.get_device_properties(device)
        fp8_units = (props.major, props.minor) >= (8, 9)
        print(f"# {props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, CUDA {torch.version.cuda}; "
              + ("FP8 tensor cores: timing FP8 against bf16" if fp8_units else "no FP8 tensor cores: numerics only"))
    else:
        fp8_units = False
        print(f"# CPU {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
              f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
        print("# every recipe is EMULATED on CPU (quantise, dequantise, fp32 GEMM): the errors are the recipes' "
              "numerics; the times are the emulation's cost, not speed")
    torch.manual_seed(0)
    T, H = a.tokens, a.hidden
    kw = {"dtype": torch.bfloat16, "device": device}
    recipes = []
    for fp8 in (parse_recipe(pair) for pair in a.recipes.split(",")):
        try:
            fp8.check_available()   # a GPU without the recipe's tensor cores refuses it, naming what it needs
            recipes.append(fp8)
        except RuntimeError as exc:
            print(f"# skipped: {exc}")

    def linear(fp8: FP8Config, dtype: torch.dtype) -> nn.Module:
        model = nn.ModuleDict({"proj": ColumnParallelLinear(H, 4 * H, None, dtype=dtype, device=device)})
        convert_linears_to_fp8(model, fp8)
        return model["proj"]

    x, gy = torch.randn(T, H, **kw), torch.randn(T, 4 * H, **kw)
    for fp8 in recipes:
        compare(f"linear [{T},{H}]x[{H},{4 * H}]", linear, x, gy, 3 * 2 * T * H * 4 * H, fp8, fp8_units, a.iters)
    if a.outliers:
        xo = x.clone()
        xo[::64] *= a.outliers
        ordinary = torch.ones(T, dtype=torch.bool, device=device)
        ordinary[::64] = False
        for fp8 in recipes:
            compare(f"  with {a.outliers:g}x outlier tokens", linear, xo, gy, 3 * 2 * T * H * 4 * H, fp8, fp8_units,
                    a.iters, rows=ordinary)
    for spec in a.configs.split(";"):
        E, k, F = (int(v) for v in spec.split(","))

        def moe(fp8: FP8Config, dtype: torch.dtype, E: int = E, k: int = k, F: int = F) -> nn.Module:
            router = RouterConfig(num_experts=E, topk=k, load_balancing_type="none")
            cfg = MoEConfig(num_experts=E, router=router, experts=ExpertsConfig(F, fp8=fp8),
                            dispatch=DispatchConfig(DispatcherKind.LOCAL, fp8=fp8.dispatch))
            layer = build_moe_layer(cfg, H, ParallelDims.single(device.type), sequence_parallel=False, dtype=dtype,
                                    device=device)
            init_parameters(layer, seed=0)
            return layer

        xm, gm = torch.randn(T, 1, H, **kw), torch.randn(T, 1, H, **kw)
        flops = 3 * 3 * 2 * T * k * H * F   # three projections x (fwd + 2 bwd), experts' GEMMs only
        for fp8 in recipes:
            compare(f"MoE layer E{E} k{k} F{F} T{T} H{H}", moe, xm, gm, flops, fp8, fp8_units, a.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
