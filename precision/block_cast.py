"""Block-scaled casts of GEMM operands: DeepSeek-V3's blockwise FP8, MXFP8 and NVFP4, with torchao's numerics.

One scale per block of a 2-D operand ``t [R, C]``; ``block = (br, bc)`` (a ragged last block covers what is
left, as DeepSeek-V3's ``weight_scale_inv`` does for dims that are not multiples of 128). Per format:

- ``blockwise`` (torchao ``blockwise_fp8_training``; its Triton kernels and the torch references in
  ``blockwise_fp8_training/kernels.py``): ``scale = 448 / max(amax, 1e-12)`` in fp64 then fp32 (not rounded
  to a power of 2), ``q = clamp(t * scale, +-448)`` as e4m3, dequantised ``q * (1 / scale)``. Activations
  and gradients in 1x128 tiles along the GEMM's contraction dim, weights in 128x128 blocks.
- ``mxfp8`` (torchao ``mx_formats.mx_tensor.to_mx`` with ``ScaleCalculationMode.RCEIL``): an e8m0 scale
  per 32 elements, computed by torchao's own ``_to_mx_rceil`` from the block amax; dequantised with
  torchao's ``get_fp_scale``. Every operand in 1x32 blocks along its GEMM's contraction dim.
- ``nvfp4`` (torchao ``mx_formats.nvfp4_tensor.nvfp4_quantize``, two-level): an fp32 per-tensor scale
  ``amax / (448 * 6)`` (``per_tensor_amax_to_scale``), an e4m3 scale per block ``(block_amax / 6) /
  tensor_scale``, e2m1 values rounded to nearest even (``f32_to_f4_unpacked``). Activations and gradients
  in 1x16 blocks along the contraction dim, weights in 16x16 blocks (TE's ``NVFP4BlockScaling`` and torchao's
  NVFP4 training both quantise weights in 2-D, so the forward and the backward GEMM see one quantisation).
  TE's recipe also applies a random Hadamard transform to the weight-gradient operands and stochastic
  rounding to gradients; these casts do neither (round to nearest everywhere, deterministic).

Parallelism. An operand may be a shard: its rows split over ``split[0]``, its columns over ``split[1]``
(contiguous shards of equal size). For a split dim of local extent ``n`` over ``w`` ranks:

- ``n * w <= b`` (the whole dim is one block): the block amax is all-reduced (MAX) over the group, so
  every shard quantises with the scale world 1 uses;
- ``n % b == 0``: every block lies inside one shard, which is world 1's block: no communication;
- otherwise blocks would straddle shards: ``check_split`` refuses such a layout for the weights' dims at
  construction; along the token dim (whose length changes per step) each rank's blocks are its own rows'
  (what the GPU kernels compute on each rank).

Grouped GEMMs: ``row_counts`` [e] makes the row blocks restart at each expert's first row (the experts'
token groups; padded to the kernels' multiple with ``--moe-router-padding-for-quantization``).
NVFP4's per-tensor amax (``tensor_amax``) is given by the caller: per tensor for linears, per expert for
the experts, reduced over every group the tensor is split over.

Everything is torch ops on the operand's device; a cast is a handful of elementwise passes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from moefold.parallel.groups import Group, group_size
from moefold.precision.fp8 import FP8Recipe, import_torchao
from moefold.precision.fp8_cast import E4M3, _float8_utils, amax_to_scale, reduce_max

FP4_MAX, E4M3_MAX = 6.0, 448.0


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled recipe: its element dtype (e2m1 is held unpacked as uint8 codes), the block of its
    activations and gradients (``act``, along the contraction dim) and of its weights (``weight``: 2-D
    blocks used by both GEMMs; None: like activations, along each GEMM's contraction dim)."""

    name: FP8Recipe
    elem: torch.dtype
    act: int
    weight: tuple[int, int] | None

    @property
    def two_level(self) -> bool:
        return self.name is FP8Recipe.NVFP4

    def operand_block(self, is_weight: bool, contract: int) -> tuple[int, int]:
        """Block of a 2-D operand contracted over dim ``contract`` (1: its columns, 0: its rows)."""
        if is_weight and self.weight is not None:
            return self.weight
        return (1, self.act) if contract == 1 else (self.act, 1)


FORMATS: dict[FP8Recipe, BlockFormat] = {   # keyed by the recipe (a StrEnum: its word finds it too)
    FP8Recipe.BLOCKWISE: BlockFormat(FP8Recipe.BLOCKWISE, E4M3, 128, (128, 128)),
    FP8Recipe.MXFP8: BlockFormat(FP8Recipe.MXFP8, E4M3, 32, None),
    FP8Recipe.NVFP4: BlockFormat(FP8Recipe.NVFP4, torch.uint8, 16, (16, 16)),
}


class Cast(NamedTuple):
    """A cast operand: ``dq`` the fp32 values the GEMM multiplies; ``data`` the low-precision elements
    (e4m3, or e2m1 codes as uint8); ``scale`` one per block ``[nR, nC]``: fp32 inverse scales (blockwise),
    e8m0 biased exponents as uint8 (mxfp8), e4m3 block scales (nvfp4); ``tensor_scale``: nvfp4's fp32
    per-tensor scale (broadcastable to ``[R, C]``), else None."""

    dq: Tensor
    data: Tensor
    scale: Tensor
    tensor_scale: Tensor | None


def check_split(what: str, n: int, group: Group, block: int) -> None:
    """ValueError when a dim of local extent ``n`` split over ``group`` cuts through blocks of ``block``."""
    w = group_size(group)
    if w > 1 and n * w > block and n % block:
        raise ValueError(f"{what}: {n * w} split over {w} ranks into shards of {n}, which cut through the "
                         f"{block}-element quantisation blocks; use a layout whose shards are multiples of {block}")


def _row_blocks(R: int, br: int, row_counts: Tensor | None, device: torch.device) -> tuple[Tensor | None, int]:
    """(row -> block id [R], number of row blocks); None ids: every row is its own block (``br == 1``)."""
    if br == 1:
        return None, R
    if row_counts is None:
        return torch.arange(R, device=device) // br, -(-R // br)
    e, per = row_counts.shape[0], max(-(-R // br), 1)   # a segment never has more blocks than all rows have
    seg = torch.repeat_interleave(torch.arange(e, device=device), row_counts, output_size=R)
    starts = torch.cumsum(row_counts, 0) - row_counts
    pos = torch.arange(R, device=device) - starts.index_select(0, seg)
    return seg * per + pos // br, e * per


def block_amax(t: Tensor, block: tuple[int, int], split: Sequence[Group] = (None, None),
               row_counts: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """fp32 amax per block of ``t [R, C]`` -> (compact ``[nR, nC]``, row block ids or None); see the module
    docstring for ``split`` and ``row_counts``."""
    R, C = t.shape
    br, bc = block
    nC = -(-C // bc)
    a = t.detach().abs().float()
    if C % bc:
        a = torch.nn.functional.pad(a, (0, nC * bc - C))
    a = a.view(R, nC, bc).amax(dim=2) if bc > 1 else a
    ids, nR = _row_blocks(R, br, row_counts, t.device)
    if ids is not None:
        a = a.new_zeros((nR, nC)).scatter_reduce_(0, ids[:, None].expand(-1, nC), a, "amax")
    for dim, (n, b, g) in enumerate(((R, br, split[0]), (C, bc, split[1]))):
        w = group_size(g)
        if w > 1 and n * w <= b and b > 1:
            a = reduce_max(a.amax(dim=dim, keepdim=True) if a.shape[dim] > 1 else a.contiguous(), (g,))
    return a, ids


def _expand(compact: Tensor, ids: Tensor | None, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """A per-block ``[nR, nC]`` tensor broadcast to every element of ``shape``."""
    R, C = shape
    x = compact
    if x.shape[0] == 1 and R != 1:
        x = x.expand(R, -1)
    elif ids is not None:
        x = x.index_select(0, ids)
    if x.shape[1] == 1 and C != 1:
        return x.expand(-1, C)
    return x.repeat_interleave(block[1], dim=1)[:, :C] if block[1] > 1 else x


@functools.cache
def _mx() -> ModuleType:
    import_torchao()
    import torchao.prototype.mx_formats.mx_tensor as mx

    return mx


@functools.cache
def _fp4() -> ModuleType:
    import_torchao()
    import torchao.prototype.mx_formats.kernels as kernels

    return kernels


def tensor_amax(t: Tensor, groups: Sequence[Group] = ()) -> Tensor:
    """fp32 amax of all of ``t``, all-reduced (MAX) over ``groups`` (NVFP4's per-tensor scale)."""
    a = t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    return reduce_max(a.reshape(1, 1), groups)


def quantize(t: Tensor, fmt: BlockFormat, block: tuple[int, int], split: Sequence[Group] = (None, None),
             row_counts: Tensor | None = None, dtype: torch.dtype | None = None, amax_t: Tensor | None = None) -> Cast:
    """Cast ``t [R, C]`` in ``block``s by ``fmt`` (``dtype``: the FP8 element type, e.g. e5m2 gradients;
    ``amax_t``: nvfp4's per-tensor amax, one value, or one per expert of ``row_counts``; default
    ``tensor_amax(t)``)."""
    amax, ids = block_amax(t, block, split, row_counts)
    x = t.float()
    if fmt.name is FP8Recipe.BLOCKWISE:
        elem = dtype or fmt.elem
        scale = amax_to_scale(amax, elem, False)
        data = _float8_utils().to_fp8_saturated(x * _expand(scale, ids, t.shape, block), elem)
        inv = scale.reciprocal()
        return Cast(data.float() * _expand(inv, ids, t.shape, block), data, inv, None)
    if fmt.name is FP8Recipe.MXFP8:
        mx = _mx()
        elem = dtype or fmt.elem
        max_pos = mx.F8E4M3_MAX if elem == E4M3 else mx.F8E5M2_MAX
        exponent, scaled = mx._to_mx_rceil(x, _expand(amax, ids, t.shape, block), max_pos)
        data = scaled.to(elem)
        e8m0 = _compact_of(exponent, amax.shape, ids, block)
        return Cast(data.float() * mx.get_fp_scale(exponent), data, e8m0, None)
    # nvfp4 (torchao nvfp4_quantize, two-level, with the block amax over ``block``)
    k = _fp4()
    amax_t = tensor_amax(t) if amax_t is None else amax_t
    tscale_c = (amax_t.float() / (E4M3_MAX * FP4_MAX)).reshape(-1, 1)     # per_tensor_amax_to_scale
    if tscale_c.shape[0] > 1:   # one per expert [e]: to each row block of that expert
        e = tscale_c.shape[0]
        if ids is None:
            tscale_c = tscale_c.index_select(0, torch.repeat_interleave(
                torch.arange(e, device=t.device), row_counts, output_size=t.shape[0]))
        else:
            tscale_c = tscale_c.repeat_interleave(amax.shape[0] // e, dim=0)
    block_scale = (amax / FP4_MAX) / tscale_c
    s_e4m3 = torch.clamp(block_scale, min=torch.finfo(E4M3).tiny, max=E4M3_MAX).to(E4M3)
    s32 = s_e4m3.float()
    recip = (1.0 / tscale_c) / s32
    scaled = torch.clamp(x * _expand(recip, ids, t.shape, block), -FP4_MAX, FP4_MAX)
    codes = k.f32_to_f4_unpacked(scaled)
    dq = k.f4_unpacked_to_f32(codes) * _expand(s32 * tscale_c, ids, t.shape, block)
    return Cast(dq, codes, s_e4m3, tscale_c)


def dequantize(fmt: BlockFormat, data: Tensor, scale: Tensor, tensor_scale: Tensor | None, block: tuple[int, int],
               row_counts: Tensor | None = None) -> Tensor:
    """The fp32 values ``quantize(...)`` returned as ``dq``, from its compact ``data``, ``scale`` and ``tensor_scale``
    (what a GEMM keeps for its backward: 1 byte an element and the block scales, not 4 bytes an element); the
    same ``block`` and ``row_counts``. The same products of the same numbers: bit for bit ``quantize``'s ``dq``."""
    shape = tuple(data.shape)
    ids, _ = _row_blocks(shape[0], block[0], row_counts, data.device)
    if fmt.name is FP8Recipe.BLOCKWISE:
        return data.float() * _expand(scale, ids, shape, block)
    if fmt.name is FP8Recipe.MXFP8:
        return data.float() * _mx().get_fp_scale(_expand(scale, ids, shape, block))
    return _fp4().f4_unpacked_to_f32(data) * _expand(scale.float() * tensor_scale, ids, shape, block)


def _compact_of(per_element: Tensor, shape: tuple[int, int], ids: Tensor | None, block: tuple[int, int]) -> Tensor:
    """Back from a per-element copy of a per-block value to ``[nR, nC]`` (first element of each block)."""
    nR = shape[0]
    x = per_element[:, ::block[1]] if block[1] > 1 else per_element
    if ids is None:
        return x if x.shape[0] == nR else x[:1]
    out = x.new_zeros((nR, x.shape[1]))
    return out.index_copy_(0, ids, x)


__all__ = ["FORMATS", "BlockFormat", "Cast", "block_amax", "check_split", "dequantize", "quantize", "tensor_amax"]
