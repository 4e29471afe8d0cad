"""Number formats: FP8/FP4 settings (``FP8Config``), the torchao-numerics casts (tensorwise, rowwise), the
block-scaled casts (blockwise, MXFP8, NVFP4), FP8 primary weights, Transformer Engine's autocast region, and the
linears' GEMMs that need nothing from ``dense`` (block-scaled, Transformer Engine).

May import: ``moefold.parallel`` only (the groups an amax is reduced over). The layers that run these casts
(``execution.fp8_linear``, ``moe.fp8_gemm``, ``moe.block_gemm``, ``moe.te_gemm``) import this package, never the
reverse. No argparse here: the flags are ``training.cli.fp8_flags``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.precision.block_cast import FORMATS, BlockFormat, block_amax, check_split, tensor_amax
    from moefold.precision.block_linear import BlockScaledLinearGemm
    from moefold.precision.fp8 import (
        BACKEND_RECIPES,
        BLOCK_RECIPES,
        FP4_FORMATS,
        FP8_BACKENDS,
        FP8_FORMATS,
        FP8_RECIPES,
        FP8Backend,
        FP8Config,
        FP8Format,
        FP8Recipe,
        import_te,
        import_torchao,
    )
    from moefold.precision.fp8_cast import (
        E4M3,
        E5M2,
        Float8Recipe,
        amax,
        amax_to_scale,
        dequantize,
        quantize,
        scaled_mm,
    )
    from moefold.precision.fp8_param import FP8ParamSpec, fp8_param_spec, mark_fp8_param
    from moefold.precision.fp8_region import FP8Region, Replay, active_region, fp8_autocast, require_region, uses_te
    from moefold.precision.te_linear import TELinearGemm

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["FORMATS", "BlockFormat", "block_amax", "check_split", "tensor_amax"],
                    "moefold.precision.block_cast"),
    "BlockScaledLinearGemm": "moefold.precision.block_linear",
    **dict.fromkeys(["BACKEND_RECIPES", "BLOCK_RECIPES", "FP4_FORMATS", "FP8_BACKENDS", "FP8_FORMATS",
                     "FP8_RECIPES", "FP8Backend", "FP8Config", "FP8Format", "FP8Recipe", "import_te",
                     "import_torchao"], "moefold.precision.fp8"),
    **dict.fromkeys(["E4M3", "E5M2", "Float8Recipe", "amax", "amax_to_scale", "dequantize", "quantize",
                     "scaled_mm"], "moefold.precision.fp8_cast"),
    **dict.fromkeys(["FP8ParamSpec", "fp8_param_spec", "mark_fp8_param"], "moefold.precision.fp8_param"),
    **dict.fromkeys(["FP8Region", "Replay", "active_region", "fp8_autocast", "require_region", "uses_te"],
                    "moefold.precision.fp8_region"),
    "TELinearGemm": "moefold.precision.te_linear",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # settings
    "FP8Config", "FP8Backend", "FP8Format", "FP8Recipe",
    "BACKEND_RECIPES", "BLOCK_RECIPES", "FP4_FORMATS", "FP8_BACKENDS", "FP8_FORMATS", "FP8_RECIPES",
    "import_te", "import_torchao",
    # torchao-numerics casts and the scaled GEMM
    "E4M3", "E5M2", "Float8Recipe", "amax", "amax_to_scale", "quantize", "dequantize", "scaled_mm",
    # block-scaled casts
    "FORMATS", "BlockFormat", "block_amax", "check_split", "tensor_amax",
    # FP8 primary weights, TE's autocast region
    "FP8ParamSpec", "fp8_param_spec", "mark_fp8_param",
    "FP8Region", "Replay", "active_region", "fp8_autocast", "require_region", "uses_te",
    # the linears' GEMMs that need nothing from dense
    "BlockScaledLinearGemm", "TELinearGemm",
]
