"""A CPU stand-in for Transformer Engine's PyTorch API (``Linear``, ``GroupedLinear``, FP8 padding, autocast,
recipes), written against TE's sources (TransformerEngine main at 2.20.0.dev0, d0067d0; "quantization.py:N"
below is ``transformer_engine/pytorch/quantization.py`` line N there, "grouped_linear.py" and "linear.py"
are under ``transformer_engine/pytorch/module/``).

It checks the *protocol* moefold follows, not TE's kernels or FP8 numerics: constructors and ``forward`` have
TE's signatures, weights are read the way TE reads them (``weight{i}`` ``[out, in]``), the arithmetic is plain
(a matmul in the input's dtype; padding adds zero rows), so gradients through it are real; and it keeps TE's
FP8 global state the way ``FP8GlobalStateManager`` does, so that what moefold makes TE *communicate* can be
counted:

- ``autocast`` saves and restores the state, counts its depth, marks the next TE module as the region's
  first at an outermost entry (quantization.py:754-756) and, at the exit of the outermost region with grad
  enabled, runs the forward amax reduction (quantization.py:779-782);
- a TE module's first FP8 forward under ``DelayedScaling`` registers its amaxes in the global buffer of its
  (recipe, group) key (quantization.py:501-560, called from ``module/base.py`` ``prepare_forward``); the
  first TE module of a region reduces the backward amaxes in its backward (grouped_linear.py:602-607,
  1253-1254; linear.py:1442, 1467-1469);
- a reduction (quantization.py:656-684) concatenates every registered amax of every key and all-reduces it
  over that key's group when ``recipe.reduce_amax`` and the group has > 1 rank. The stand-in does not
  communicate: it appends ``Reduction(direction, group ranks, numel)`` to ``_State.reductions`` so a test
  can compare the sequence across ranks (a real TE would hang or mix amaxes where they differ).

Rejected as TE rejects (each with the TE line): an autocast entered while ``torch.compile`` traces with
``DelayedScaling`` (quantization.py:226-229, called from ``autocast.__enter__`` at quantization.py:1043-1044);
re-entering one autocast object (quantization.py:1039-1042); ``m_splits`` of the wrong length
(grouped_linear.py:2197-2201); FP8 input tensors (grouped_linear.py:2213-2214); FP8 ``te.Linear`` operands
whose leading dims are not a multiple of 8 or last dim of 16 (linear.py:375-376, ``utils.py:614-624``
``assert_dim_for_fp8_exec``). Module forwards are dynamo-disabled as TE's are (``@no_torch_dynamo()``,
grouped_linear.py:2136, linear.py:1872, ``fp8_padding.py:99``). Not modelled: TE's CUDA-only input check
(``module/base.py:1605-1608``), which would make a CPU stand-in useless.
"""

from __future__ import annotations

import enum
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

# What the real library rejects and the stand-in with it: (what, file:line in TransformerEngine main at d0067d0,
# 2.20.0.dev0). tests/test_standins.py passes each of these to the stand-in and expects the rejection.
PRECONDITIONS: tuple[tuple[str, str], ...] = (
    ("DelayedScaling autocast entered while torch.compile traces",
     "transformer_engine/pytorch/quantization.py:226-229 (check_recipe_support, from autocast.__enter__ :1043-1044)"),
    ("one autocast object entered twice at once", "transformer_engine/pytorch/quantization.py:1039-1042"),
    ("m_splits of another length than num_gemms", "transformer_engine/pytorch/module/grouped_linear.py:2197-2201"),
    ("an FP8 input to GroupedLinear", "transformer_engine/pytorch/module/grouped_linear.py:2213-2214"),
    ("FP8 te.Linear operands: leading dims a multiple of 8, last of 16",
     "transformer_engine/pytorch/module/linear.py:375-376 -> transformer_engine/pytorch/utils.py:614-624"),
    ("Float8BlockScaling below compute capability 9.0 or CUDA 12.9",
     "transformer_engine/pytorch/quantization.py:178-185 (check_recipe_support :234-235, autocast_enter :764-766)"),
    ("MXFP8BlockScaling outside compute capability 10.x-11.x",
     "transformer_engine/pytorch/quantization.py:162-168 (check_recipe_support :236-237, autocast_enter :761-763)"),
    ("NVFP4BlockScaling below compute capability 10.0",
     "transformer_engine/pytorch/quantization.py:171-175 (autocast_enter :767-769)"),
    ("Float8BlockScaling with 2-D blocks for two operands of one GEMM",
     "transformer_engine/common/recipe/__init__.py:449-457"),
    ("NVFP4BlockScaling with an FP8 scale format other than E4M3",
     "transformer_engine/common/recipe/__init__.py:578"),
    ("NVFP4 operands whose rows or columns are not multiples of 32",
     "transformer_engine/common/cast/nvfp4/quantize_transpose_nvfp4.cuh:1472-1475"),
)

# The GPU the stand-in pretends to be (TE reads torch.cuda.get_device_capability / torch.version.cuda):
# an H100 by default; a test sets DEVICE["capability"] = (10, 0) to be a B200.
DEVICE: dict[str, Any] = {"capability": (9, 0), "cuda": 12.9}


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    """``transformer_engine.common.recipe.DelayedScaling`` (its fields and defaults, ``common/recipe/__init__.py``)."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3


@dataclass
class Float8BlockScaling:
    """``recipe.Float8BlockScaling`` (its fields, defaults and ``__post_init__`` checks, recipe/__init__.py:392-466):
    1x128 activations and gradients, 128x128 weights, power-of-2 scales by default."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        assert all(d in (1, 2) for d in dims), "Only 1D or 2D blocks supported"
        assert sum(d == 2 for d in dims) <= 1, "2D by 2D block gemm not supported."
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."


@dataclass
class NVFP4BlockScaling:
    """``recipe.NVFP4BlockScaling`` (recipe/__init__.py:489-590): e2m1 values, e4m3 scales per 16, 2-D weights,
    RHT and stochastic rounding by default."""

    fp4_format: str = "E2M1"
    fp8_format: Format = Format.E4M3
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        assert self.fp8_format == Format.E4M3, "Only E4M3 is supported for NVFP4 scaling"


class Reduction(NamedTuple):
    """One amax all-reduce TE would issue: "forward" (at a region's exit) or "backward"; the group's ranks
    (None: the default group, the world); the number of amaxes reduced."""

    direction: str
    group: tuple[int, ...] | None
    numel: int


@dataclass
class _FP8State:
    """``FP8GlobalState`` (quantization.py:388-410), the fields moefold's use touches."""

    enabled: bool = False
    recipe: Any = None
    group: Any = None
    depth: int = 0
    is_first_module: bool = False
    amax_buffer: dict[tuple[str, str], list[int]] = field(default_factory=dict)   # (direction, key) -> sizes
    groups: dict[str, Any] = field(default_factory=dict)                          # key -> group


class _State:
    recipe: Any = None                   # the recipe of the active autocast, None outside
    entered: ClassVar[list[Any]] = []    # recipes of every outermost autocast entered
    reductions: ClassVar[list[Reduction]] = []
    fp8 = _FP8State()


def _key(recipe: Any, group: Any) -> str:
    """quantization.py:714-727 ``get_unique_autocast_key``: the recipe's repr and the group's identity."""
    return f"recipe={recipe!r},group={id(group) if group is not None else None}"


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    if group is None:
        return None
    return tuple(dist.get_process_group_ranks(group))


def _reduce(direction: str) -> None:
    """quantization.py:656-684 ``reduce_and_update_fp8_tensors``: every key of this direction, its group."""
    for (dir_, key), sizes in _State.fp8.amax_buffer.items():
        if dir_ != direction or not sizes:
            continue
        group = _State.fp8.groups[key]
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world > 1:   # recipe.reduce_amax is True (the default moefold keeps)
            _State.reductions.append(Reduction(direction, _group_ranks(group), sum(sizes)))


def _check_recipe_support(recipe: Any) -> None:
    """quantization.py:224-238: DelayedScaling cannot enter an autocast while torch.compile traces; block recipes
    need their device (check_fp8_block_scaling_support / check_mxfp8_support)."""
    if torch.compiler.is_compiling() and isinstance(recipe, DelayedScaling):
        raise RuntimeError("DelayedScaling is not supported under torch.compile. Please use other recipes instead.")
    check = {Float8BlockScaling: check_fp8_block_scaling_support, MXFP8BlockScaling: check_mxfp8_support}.get(
        type(recipe), check_fp8_support)
    ok, reason = check()
    if not ok:
        raise RuntimeError(reason)


def _autocast_enter_asserts(recipe: Any) -> None:
    """quantization.py:757-769 ``autocast_enter``: FP8 at all, then the recipe's own support (NVFP4 here only)."""
    ok, reason = check_fp8_support()
    assert ok, reason
    if isinstance(recipe, NVFP4BlockScaling):
        ok, reason = check_nvfp4_support()
        assert ok, reason


class autocast:  # TE's (lower-case) name
    """``transformer_engine.pytorch.autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)``."""

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Any = None,
                 amax_reduction_group: Any = None, _graph: bool = False) -> None:
        self._enabled, self._recipe, self._group = enabled, recipe, amax_reduction_group
        self._saved: Any = None

    def __enter__(self) -> autocast:
        if self._saved is not None:   # quantization.py:1039-1042
            raise RuntimeError("autocast context manager cannot be entered more than once concurrently")
        if self._enabled:
            _check_recipe_support(self._recipe)
            _autocast_enter_asserts(self._recipe)
        s = _State.fp8
        self._saved = (s.enabled, s.recipe, s.group, s.is_first_module, _State.recipe)
        s.enabled, s.recipe, s.group = self._enabled, self._recipe, self._group
        if s.depth == 0:
            s.is_first_module = True
            if self._enabled:
                _State.entered.append(self._recipe)
        s.depth += 1
        _State.recipe = self._recipe if self._enabled else None
        return self

    def __exit__(self, *exc: Any) -> None:
        s = _State.fp8
        s.enabled, s.recipe, s.group, s.is_first_module, _State.recipe = self._saved
        self._saved = None
        s.depth -= 1
        if self._enabled and s.depth == 0 and torch.is_grad_enabled():   # quantization.py:779-782
            _reduce("forward")


def _fp8_forward(module: nn.Module, needs_grad: bool) -> bool:
    """A TE module's FP8 bookkeeping at forward (``base.py`` ``prepare_forward``, quantization.py:501-560): with
    DelayedScaling, register this module's amaxes once. Returns whether its backward reduces the backward
    amaxes: it is the region's first module that records a backward (grouped_linear.py:602-607)."""
    s = _State.fp8
    if not s.enabled:
        return False
    if isinstance(s.recipe, DelayedScaling) and not getattr(module, "_registered", False):
        key = _key(s.recipe, s.group)
        s.groups[key] = s.group
        for direction in ("forward", "backward"):
            s.amax_buffer.setdefault((direction, key), []).append(module.num_amaxes)
        module._registered = True
    if not (needs_grad and torch.is_grad_enabled()):
        return False
    first, s.is_first_module = s.is_first_module, False
    return first


class _ReduceInBackward(torch.autograd.Function):
    """Identity; its backward runs the backward amax reduction (the region's first module's backward)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _reduce("backward")
        return grad


def _after_forward(y: torch.Tensor, first: bool) -> torch.Tensor:
    return _ReduceInBackward.apply(y) if first and y.requires_grad else y


def _reject_fp8_input(inp: torch.Tensor) -> None:
    if inp.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):   # grouped_linear.py:2213-2214
        raise TypeError("GroupedLinear doesn't support input tensor in FP8.")


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
        self.num_amaxes = 3 * num_gemms   # input, weight, grad per GEMM (the sizes only matter for comparisons)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=self.params_dtype)))
        self.forward_calls: list[dict[str, Any]] = []
        GroupedLinear.instances.append(self)

    @torch._dynamo.disable
    def forward(self, inp: torch.Tensor, m_splits: list[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        if isinstance(m_splits, torch.Tensor):   # grouped_linear.py:2192-2196: a CPU int64 tensor is accepted
            m_splits = [int(m) for m in m_splits.tolist()]
        assert isinstance(m_splits, list) and all(type(m) is int for m in m_splits), \
            f"m_splits must be a host list of ints, got {m_splits!r}"
        if len(m_splits) != self.num_gemms:   # grouped_linear.py:2197-2201
            raise ValueError(f"Shape of splits tensor (({len(m_splits)},)) does not match number of GEMMs "
                             f"({self.num_gemms}).")
        assert sum(m_splits) == inp.shape[0], (m_splits, inp.shape)
        _reject_fp8_input(inp)
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        assert all(w.device.type != "meta" for w in weights), "TE's own (meta) weights were used"
        assert not self.use_bias
        first = _fp8_forward(self, inp.requires_grad or weights[0].requires_grad)
        self.forward_calls.append({"m_splits": list(m_splits), "weights": weights, "recipe": _State.recipe,
                                   "grad_enabled": torch.is_grad_enabled()})
        rows = inp.split(m_splits)
        return _after_forward(torch.cat([r @ w.T for r, w in zip(rows, weights)]), first)


class Linear(nn.Module):
    """TE's ``Linear(in_features, out_features, ..., bias, params_dtype, device)``: ``weight [out, in]``."""

    instances: ClassVar[list[Linear]] = []

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Any = None, rng_tracker_name: str | None = None, init_method: Any = None,
                 bias: bool = True, return_bias: bool = False, params_dtype: torch.dtype | None = None,
                 parallel_mode: str | None = None, device: torch.device | str = "cuda", **kw: Any) -> None:
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.num_amaxes = 3
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.calls: list[Any] = []
        Linear.instances.append(self)

    @torch._dynamo.disable
    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        assert self.weight.device.type != "meta", "TE's own (meta) weight was used"
        assert not self.use_bias
        if _State.fp8.enabled:   # linear.py:375-376 -> utils.py:614-624
            for t in (inp, self.weight):
                if math.prod(t.shape[:-1]) % 8 or t.shape[-1] % 16:
                    raise ValueError("FP8 execution requires the product of all dimensions except the last to be "
                                     "divisible by 8 and the last dimension to be divisible by 16, but got tensor "
                                     f"with dims={list(t.size())}")
            if isinstance(_State.recipe, NVFP4BlockScaling):   # quantize_transpose_nvfp4.cuh:1472-1475
                for t in (inp, self.weight):
                    if math.prod(t.shape[:-1]) % 32:
                        raise RuntimeError("Number of tensor rows must be a multiple of 32")
                    if t.shape[-1] % 32:
                        raise RuntimeError("Number of tensor cols must be a multiple of 32")
        first = _fp8_forward(self, inp.requires_grad or self.weight.requires_grad)
        self.calls.append(_State.recipe)
        return _after_forward(inp @ self.weight.T, first)


def _align(recipe: Any) -> int:
    """quantization.py:262-283 ``get_align_size_for_quantization``: 32 MXFP8, 128 NVFP4, else 16."""
    if isinstance(recipe, MXFP8BlockScaling):
        return 32
    return 128 if isinstance(recipe, NVFP4BlockScaling) else 16


class Fp8Padding(nn.Module):
    """``Fp8Padding(num_gemms, align_size=None)``: forward(inp, m_splits) -> (padded inp, padded m_splits)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    @torch._dynamo.disable
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

    @torch._dynamo.disable
    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        a = self.align_size or _align(_State.recipe)
        padded = [(m + a - 1) // a * a for m in m_splits]
        return torch.cat([rows[:m] for rows, m in zip(inp.split(padded), m_splits)])


def check_fp8_support() -> tuple[bool, str]:
    """quantization.py:149-159 ``_compute_fp8_support`` on ``DEVICE``."""
    if DEVICE["capability"] >= (8, 9):
        return True, ""
    return False, "Device compute capability 8.9 or higher required for FP8 execution."


def check_mxfp8_support() -> tuple[bool, str]:
    """quantization.py:162-168."""
    if DEVICE["capability"] >= (12, 0):
        return False, "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet."
    if DEVICE["capability"] >= (10, 0):
        return True, ""
    return False, "Device compute capability 10.0 or higher required for MXFP8 execution."


def check_nvfp4_support() -> tuple[bool, str]:
    """quantization.py:171-175."""
    if DEVICE["capability"] >= (10, 0):
        return True, ""
    return False, "Device compute capability 10.0 or higher required for NVFP4 execution."


def check_fp8_block_scaling_support() -> tuple[bool, str]:
    """quantization.py:178-185."""
    if DEVICE["capability"] >= (9, 0) and DEVICE["cuda"] >= 12.9:
        return True, ""
    return False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."


def reset() -> None:
    """Fresh logs and FP8 state (a new process's TE)."""
    GroupedLinear.instances, Linear.instances = [], []
    _State.recipe, _State.entered, _State.reductions, _State.fp8 = None, [], [], _FP8State()


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the stand-in under ``transformer_engine`` in sys.modules (undone by ``monkeypatch``); fresh logs."""
    reset()
    monkeypatch.setitem(DEVICE, "capability", (9, 0))   # an H100 unless the test says otherwise
    monkeypatch.setitem(DEVICE, "cuda", 12.9)
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.GroupedLinear, pt.Linear, pt.Fp8Padding, pt.Fp8Unpadding = GroupedLinear, Linear, Fp8Padding, Fp8Unpadding
    pt.autocast = autocast
    quant = types.ModuleType("transformer_engine.pytorch.quantization")
    quant.check_fp8_support, quant.check_mxfp8_support = check_fp8_support, check_mxfp8_support
    quant.check_nvfp4_support, quant.check_fp8_block_scaling_support = (check_nvfp4_support,
                                                                        check_fp8_block_scaling_support)
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    recipe.Float8CurrentScaling, recipe.MXFP8BlockScaling = Float8CurrentScaling, MXFP8BlockScaling
    recipe.Float8BlockScaling, recipe.NVFP4BlockScaling = Float8BlockScaling, NVFP4BlockScaling
    te.pytorch, te.common, common.recipe, pt.quantization = pt, common, recipe, quant
    for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.pytorch.quantization", quant), ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    from moefold.precision import fp8

    fp8._te_recipe.cache_clear()   # recipes built from an earlier (real or stand-in) TE must not be reused
    return pt


__all__ = ["DEVICE", "PRECONDITIONS", "Float8BlockScaling", "NVFP4BlockScaling", "install", "reset", "GroupedLinear",
           "Linear", "Reduction", "_State"]
