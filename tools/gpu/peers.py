"""moefold's MoE layer and training step next to HF ``transformers`` and TorchTitan, on the same card in one run.

    python -m moefold.tools.gpu.peers layer --device cuda [--tokens 8192] [--configs ...] [--deadline S]
    python -m moefold.tools.gpu.peers step --device cuda [--recipe qwen3_moe_proxy] [--batch 2 --seq 4096]
    python -m moefold.tools.gpu.peers layer --device cpu   # the rehearsal: tiny shapes, the host clock
    python -m moefold.tools.gpu.peers step --device cpu    # the rehearsal: qwen3_moe_tiny

``layer``: one MoE layer forward + backward in bf16 on the same [T, H] tokens and output gradient, per implementation,
timed as ``bench.device_time`` times everything (CUDA events, the median of ``--iters`` after ``--warmup``; the host
clock on the CPU), one Markdown row per shape:

- moefold: ``MoELayer`` as the model builds it (``models.layer_factory.build_ffn``; local dispatcher, ``grouped_mm``);
- HF transformers (5.x): the family's MoE block (``Qwen3MoeSparseMoeBlock``, ``DeepseekV3MoE``,
  ``MixtralSparseMoeBlock``) with ``config._experts_implementation = "grouped_mm"`` (``integrations.moe``: sort the
  copies by expert, ``torch.nn.functional.grouped_mm``; the same API in 5.17 and 5.25, checked before use);
- TorchTitan 0.2.x: ``torchtitan.models.moe.MoE`` (``TokenChoiceTopKRouter``, ``GroupedExperts`` on
  ``torch._grouped_mm``) with ``score_before_experts=False``: the probabilities weigh the experts' outputs, as in the
  other two (TorchTitan's default scales the inputs, a different function of the same weights); CUDA only (its
  router counts tokens with ``torch.histc`` over int64 ids and its padding is a Triton kernel): "CUDA only" on the CPU;
- the dense ceiling measured in the same run (``bench.dense_ceiling``: six plain bf16 matmuls of the same FLOPs).

All three hold moefold's weights (mapped to HF names by ``models.hf.exporter.hf_tensors``) with the family's router
(softmax / sigmoid, renormalisation, DeepSeek's scaling and expert bias), so they send the same tokens to the same
experts up to the router's rounding (moefold's router weight and logits are fp32; HF's Qwen3 / Mixtral blocks and
TorchTitan take the logits in bf16); ``tests/tools/gpu/test_peers.py`` checks in fp32 that they compute the same
output. FLOPs, the same count for every column: the routed experts' GEMMs only, 3 GEMMs x 3 (forward + 2 backward)
x 2 N H F, N = T x k routed copies (``bench.expert_gemm_flops``). Ratios "moefold/X" are X's time over moefold's
(above 1: moefold is faster); "layer/dense" is moefold's TFLOP/s over the dense ceiling's.

Shapes (``--configs family:E,k,F,H;...``; family qwen3_moe | deepseek_v3 | mixtral): Qwen3-30B-A3B (128 experts
top-8, F 768, H 2048); DeepSeek-V3 as one GPU of EP32 holds it (256 / 32 = 8 local experts, F 2048, H 7168, top-8 of
the 8: each token sends a copy to every local expert, so each gets T rows and the GEMMs N = 8 T rows, what a
balanced all-to-all leaves a rank whose T tokens route 8 copies each; one expert group, so group-limited routing is
moot); Mixtral 8x7B (8 experts top-2, F 14336, H 4096). Shared experts are left out on every side (a dense MLP, not
routed-expert GEMMs; HF's DeepSeek block keeps a zero-width one, n_shared_experts=0, costing a [T, H] zero-fill).

``step``: one optimizer step of the same model and weights, moefold against HF (``tools.gpu.peers_step``).

A cell that cannot run says why (not installed, not importable, API missing, OOM); one that raised says
``failed:``, and the exit code is then 1. ``--deadline S``: no new row starts after S seconds (its row says so).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moefold.models.config import ModelConfig
from moefold.models.hf.config_map import to_hf_config
from moefold.models.hf.exporter import hf_tensors
from moefold.models.layer_factory import build_ffn, router_config
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.moe.layer import MoELayer
from moefold.parallel.dims import ParallelDims
from moefold.tools.gpu.bench import dense_ceiling, device_time, expert_gemm_flops, start

# the published model whose router and activation each family's rows use
FAMILY_RECIPES = {"qwen3_moe": "qwen3_moe_30b_a3b", "deepseek_v3": "deepseek_v3", "mixtral": "mixtral_8x7b"}
# transformers' MoE block of each family: (models.<module>, class)
HF_BLOCKS = {"qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE"),
             "mixtral": ("mixtral", "MixtralSparseMoeBlock")}
GPU_CONFIGS = "qwen3_moe:128,8,768,2048;deepseek_v3:8,8,2048,7168;mixtral:8,2,14336,4096"
CPU_CONFIGS = "qwen3_moe:8,2,32,64;deepseek_v3:8,2,32,64;mixtral:4,2,32,64"
LAYER_PREFIX = "layers.0.mlp."   # the layer's names inside a one-layer model, for hf_tensors
TITAN_WHEEL = "carry its wheels: docs/gpus.md, Peers"


class Unavailable(Exception):
    """A peer that cannot run here; the message is the cell (not installed, not importable, API missing)."""


@dataclass(frozen=True)
class Shape:
    family: str
    E: int
    k: int
    F: int
    H: int

    def label(self, T: int) -> str:
        return f"{self.family} E{self.E} k{self.k} F{self.F} H{self.H} T{T}"


def parse_configs(text: str) -> list[Shape]:
    """``family:E,k,F,H;...`` -> shapes (one line naming a bad value and what is valid)."""
    shapes = []
    for spec in text.split(";"):
        family, _, sizes = spec.strip().partition(":")
        if family not in FAMILY_RECIPES:
            raise ValueError(f"--configs: family {family!r} in {spec!r}; valid: {', '.join(FAMILY_RECIPES)}")
        values = sizes.split(",")
        if len(values) != 4 or not all(v.strip().isdigit() and int(v) > 0 for v in values):
            raise ValueError(f"--configs: {spec!r}; valid: family:E,k,F,H with four positive integers")
        E, k, F, H = (int(v) for v in values)
        if k > E:
            raise ValueError(f"--configs: top-k {k} exceeds the {E} experts in {spec!r}")
        shapes.append(Shape(family, E, k, F, H))
    return shapes


def layer_config(shape: Shape) -> ModelConfig:
    """A one-layer model of ``shape.family`` whose layer 0 is the MoE layer of ``shape``: the family's router and
    activation, no shared experts, no balancing loss (HF's and TorchTitan's blocks compute none)."""
    changes = dict(hidden_size=shape.H, num_experts=shape.E, moe_topk=shape.k, moe_ffn_hidden_size=shape.F,
                   num_layers=1, moe_shared_expert_ffn_size=0, moe_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if shape.family == "deepseek_v3":   # the local experts as one group: HF and TorchTitan need >= 2 per group
        changes |= dict(first_k_dense_replace=0, mtp_num_layers=0, moe_num_groups=1, moe_group_topk=1)
    return get_recipe(FAMILY_RECIPES[shape.family]).with_(**changes)


def moefold_layer(config: ModelConfig, dtype: torch.dtype, device: str) -> MoELayer:
    """moefold's layer as the decoder builds it, created on ``device`` (``torch.device`` as the default too: the
    router's weight follows the default device)."""
    options = ModelOptions(dispatcher="local", gemm_backend="grouped_mm")
    with torch.device(device):
        return build_ffn(config, True, ParallelDims.single(torch.device(device).type), options, dtype=dtype,
                         device=device)


def hf_state(layer: nn.Module, config: ModelConfig) -> dict[str, Tensor]:
    """``layer``'s tensors under the names of transformers' MoE block (experts fused: its in-memory layout)."""
    state = {}
    for name, tensor in layer.state_dict().items():
        for hf_name, value in hf_tensors(LAYER_PREFIX + name, tensor, config, "fused"):
            state[hf_name.removeprefix("model." + LAYER_PREFIX)] = value
    return state


def hf_layer(config: ModelConfig, layer: MoELayer, dtype: torch.dtype, device: str) -> nn.Module:
    """transformers' MoE block of ``config``'s family on grouped_mm experts, holding ``layer``'s weights."""
    if importlib.util.find_spec("transformers") is None:
        raise Unavailable("not installed: transformers")
    import transformers
    from transformers.integrations import moe as hf_moe

    functions = getattr(hf_moe, "ALL_EXPERTS_FUNCTIONS", None)
    if functions is None or "grouped_mm" not in functions:
        raise Unavailable(f"API missing: transformers {transformers.__version__} has no grouped_mm experts "
                          "(integrations.moe.ALL_EXPERTS_FUNCTIONS, transformers >= 5)")
    module_name, class_name = HF_BLOCKS[config.family]
    block_cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"),
                        class_name, None)
    if block_cls is None:
        raise Unavailable(f"API missing: transformers {transformers.__version__} has no {class_name}")
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(config))
    hf_config._experts_implementation = "grouped_mm"
    with torch.device(device), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")   # DeepSeek's zero-width shared MLP
        block = block_cls(hf_config).to(dtype)
    state = hf_state(layer, config)
    missing, unexpected = block.load_state_dict(state, strict=False)
    # DeepSeek's block always builds its shared MLP: zero-width with n_shared_experts=0
    sizes = {n: t.numel() for n, t in block.state_dict().items()}
    missing = [n for n in missing if sizes[n]]
    if missing or unexpected:
        raise RuntimeError(f"moefold -> {class_name}: missing {missing}, unexpected {unexpected}")
    return block


def titan_layer(config: ModelConfig, layer: MoELayer, dtype: torch.dtype, device: str,
                grouped_mm: bool = True) -> nn.Module:
    """TorchTitan 0.2.x's MoE layer with ``config``'s router, holding ``layer``'s weights (``grouped_mm=False``: its
    per-expert loop, exact in fp32: the grouped path casts to bf16)."""
    if importlib.util.find_spec("torchtitan") is None:
        raise Unavailable(f"not installed: torchtitan ({TITAN_WHEEL})")
    from importlib.metadata import version

    try:
        titan_moe = importlib.import_module("torchtitan.models.moe")
    except ImportError as err:
        if err.name == "torchtitan.models.moe":   # 0.3 moved it (torchtitan.models.common.moe, config objects)
            titan_moe = None
        else:
            raise Unavailable(f"not importable: torchtitan.models.moe: {err}") from err
    if not hasattr(titan_moe, "MoEArgs"):
        raise Unavailable(f"API missing: torchtitan {version('torchtitan')} has no torchtitan.models.moe.MoEArgs "
                          f"(the 0.2.x layer; {TITAN_WHEEL})")
    r = router_config(config, ModelOptions())
    if r.num_groups is not None and r.resolved_group_score_topk != 2:
        raise Unavailable(f"API missing: TorchTitan ranks expert groups by their top 2 scores, this router by "
                          f"{r.resolved_group_score_topk}")
    args = titan_moe.MoEArgs(
        num_experts=r.num_experts, num_shared_experts=0, score_func=r.score_function,
        route_norm=r.resolved_norm_topk_prob, route_scale=r.topk_scaling_factor or 1.0, gate_bias=False,
        score_before_experts=False, top_k=r.topk, num_expert_groups=r.num_groups, num_limited_groups=r.group_topk,
        use_grouped_mm=grouped_mm, load_balance_coeff=1e-3 if r.enable_expert_bias else None)
    with torch.device(device):
        titan = titan_moe.MoE(args, dim=config.hidden_size, hidden_dim=config.moe_ffn_hidden_size).to(dtype)
    w13 = layer.experts.w13.detach()
    state = {"experts.w1": w13[:, 0], "experts.w3": w13[:, 1], "experts.w2": layer.experts.w2.detach(),
             "router.gate.weight": layer.router.weight.detach()}
    if r.enable_expert_bias:
        state["expert_bias"] = layer.router.expert_bias
    titan.load_state_dict(state, strict=True)
    return titan


def _titan_peer(config: ModelConfig, layer: MoELayer, dtype: torch.dtype, device: str) -> nn.Module:
    titan = titan_layer(config, layer, dtype, device)
    if torch.device(device).type == "cpu":   # installed and built, but its forward cannot run here
        raise Unavailable("CUDA only: TorchTitan 0.2 counts tokens with torch.histc over int64 ids (no CPU kernel) "
                          "and pads them with a Triton kernel")
    return titan


def _module_step(module: nn.Module, x_BTH: Tensor, gy_BTH: Tensor) -> Callable[[], None]:
    """Forward + backward of a [B, T, H] -> [B, T, H] block on fixed inputs, gradients dropped first."""
    def step() -> None:
        module.zero_grad(set_to_none=True)
        module(x_BTH).backward(gy_BTH)

    return step


def _moefold_layer_step(layer: MoELayer, x_BTH: Tensor, gy_BTH: Tensor) -> Callable[[], None]:
    x_TBH, gy_TBH = x_BTH.transpose(0, 1), gy_BTH.transpose(0, 1)   # moefold takes [S, B, H]

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x_TBH)[0].backward(gy_TBH)

    return step


def cell_error(err: BaseException) -> str:
    if isinstance(err, Unavailable):
        return str(err)
    if isinstance(err, torch.OutOfMemoryError):
        return "OOM"
    return f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def ratio(mine: float | None, theirs: float | None) -> str:
    return f"{theirs / mine:.2f}" if mine and theirs else "-"


class Table:
    """Markdown rows printed as they come; remembers whether any cell failed."""

    def __init__(self, header: list[str]) -> None:
        self.failed = False
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header), flush=True)

    def row(self, cells: list[str]) -> None:
        self.failed |= any(c.startswith("failed:") for c in cells)
        print("| " + " | ".join(cells) + " |", flush=True)


def free_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in ("transformers", "torchtitan"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def bench_layers(args: argparse.Namespace) -> int:
    T, device, dtype = args.tokens, args.device, torch.bfloat16
    deadline = time.monotonic() + args.deadline
    print(f"MoE layer forward + backward, bf16, {T} tokens; {versions()}; FLOPs: routed-expert GEMMs, 18 N H F")
    table = Table(["shape", "moefold ms", "HF ms", "TorchTitan ms", "moefold/HF", "moefold/TorchTitan",
                   "moefold TFLOP/s", "dense TFLOP/s", "layer/dense"])
    for shape in parse_configs(args.configs):
        name = shape.label(T)
        if time.monotonic() > deadline:
            table.row([name, f"skipped: out of time (--deadline {args.deadline:.0f} s)"] + [""] * 7)
            continue
        flops = expert_gemm_flops(T, shape.k, shape.H, shape.F)
        cells: dict[str, str] = {}
        seconds: dict[str, float] = {}
        modules: dict[str, nn.Module] = {}
        gen = torch.Generator(device=device).manual_seed(0)
        try:
            config = layer_config(shape)
            x = torch.randn(1, T, shape.H, device=device, dtype=dtype, generator=gen, requires_grad=True)
            gy = torch.randn(1, T, shape.H, device=device, dtype=dtype, generator=gen)
            dense = flops / dense_ceiling(T * shape.k, shape.H, shape.F, args.iters, args.warmup, device)
            modules["moefold"] = moefold_layer(config, dtype, device)
        except Exception as err:   # the row reports it; the next shape still runs
            table.row([name, cell_error(err)] + [""] * 7)
            free_cache(device)
            continue
        for peer, build in (("HF", hf_layer), ("TorchTitan", _titan_peer)):
            try:
                modules[peer] = build(config, modules["moefold"], dtype, device)
            except Exception as err:   # the cell reports it
                cells[peer] = cell_error(err)
        for who, module in modules.items():
            step = (_moefold_layer_step if who == "moefold" else _module_step)(module, x, gy)
            try:
                seconds[who] = device_time(step, args.iters, args.warmup, device)
                cells[who] = f"{seconds[who] * 1e3:.2f}"
            except Exception as err:   # the cell reports it
                cells[who] = cell_error(err)
            module.zero_grad(set_to_none=True)
        modules.clear()
        free_cache(device)
        mine = seconds.get("moefold")
        rate = flops / mine if mine else None
        table.row([name, cells["moefold"], cells["HF"], cells["TorchTitan"], ratio(mine, seconds.get("HF")),
                   ratio(mine, seconds.get("TorchTitan")), f"{rate / 1e12:.3g}" if rate else "-",
                   f"{dense / 1e12:.3g}", f"{rate / dense:.2f}" if rate else "-"])
    return 1 if table.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m moefold.tools.gpu.peers",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    lay = sub.add_parser("layer", help="the MoE layer at real shapes: moefold, HF, TorchTitan, the dense ceiling")
    lay.add_argument("--tokens", type=int, default=None, help="tokens T (default 8192 on cuda, 64 on cpu)")
    lay.add_argument("--configs", default=None,
                     help=f"family:E,k,F,H;... (default on cuda {GPU_CONFIGS}; on cpu {CPU_CONFIGS})")
    stp = sub.add_parser("step", help="a training step of the same model: moefold vs HF")
    stp.add_argument("--recipe", default=None, help="default qwen3_moe_proxy on cuda, qwen3_moe_tiny on cpu")
    stp.add_argument("--batch", type=int, default=None, help="sequences per step (default 2 on cuda, 2 on cpu)")
    stp.add_argument("--seq", type=int, default=None, help="sequence length (default 4096 on cuda, 32 on cpu)")
    stp.add_argument("--vocab", type=int, default=None, help="vocabulary (default 16384 on cuda, 512 on cpu)")
    for p in (lay, stp):
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="cuda (default), or cpu: the GPU check's rehearsal of the same code paths")
        p.add_argument("--iters", type=int, default=None, help="timed runs (default 5 on cuda, 1 on cpu)")
        p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2 on cuda, 1 on cpu)")
        p.add_argument("--deadline", type=float, default=float("inf"),
                       help="seconds after which no new row starts (its row says so)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {"iters": 5 if cuda else 1, "warmup": 2 if cuda else 1}
    if args.what == "layer":
        defaults |= {"tokens": 8192 if cuda else 64, "configs": GPU_CONFIGS if cuda else CPU_CONFIGS}
    else:
        defaults |= {"recipe": "qwen3_moe_proxy" if cuda else "qwen3_moe_tiny", "batch": 2,
                     "seq": 4096 if cuda else 32, "vocab": 16384 if cuda else 512}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("iters", "tokens", "batch", "seq", "vocab"):
        if getattr(args, key, 1) < 1:
            parser.error(f"--{key}={getattr(args, key)}; valid: an integer >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup}; valid: an integer >= 0")
    if args.what == "layer":
        try:
            parse_configs(args.configs)
        except ValueError as err:
            parser.error(str(err))
    if args.what == "layer":
        return start(args.device) or bench_layers(args)
    from moefold.tools.gpu.peers_step import bench_step  # it builds on this module's rows

    return start(args.device) or bench_step(args)


if __name__ == "__main__":
    sys.exit(main())
