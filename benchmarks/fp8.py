"""FP8 (``--fp8-backend torchao``) against bf16: one linear's GEMMs and one MoE layer, forward + backward.

    python benchmarks/fp8.py                                   # sizes for the device found
    python benchmarks/fp8.py --tokens 8192 --hidden 4096 --configs "64,8,1536;16,2,4096" --iters 20

For each case it runs the bf16 module and the same module with FP8 GEMMs (same weights, same input)
side by side in one run and prints

- the relative error of the FP8 output and input gradient against bf16 (every device: FP8's numerics);
- on a GPU with FP8 tensor cores (compute capability 8.9+): the median time of each, their TFLOP/s
  (counting the GEMMs only) and the FP8 / bf16 speed-up. The linear is a [T, H] x [H, 4H] projection;
  the MoE layer a local (ep 1) layer with E experts, top-k, expert FFN F and the grouped FP8 GEMM
  (``torch._scaled_grouped_mm`` on sm90/sm100).

On a CPU, FP8 is emulated (``torch._scaled_mm`` dequantises and runs an fp32 GEMM): there is nothing
to gain and the script says so and reports the numerics only. It names the machine
(``torch.backends.cpu.get_cpu_capability()``, threads, load) or the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from moefold.dense.fp8_linear import convert_linears_to_fp8
from moefold.dense.linear import ColumnParallelLinear
from moefold.moe.config import MoEConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.fp8 import FP8Config
from moefold.parallel.sharding import init_parameters


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


def compare(name: str, build: Callable[[FP8Config], nn.Module], x: torch.Tensor, gy: torch.Tensor, flops: float,
            fp8: FP8Config, timed: bool, iters: int) -> None:
    ref, mod = build(FP8Config()), build(fp8)
    mod.load_state_dict(ref.state_dict())
    (y_ref, gx_ref), (y, gx) = _fwd_bwd(ref, x, gy)(), _fwd_bwd(mod, x, gy)()
    line = f"{name:34} {fp8.format:6} {fp8.recipe:10} rel err y {_rel(y, y_ref):.2e} dx {_rel(gx, gx_ref):.2e}"
    if timed:
        t_ref = median_seconds(_fwd_bwd(ref, x, gy), x.device, iters)
        t_fp8 = median_seconds(_fwd_bwd(mod, x, gy), x.device, iters)
        line += (f" | bf16 {t_ref * 1e3:8.2f} ms {flops / t_ref / 1e12:6.0f} TFLOP/s | fp8 {t_fp8 * 1e3:8.2f} ms "
                 f"{flops / t_fp8 / 1e12:6.0f} TFLOP/s | fp8/bf16 speed-up {t_ref / t_fp8:.2f}x")
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384 if cuda else 512)
    p.add_argument("--hidden", type=int, default=4096 if cuda else 256)
    p.add_argument("--configs", default="64,8,1536;16,2,4096" if cuda else "8,2,256", help="E,k,F;E,k,F;...")
    p.add_argument("--recipes", default="hybrid:tensorwise,e4m3:rowwise,e4m3:tensorwise",
                   help="format:recipe pairs")
    p.add_argument("--iters", type=int, default=20 if cuda else 3)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        props = torch.cuda.get_device_properties(device)
        fp8_units = (props.major, props.minor) >= (8, 9)
        print(f"# {props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, CUDA {torch.version.cuda}; "
              + ("FP8 tensor cores: timing FP8 against bf16" if fp8_units else "no FP8 tensor cores: numerics only"))
    else:
        fp8_units = False
        print(f"# CPU {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
              f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
        print("# FP8 is emulated on CPU (torch._scaled_mm dequantises and runs an fp32 GEMM): no speed-up to "
              "measure; numerics only")
    torch.manual_seed(0)
    T, H = a.tokens, a.hidden
    kw = {"dtype": torch.bfloat16, "device": device}
    recipes = [FP8Config(*pair.split(":")) for pair in a.recipes.split(",")]

    def linear(fp8: FP8Config) -> nn.Module:
        model = nn.ModuleDict({"proj": ColumnParallelLinear(H, 4 * H, None, **kw)})
        convert_linears_to_fp8(model, fp8)
        return model["proj"]

    x, gy = torch.randn(T, H, **kw), torch.randn(T, 4 * H, **kw)
    for fp8 in recipes:
        compare(f"linear [{T},{H}]x[{H},{4 * H}]", linear, x, gy, 3 * 2 * T * H * 4 * H, fp8, fp8_units, a.iters)
    for spec in a.configs.split(";"):
        E, k, F = (int(v) for v in spec.split(","))

        def moe(fp8: FP8Config, E: int = E, k: int = k, F: int = F) -> nn.Module:
            router = RouterConfig(num_experts=E, topk=k, load_balancing_type="none")
            cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, router=router, dispatcher="local", fp8=fp8)
            layer = MoELayer(cfg, H, ParallelDims.single(device.type), sequence_parallel=False, **kw)
            init_parameters(layer, seed=0)
            return layer

        xm, gm = torch.randn(T, 1, H, **kw), torch.randn(T, 1, H, **kw)
        flops = 3 * 3 * 2 * T * k * H * F   # three projections x (fwd + 2 bwd), experts' GEMMs only
        for fp8 in recipes:
            compare(f"MoE layer E{E} k{k} F{F} T{T} H{H}", moe, xm, gm, flops, fp8, fp8_units, a.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
