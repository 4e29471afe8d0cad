"""FP8 token dispatch (``--moe-fp8-dispatch``): rows leave as e4m3 with their scales, arrive dequantised.

As DeepEP's FP8 dispatch does, each token row ``[H]`` is cast to ``float8_e4m3fn`` with one fp32
scale per block of 128 channels (``scale = amax(block) / 448``; one block per row when H is not a
multiple of 128). Data and scales travel together, one uint8 row of ``H + 4 * H/128`` bytes, through
the dispatcher's own exchange (all-to-all, chunked all-to-all, all-gather): 0.52x the bytes of bf16
rows, 0.26x of fp32. The receiver dequantises to the sender's dtype. Every row is cast, also those a
rank sends to itself (and with one rank, where nothing travels), so the experts see the same values
at every layout.

Backward is the exchange's adjoint in the activations' dtype (the gradients return in high
precision, as DeepEP's BF16 combine), and the cast counts as the identity (straight-through), as
FP8 casts do throughout training.

The all-to-all exchange (``dispatch.token_exchange.AllToAllExchange`` with ``fp8``) packs, moves and
dequantises the rows (a group of one rank casts them too); the allgather dispatcher's exchange packs the
same quantised rows into its one all-gather of tokens and routing (``dispatch.allgather``).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 128
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def block_size(hidden: int) -> int:
    """Channels per scale: 128 (DeepEP's) when it divides the hidden size, else the whole row."""
    return BLOCK if hidden % BLOCK == 0 else hidden


def row_bytes(hidden: int) -> int:
    """Bytes one dispatched row takes in FP8: the e4m3 data and its fp32 scales."""
    return hidden + 4 * (hidden // block_size(hidden))


def quantize_rows(x_NH: Tensor) -> tuple[Tensor, Tensor]:
    """-> (e4m3 data [N, H], fp32 scales [N, H / block]) with ``x ~ data * scale`` per block."""
    N, H = x_NH.shape
    b = block_size(H)
    blocks = x_NH.float().view(N, H // b, b)
    scale = (blocks.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)
    data = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data.view(N, H), scale


def dequantize_rows(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    N, H = data.shape
    nb = scale.shape[1]
    return (data.float().view(N, nb, H // nb) * scale[..., None]).view(N, H).to(dtype)


def pack(data: Tensor, scale: Tensor) -> Tensor:
    """One uint8 row per token: the data bytes, then the scale bytes."""
    return torch.cat([data.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def unpack(packed: Tensor, hidden: int) -> tuple[Tensor, Tensor]:
    data = packed[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    return data, packed[:, hidden:].contiguous().view(torch.float32)


__all__ = ["BLOCK", "block_size", "dequantize_rows", "pack", "quantize_rows", "row_bytes", "unpack"]
