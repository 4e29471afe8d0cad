"""Casting GEMM operands to float8 and multiplying them: the numerics every FP8 GEMM in moefold shares.

A cast is torchao's float8 training cast, computed with torchao's own functions
(``torchao.float8.float8_utils.amax_to_scale`` and ``to_fp8_saturated``)::

    amax  = max |t| over the scaled dims (all of them: tensorwise; the GEMM's contraction dim: rowwise)
    scale = fp8_max / max(amax, 1e-12)      (fp64, then fp32; rowwise rounds it down to a power of 2)
    q     = saturate(t.float() * scale) as float8;    dequantised value = q.float() * (1 / scale)

When the scaled dims are sharded over a process group (a tensor-parallel weight shard, the
sequence shard of a replicated layer, an expert-tensor-parallel FFN slice), the amax is first
all-reduced (MAX) over that group, so each shard quantises with the scale the whole tensor has at
world 1 and layouts equal world 1 to fp32 rounding. The all-reduce is one small collective per cast
on the device (no host synchronisation); dims that are complete on every rank need none.

``Float8Recipe.from_config`` gives the casts of the three operands (input, weight, gradient of the
output) of torchao's recipe (``Float8LinearConfig.from_recipe_name``), with the gradient dtype that
``--fp8-format`` asks for (hybrid: e5m2, e4m3: e4m3).

``scaled_mm`` is ``torch._scaled_mm`` (on CPU torch dequantises and runs an fp32 GEMM: FP8 is emulated
there, bit for bit the quantise-dequantise reference; where torch's CPU kernel takes per-tensor scales
only, as torch 2.11's does, ``scaled_mm`` computes that same dequantised product for row-wise scales).
It writes the caller's dtype; on CUDA it adds
what the FP8 kernels need: row-major / column-major operands, K and N zero-padded to multiples of 16,
and, with row-wise scales, a bf16 output cast to the caller's dtype (torch's row-wise kernel writes
bf16 only: an fp32 model's row-wise GEMM outputs are bf16-rounded on CUDA, not on CPU).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moefold.parallel.groups import Group, group_size
from moefold.precision.fp8 import FP8Backend, FP8Config, FP8Format, import_torchao

if TYPE_CHECKING:
    from types import ModuleType

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast: its float8 dtype, and one scale per tensor or one per row along
    the contraction dim of each GEMM it enters (``rowwise``)."""

    dtype: torch.dtype
    rowwise: bool


@dataclass(frozen=True)
class Float8Recipe:
    """The casts of a linear's three GEMM operands and torchao's GEMM settings for them."""

    input: Cast
    weight: Cast
    grad_output: Cast
    pow2_scales: bool           # scales rounded down to a power of 2 (torchao's rowwise recipe)
    fast_accum_forward: bool    # CUDA: the forward GEMM accumulates in the tensor cores' fast mode

    @classmethod
    def from_config(cls, config: FP8Config) -> Float8Recipe:
        if not config.enabled or config.backend is not FP8Backend.TORCHAO:
            raise ValueError(f"Float8Recipe needs --fp8-backend torchao with a --fp8-format, got {config.describe()}")
        ao = import_torchao()
        c = ao.config.Float8LinearConfig.from_recipe_name(config.recipe.value)   # torchao checks type(name) == str
        axiswise = ao.config.ScalingGranularity.AXISWISE
        grad_dtype = E5M2 if config.format is FP8Format.HYBRID else E4M3

        def cast(cc: Any, dtype: torch.dtype | None = None) -> Cast:
            return Cast(dtype or cc.target_dtype, cc.scaling_granularity is axiswise)

        return cls(input=cast(c.cast_config_input), weight=cast(c.cast_config_weight),
                   grad_output=cast(c.cast_config_grad_output, grad_dtype),
                   pow2_scales=c.round_scales_to_power_of_2,
                   fast_accum_forward=c.gemm_config_output.use_fast_accum)


def _float8_utils() -> ModuleType:
    import_torchao()
    import torchao.float8.float8_utils as utils

    return utils


def reduce_max(a: Tensor, groups: Sequence[Group]) -> Tensor:
    """All-reduce (MAX, in place) ``a`` over each group of ``groups`` (None or size 1: nothing)."""
    for g in groups:
        if group_size(g) > 1:
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=g)
    return a


def amax(t: Tensor, dims: Sequence[int] | None = None, groups: Sequence[Group] = ()) -> Tensor:
    """fp32 ``max |t|`` over ``dims`` (None: all, a 0-d result; else keepdim), all-reduced (MAX) over
    each group of ``groups`` (the groups ``dims`` are sharded over). Empty reductions give 0."""
    if dims is None:
        a = t.abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    elif t.numel():
        a = t.abs().amax(dim=tuple(dims), keepdim=True).float()
    else:
        a = t.new_zeros([1 if (d in dims or d - t.dim() in dims) else n for d, n in enumerate(t.shape)],
                        dtype=torch.float32)
    return reduce_max(a, groups)


def amax_to_scale(amax_: Tensor, dtype: torch.dtype, pow2: bool) -> Tensor:
    """torchao's scale: ``fp8_max / max(amax, 1e-12)`` (fp64, then fp32; ``pow2``: rounded down to 2^n)."""
    return _float8_utils().amax_to_scale(amax_, dtype, round_scales_to_power_of_2=pow2)


def to_float8(t: Tensor, amax_: Tensor, dtype: torch.dtype, pow2: bool) -> tuple[Tensor, Tensor]:
    """``t`` cast with the scale of ``amax_`` (broadcastable to ``t``) -> (float8 data, fp32 inverse scale)."""
    scale = amax_to_scale(amax_, dtype, pow2)
    return _float8_utils().to_fp8_saturated(t.float() * scale, dtype), scale.reciprocal()


def quantize(t: Tensor, dtype: torch.dtype, dims: Sequence[int] | None = None, pow2: bool = False,
             groups: Sequence[Group] = ()) -> tuple[Tensor, Tensor]:
    """Scale over ``dims`` (None: the whole tensor) reduced over ``groups``; -> (data, inverse scale)."""
    return to_float8(t, amax(t, dims, groups), dtype, pow2)


def dequantize(data: Tensor, inv_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values an FP8 GEMM multiplies: ``data.float() * inv_scale`` (in ``dtype``)."""
    return (data.float() * inv_scale).to(dtype)


def _pad(t: Tensor, dim: int, multiple: int, value: float = 0.0) -> Tensor:
    pad = (-t.shape[dim]) % multiple
    if pad == 0:
        return t
    spec = [0, 0] * (t.dim() - 1 - dim) + [0, pad]
    return F.pad(t, spec, value=value) if t.dtype.itemsize > 1 else F.pad(t.view(torch.uint8), spec).view(t.dtype)


def _row_major(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 and t.stride(0) >= max(1, t.shape[1]) else t.contiguous()


def _col_major(t: Tensor) -> Tensor:
    return t if t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0]) else t.t().contiguous().t()


def scaled_mm(a: Tensor, inv_a: Tensor, b: Tensor, inv_b: Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> Tensor:
    """``(a * inv_a) @ (b * inv_b)`` for float8 ``a [M, K]``, ``b [K, N]`` through ``torch._scaled_mm``.

    ``inv_a``/``inv_b``: 0-d (tensorwise) or ``[M, 1]`` / ``[1, N]`` (row-wise) fp32 inverse scales.
    The result is ``out_dtype`` (computed as bf16 for row-wise scales on CUDA, the kernel's only output).
    """
    rowwise = inv_a.dim() > 0
    mm_dtype = torch.bfloat16 if rowwise and a.device.type != "cpu" else out_dtype
    N = b.shape[1]
    if a.device.type != "cpu":
        # torch's CUDA FP8 kernels: K and N multiples of 16 (zero padding is exact), a row-major, b column-major
        a, b = _pad(a, 1, 16), _pad(_pad(b, 0, 16), 1, 16)
        if rowwise and b.shape[1] != N:
            inv_b = _pad(inv_b, 1, 16, value=1.0)
        a, b = _row_major(a), _col_major(b)
    if rowwise:  # [M, 1] / [1, N] with unit last-dim strides (a transposed [1, M] view has stride M)
        inv_a, inv_b = inv_a.flatten().contiguous()[:, None], inv_b.flatten().contiguous()[None, :]
    if rowwise and a.device.type == "cpu" and not _cpu_kernel_takes_row_scales():
        out = (a.float() * inv_a) @ (b.float() * inv_b)  # what torch's CPU kernel computes where it has them
    else:
        out = torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=mm_dtype, use_fast_accum=fast_accum and a.is_cuda)
    if out.shape[1] != N:
        out = out[:, :N]
    return out.to(out_dtype)


# id(a tensor's base) -> {(what, the view's geometry, version): a cast}, dropped with the base: ``shared_cast``
# (ids, not a WeakKeyDictionary: that compares its keys with ==, elementwise for tensors)
_SHARED_CASTS: dict[int, dict[tuple, Any]] = {}


def shared_cast(x: Tensor, key: tuple, make: Callable[[], tuple]) -> tuple:
    """``make()``, the cast ``key`` of ``x`` (a tuple of tensors or None), made once for every GEMM whose input is
    the same view of the same tensor (q, k and v projections of one norm output; gate and up): they keep one
    quantised copy for backward, as one fused projection would (Megatron's ``linear_qkv``, ``linear_fc1``).
    The cache holds the cast weakly: it is shared while a GEMM keeps it (saved for its backward) and never kept
    alive by the cache (a checkpoint's forward, which saves nothing, makes it again for each GEMM). An in-place
    change of ``x`` (its version) makes a new one. Casts are deterministic: sharing one changes no value."""
    if torch.compiler.is_compiling():
        return make()
    base = x._base if x._base is not None else x
    entry = _SHARED_CASTS.get(id(base))
    if entry is None:
        entry = _SHARED_CASTS[id(base)] = {}
        weakref.finalize(base, _SHARED_CASTS.pop, id(base), None)
    k = (key, tuple(x.shape), x.stride(), x.storage_offset(), base._version)
    held = entry.get(k)
    if held is not None:
        kind, refs = held
        items = [None if r is None else r() for r in refs]
        if all(item is not None for item, r in zip(items, refs) if r is not None):
            return kind(*items) if hasattr(kind, "_fields") else kind(items)
    cast = make()
    entry[k] = (type(cast), [None if t is None else weakref.ref(t) for t in cast])
    return cast


@functools.cache
def _cpu_kernel_takes_row_scales() -> bool:
    """torch's CPU ``_scaled_mm`` accepts row-wise scales (torch 2.11's asserts per-tensor scales)."""
    a = torch.ones(2, 16, dtype=E4M3, device="cpu")   # the CPU kernel, whatever the default device
    try:
        torch._scaled_mm(a, a.t(), torch.ones(2, 1, device="cpu"), torch.ones(1, 2, device="cpu"),
                         out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


__all__ = ["E4M3", "E5M2", "Cast", "Float8Recipe", "amax", "amax_to_scale", "dequantize", "quantize", "reduce_max",
           "scaled_mm", "shared_cast", "to_float8"]
