"""DeepSeek-V4's published storage: FP4 (e2m1) routed experts and UE8M0 (power-of-two) block scales.

On disk (``deepseek-ai/DeepSeek-V4-Flash``; V4.1 moves ``expert_dtype`` into ``quantization_config``)::

    config.json:  "expert_dtype": "fp4",
                  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    layers.L.ffn.experts.E.w1.weight  int8 (or float4_e2m1fn_x2, safetensors "F4") [N, K / 2]: two e2m1 values per
                                      byte along K, element 2j in the low nibble, 2j+1 in the high one
    layers.L.ffn.experts.E.w1.scale   float8_e8m0fnu [N, K / 32]: one power of two per row and 32 values along K
    layers.L.attn.wq_a.weight         float8_e4m3fn [N, K]
    layers.L.attn.wq_a.scale          float8_e8m0fnu [ceil(N / 128), ceil(K / 128)]

The value is ``E2M1[nibble] * scale`` in fp32: exactly what transformers 5.25's ``Fp8Dequantize._dequantize_one``
computes (its ``_FP4_E2M1_LUT``, low nibble first, ``scale.to(float32)``; a ``uint8`` scale byte ``b`` is ``2 **
(b - 127)``), so a dequantised tensor is bit for bit transformers' fp32 one. DeepSeek's own ``model.py`` declares the
same layout (weight ``[out, in // 2]`` float4_e2m1fn_x2, scale ``[out, in // 32]`` float8_e8m0fnu).

Writing (``convert --to hf --hf-fp8`` of a DeepSeek-V4 model): ``quantize_fp4`` takes per row and 32 values the scale
``2 ** ceil(log2(amax / 6))`` (the smallest power of two putting the block's largest |w| within e2m1's 6) and rounds
``w / scale`` to the nearest e2m1 value (ties to the even code, as a float cast does); ``ue8m0_scale`` is the FP8
blocks' counterpart (``2 ** ceil(log2(amax / 448))``, transformers' ``Fp8Quantize`` with ``scale_fmt="ue8m0"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

E8M0 = torch.float8_e8m0fnu
# the 16 e2m1 codes' values (sign bit 3), transformers' _FP4_E2M1_LUT (code 8 is -0.0)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0
FP4_BLOCK = 32            # values along K per scale (one scale row per weight row)
PACKED_DTYPES = ("I8", "F4")   # safetensors' names of the dtypes a packed FP4 weight is stored in
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")


def scale_to_fp32(s: Tensor) -> Tensor:
    """A stored block scale as fp32: ``uint8`` bytes are UE8M0 exponents (``2 ** (b - 127)``), every other dtype
    (fp32, float8_e8m0fnu, ...) converts by value, as transformers' dequantiser does."""
    return (s.to(torch.float32) - 127.0).exp2() if s.dtype == torch.uint8 else s.to(torch.float32)


def unpack_fp4(packed: Tensor) -> Tensor:
    """``[..., K / 2]`` bytes (int8 / uint8 / float4_e2m1fn_x2) -> ``[..., K]`` fp32 e2m1 values, low nibble first."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    u8 = packed.contiguous().view(torch.uint8)
    return torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)


def dequantize_fp4(packed: Tensor, scale: Tensor, k_start: int = 0, k_len: int | None = None) -> Tensor:
    """fp32 values of logical columns ``[k_start, k_start + k_len)`` of a packed FP4 weight, given the packed bytes
    ``packed`` of columns ``[k_start // 2 * 2, ...)`` and the scales ``scale`` of blocks ``[k_start // 32, ...)``
    (what ``fp4_read_boxes`` reads). Leading dims pass through."""
    values = unpack_fp4(packed)
    k_len = values.shape[-1] - k_start % 2 if k_len is None else k_len
    values = values.narrow(-1, k_start % 2, k_len)
    s = scale_to_fp32(scale).repeat_interleave(FP4_BLOCK, dim=-1).narrow(-1, k_start % FP4_BLOCK, k_len)
    return values * s


def fp4_read_boxes(box: tuple[slice, ...], K: int) -> tuple[tuple[slice, ...], tuple[slice, ...], int, int]:
    """(packed box, scale box, k_start, k_len) for the logical ``box`` (one slice per dim, last over ``K``)."""
    k = box[-1]
    k0, k1 = k.start or 0, K if k.stop is None else k.stop
    packed = (*box[:-1], slice(k0 // 2, -(-k1 // 2)))
    scales = (*box[:-1], slice(k0 // FP4_BLOCK, -(-k1 // FP4_BLOCK)))
    return packed, scales, k0, k1 - k0


def check_fp4_shapes(name: str, packed_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    """One-line ValueError unless ``scale_shape`` is ``[..., N, K / 32]`` for packed ``[..., N, K / 2]``."""
    K = 2 * packed_shape[-1]
    want = (*packed_shape[:-1], K // FP4_BLOCK)
    if K % FP4_BLOCK or tuple(scale_shape) != want:
        raise ValueError(f"{name}: packed FP4 weight {list(packed_shape)} (K={K}) needs a scale of shape {list(want)}"
                         f" (one per row and {FP4_BLOCK} values, K a multiple of {FP4_BLOCK}); it has "
                         f"{list(scale_shape)}")


def _pow2_ceil(x: Tensor) -> Tensor:
    return torch.pow(2.0, torch.ceil(torch.log2(x.clamp(min=torch.finfo(torch.float32).tiny))))


def ue8m0_scale(amax: Tensor, top: float) -> Tensor:
    """The power-of-two scale (fp32) putting ``amax`` within ``top``: ``2 ** ceil(log2(amax / top))``; an all-zero
    block gets 1."""
    return torch.where(amax > 0, _pow2_ceil(amax.float() / top), torch.ones_like(amax, dtype=torch.float32))


def quantize_fp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 packed ``[..., N, K / 2]``, float8_e8m0fnu scale ``[..., N, K / 32]``) of ``w [..., N, K]``."""
    *lead, N, K = w.shape
    if K % FP4_BLOCK:
        raise ValueError(f"FP4 needs K a multiple of {FP4_BLOCK}; the weight is {list(w.shape)}")
    blocks = w.float().reshape(*lead, N, K // FP4_BLOCK, FP4_BLOCK)
    scale = ue8m0_scale(blocks.abs().amax(-1), FP4_MAX)
    x = (blocks / scale.unsqueeze(-1)).reshape(*lead, N, K)
    grid = torch.tensor(E2M1[:8], dtype=torch.float32)
    mag = x.abs().clamp(max=FP4_MAX)
    # nearest of the 8 magnitudes; bucketize puts a midpoint in the lower code, a tie goes to the even one
    mid = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(mag, mid, right=False)
    tie = (code % 2 == 1) & (code < 7) & (mag == mid[code.clamp(max=6)])
    code = torch.where(tie, code + 1, code)
    code = code + 8 * torch.signbit(x).long()   # the sign bit: a negative value rounding to zero is -0.0
    u8 = code.to(torch.uint8).reshape(*lead, N, K // 2, 2)
    packed = (u8[..., 0] | (u8[..., 1] << 4)).view(torch.int8)
    return packed, scale.to(E8M0)


__all__ = ["E2M1", "E8M0", "FP4_BLOCK", "FP4_MAX", "PACKED_DTYPES", "SCALE_DTYPES", "check_fp4_shapes",
           "dequantize_fp4", "fp4_read_boxes", "quantize_fp4", "scale_to_fp32", "ue8m0_scale", "unpack_fp4"]
