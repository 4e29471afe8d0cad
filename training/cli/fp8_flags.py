"""The FP8/FP4 flags of ``moefold train`` (Megatron-LM's names where it has them) and the ``FP8Config`` they give.

The only definitions of these flags; their choices and defaults are ``precision.fp8``'s, so a new backend or
recipe added there shows up here.
"""

from __future__ import annotations

import argparse
from typing import Any

from moefold.precision.fp8 import (
    DEFAULT_EXCLUDE,
    FP4_FORMATS,
    FP4_RECIPES,
    FP8_BACKENDS,
    FP8_FORMATS,
    FP8_RECIPES,
    FP8Config,
)


def add_fp8_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The FP8 flags (Megatron-LM's names where it has them) on ``parser`` (a parser or an argument group)."""
    parser.add_argument("--fp8-format", default=None, choices=FP8_FORMATS,
                        help="FP8 GEMMs in the linears and the experts: e4m3, or hybrid (e4m3 forward, e5m2 "
                             "gradients); default off")
    parser.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                        help="FP8 scaling; torchao: tensorwise (default) | rowwise | blockwise (DeepSeek-V3: 1x128 "
                             "activations, 128x128 weights) | mxfp8 (32-element e8m0 blocks); te: delayed (default) | "
                             "tensorwise | blockwise (Hopper) | mxfp8 (Blackwell). CPU: emulated")
    parser.add_argument("--fp4-format", default=None, choices=FP4_FORMATS,
                        help="FP4 GEMMs instead of FP8: e2m1 (NVFP4: 16-element blocks, e4m3 scales, an fp32 "
                             "per-tensor scale; Blackwell, emulated on CPU); nvfp4 is the same")
    parser.add_argument("--fp4-recipe", default="nvfp4", choices=FP4_RECIPES,
                        help="FP4 scaling recipe (nvfp4: TE NVFP4BlockScaling / moefold's torchao-numerics NVFP4)")
    parser.add_argument("--fp8-param-gather", action="store_true",
                        help="FP8 primary weights: the distributed optimizer all-gathers the updated weights as FP8 "
                             "(1 byte per element) from fp32 masters (torchao tensorwise or blockwise)")
    parser.add_argument("--moe-router-padding-for-quantization", action="store_true",
                        help="pad each expert's token count to the FP8/FP4 grouped GEMM's multiple (16, 32 MXFP8, "
                             "128 NVFP4 / torchao blockwise) in the dispatch's row map (zero rows, no extra copy)")
    parser.add_argument("--fp8-backend", default="torchao", choices=FP8_BACKENDS,
                        help="torchao (default; CPU and CUDA) or te (Transformer Engine, CUDA; the experts need "
                             "--moe-grouped-gemm-backend te)")
    parser.add_argument("--fp8-exclude-modules", nargs="*", default=list(DEFAULT_EXCLUDE), metavar="NAME",
                        help="modules whose qualified name contains one of these keep high-precision GEMMs "
                             f"(default: {' '.join(DEFAULT_EXCLUDE)}; e.g. add layers.0. for the first layer)")
    parser.add_argument("--moe-fp8-dispatch", action="store_true",
                        help="send routed tokens to their experts as e4m3 with per-128-channel scales "
                             "(alltoall, allgather and flex on DeepEP V2)")


def fp8_config_from_args(args: argparse.Namespace) -> FP8Config:
    fp4 = getattr(args, "fp4_format", None)
    return FP8Config(format=args.fp8_format, recipe=args.fp4_recipe if fp4 else args.fp8_recipe,
                     backend=args.fp8_backend, exclude_modules=tuple(args.fp8_exclude_modules),
                     dispatch=args.moe_fp8_dispatch, fp4=fp4, param_gather=getattr(args, "fp8_param_gather", False),
                     router_padding=getattr(args, "moe_router_padding_for_quantization", False))


__all__ = ["add_fp8_arguments", "fp8_config_from_args"]
