"""A CPU stand-in for Transformer Engine's PyTorch API (``GroupedLinear``, FP8 padding, autocast, recipes).

It checks the *protocol* moefold follows, not TE's kernels or FP8 numerics: the constructors and
``forward`` have TE's signatures (argument names and defaults of ``GroupedLinear(num_gemms,
in_features, out_features, ..., bias, params_dtype, device)`` and ``forward(inp, m_splits,
is_first_microbatch=None)``, ``m_splits`` a host list of ints as TE 2.x requires), weights are
read the way TE reads them (``getattr(self, f"weight{i}")``, ``[out, in]``), FP8 state is recorded
while TE's ``autocast`` is active, and the arithmetic is plain (a per-group matmul in the input's
dtype; padding adds zero rows), so gradients through the stand-in are real.
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3


class _State:
    recipe: Any = None           # the recipe of the active autocast, None outside
    entered: ClassVar[list[Any]] = []  # recipes of every autocast entered


class autocast:  # TE's (lower-case) name
    """``transformer_engine.pytorch.autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)``."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Any = None,
                 amax_reduction_group: Any = None, _graph: bool = False) -> None:
        self._enabled, self._recipe = enabled, recipe
        self._saved: Any = None

    def __enter__(self) -> autocast:
        self._saved = _State.recipe
        if self._enabled:
            _State.recipe = self._recipe
            _State.entered.append(self._recipe)
        return self

    def __exit__(self, *exc: Any) -> None:
        _State.recipe = self._saved


class GroupedLinear(nn.Module):
    """TE's ``GroupedLinear``: ``weight{i}`` ``[out_features, in_features]`` per GEMM."""

    instances: ClassVar[list[GroupedLinear]] = []

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Any = None, rng_tracker_name: str | None = None, init_method: Any = None,
                 bias: bool = True, return_bias: bool = False, params_dtype: torch.dtype | None = None,
                 parallel_mode: str | None = None, device: torch.device | str = "cuda", ub_overlap_rs: bool = False,
                 ub_overlap_ag: bool = False, ub_name: str | None = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.fuse_wgrad_accumulation = bias, fuse_wgrad_accumulation
        self.params_dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=self.params_dtype)))
        self.forward_calls: list[dict[str, Any]] = []
        GroupedLinear.instances.append(self)

    def forward(self, inp: torch.Tensor, m_splits: list[int], is_first_microbatch: bool | None = None) -> torch.Tensor:
        assert isinstance(m_splits, list) and all(type(m) is int for m in m_splits), \
            f"m_splits must be a host list of ints, got {m_splits!r}"
        assert len(m_splits) == self.num_gemms and sum(m_splits) == inp.shape[0], (m_splits, inp.shape)
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        assert all(w.device.type != "meta" for w in weights), "TE's own (meta) weights were used"
        assert not self.use_bias
        self.forward_calls.append({"m_splits": list(m_splits), "weights": weights, "recipe": _State.recipe})
        rows = inp.split(m_splits)
        return torch.cat([r @ w.T for r, w in zip(rows, weights)])


def _align(recipe: Any) -> int:
    return 32 if isinstance(recipe, MXFP8BlockScaling) else 16


class Fp8Padding(nn.Module):
    """``Fp8Padding(num_gemms, align_size=None)``: forward(inp, m_splits) -> (padded inp, padded m_splits)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        assert len(m_splits) == self.num_gemms and _State.recipe is not None, "padding outside FP8 autocast"
        a = self.align_size or _align(_State.recipe)
        padded = [(m + a - 1) // a * a for m in m_splits]
        parts = []
        for rows, m, p in zip(inp.split(m_splits), m_splits, padded):
            parts += [rows, inp.new_zeros(p - m, inp.shape[1])]
        return torch.cat(parts), padded


class Fp8Unpadding(nn.Module):
    """``Fp8Unpadding(num_gemms, align_size=None)``: forward(inp, m_splits) -> the unpadded rows."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        a = self.align_size or _align(_State.recipe)
        padded = [(m + a - 1) // a * a for m in m_splits]
        return torch.cat([rows[:m] for rows, m in zip(inp.split(padded), m_splits)])


def check_fp8_support() -> tuple[bool, str]:
    return True, ""


def check_mxfp8_support() -> tuple[bool, str]:
    return False, "MXFP8 needs compute capability 10.0 (Blackwell) (stand-in)"


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the stand-in under ``transformer_engine`` in sys.modules (undone by ``monkeypatch``); fresh logs."""
    GroupedLinear.instances = []
    _State.recipe, _State.entered = None, []
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.GroupedLinear, pt.Fp8Padding, pt.Fp8Unpadding, pt.autocast = GroupedLinear, Fp8Padding, Fp8Unpadding, autocast
    quant = types.ModuleType("transformer_engine.pytorch.quantization")
    quant.check_fp8_support, quant.check_mxfp8_support = check_fp8_support, check_mxfp8_support
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    recipe.Float8CurrentScaling, recipe.MXFP8BlockScaling = Float8CurrentScaling, MXFP8BlockScaling
    te.pytorch, te.common, common.recipe, pt.quantization = pt, common, recipe, quant
    for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.pytorch.quantization", quant), ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    return pt


__all__ = ["install", "GroupedLinear", "_State"]
