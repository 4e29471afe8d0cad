"""FP8 primary weights (``--fp8-param-gather``): how each weight is quantised for its all-gather.

``mark_fp8_param`` tags a weight whose GEMMs run in FP8 with the quantisation its GEMM applies to it, so
that the distributed optimizer (``training.optim.fp8_param_gather``) can all-gather the FP8 bytes instead of
the parameter dtype and dequantise them into the parameter: every replica then holds the FP8 values, and the
GEMM's own weight cast of them gives back the same FP8 values (its scale, re-derived, to the last bit), so
numerics are those of the run without ``--fp8-param-gather`` bit for bit (fp32 parameters).

Only recipes with ONE quantisation of a weight for both its GEMMs qualify (``FP8Config._check_param_gather``):
``tensorwise`` (one scale per weight matrix; per expert for the experts) and ``blockwise`` (one per 128x128
block). A weight is viewed as ``matrices x [rows, cols]`` (experts: one matrix per local expert); ``split``
names the groups its rows / columns are sharded over, whose amaxes the GEMM reduces (tensorwise: always;
blockwise: when the whole dim is one block, ``precision.block_cast``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from moefold.parallel.groups import Group
from moefold.precision.fp8 import FP8Config, FP8Recipe


@dataclass(frozen=True)
class FP8ParamSpec:
    """``rows x cols`` matrices (their number is ``numel / (rows * cols)``), blocks ``block`` (None: one scale
    per matrix), rows / columns split over ``split``."""

    rows: int
    cols: int
    block: tuple[int, int] | None
    split: tuple[Group, Group]


def mark_fp8_param(param: Tensor, config: FP8Config, groups: dict[str, Group],
                   matrix: tuple[int, int] | None = None) -> None:
    """Tag ``param`` (a linear's ``[out, in]`` weight, or ``matrix`` per expert) for the FP8 all-gather.
    ``groups``: ``out_group`` / ``in_group`` (the row / column split), as the layer's FP8 GEMM has them."""
    rows, cols = matrix or (param.shape[0], param.shape[-1])
    block = (128, 128) if config.recipe is FP8Recipe.BLOCKWISE else None
    param.moefold_fp8_param = FP8ParamSpec(rows, cols, block, (groups.get("out_group"), groups.get("in_group")))


def fp8_param_spec(param: Tensor) -> FP8ParamSpec | None:
    return getattr(param, "moefold_fp8_param", None)


__all__ = ["FP8ParamSpec", "fp8_param_spec", "mark_fp8_param"]
