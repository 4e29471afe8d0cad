"""Rotary position embeddings (RoPE) with configurable theta, and YaRN as DeepSeek-V3 uses it.

The arithmetic follows HF ``transformers`` exactly (``modeling_rope_utils._compute_yarn_parameters``,
``DeepseekV3RotaryEmbedding``, ``rotate_half``/``apply_rotary_pos_emb`` and
``apply_rotary_pos_emb_interleave``, ``yarn_apply_mscale``), so imported checkpoints see the
same rotations. Positions are passed explicitly: under context parallelism a rank holds
non-contiguous chunks of the sequence. Nothing here crosses ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class YarnConfig:
    """YaRN context extension (HF ``rope_parameters`` with ``rope_type="yarn"``).

    ``factor``: context extension factor; ``original_max_position_embeddings``: the pretraining
    context; ``beta_fast``/``beta_slow``: the ramp's rotation bounds; ``mscale``/``mscale_all_dim``:
    DeepSeek's attention-scale terms (cos/sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim); the softmax scale by mscale(factor, mscale_all_dim)^2);
    ``attention_factor`` overrides the cos/sin scaling; ``truncate`` rounds the ramp bounds.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"YarnConfig.factor={self.factor!r} must be > 0")
        if not isinstance(self.original_max_position_embeddings, int) or self.original_max_position_embeddings < 1:
            raise ValueError(f"YarnConfig.original_max_position_embeddings={self.original_max_position_embeddings!r} "
                             "must be a positive integer")
        if not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(f"YarnConfig beta_fast={self.beta_fast}, beta_slow={self.beta_slow} must be > 0")


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(yarn: YarnConfig) -> float:
    """The factor cos/sin are multiplied by (HF ``attention_scaling``)."""
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return float(_yarn_get_mscale(yarn.factor, yarn.mscale) / _yarn_get_mscale(yarn.factor, yarn.mscale_all_dim))
    return float(_yarn_get_mscale(yarn.factor))


def yarn_softmax_mscale(yarn: YarnConfig | None) -> float:
    """Multiplier of the attention softmax scale (HF ``yarn_apply_mscale`` in DeepseekV3Attention):
    ``mscale(factor, mscale_all_dim)^2``, or 1 without YaRN or without ``mscale_all_dim``."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    m = _yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
    return m * m


def _default_inv_freq(dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _yarn_inv_freq(dim: int, theta: float, yarn: YarnConfig, device: torch.device | str | None = None) -> Tensor:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (yarn.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given positions.

    forward(position_ids [S] int64) -> (cos [S, dim], sin [S, dim]) in fp32, laid out
    ``cat(freqs, freqs)`` as HF does and already multiplied by YaRN's attention factor.
    ``inv_freq`` [dim / 2] fp32 (a non-persistent buffer) is computed on ``device`` (None: the default device),
    as HF computes it on the device it builds on.
    """

    def __init__(self, dim: int, theta: float = 10000.0, yarn: YarnConfig | None = None, *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 2 or dim % 2 != 0:
            raise ValueError(f"RotaryEmbedding dim={dim!r} must be a positive even integer")
        if not theta > 1:
            raise ValueError(f"RotaryEmbedding theta={theta!r} must be > 1")
        self.dim, self.theta, self.yarn = dim, float(theta), yarn
        inv_freq = _default_inv_freq(dim, theta, device) if yarn is None else _yarn_inv_freq(dim, theta, yarn, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0 if yarn is None else yarn_attention_factor(yarn)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=position_ids.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, yarn={self.yarn}"


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate ``x [S, B, heads, dim]`` by ``cos/sin [S, dim]`` (from ``RotaryEmbedding``), or ``[S, B, dim]``: each
    sample's own positions (documents whose positions restart, ``dense.documents``).

    ``interleaved=False``: HF ``rotate_half`` convention (pairs (i, i + dim/2)).
    ``interleaved=True``: HF ``apply_rotary_pos_emb_interleave`` (DeepSeek's ``rope_interleave``):
    pairs (2i, 2i+1), returned de-interleaved as ``cat(even', odd')`` like HF does.
    cos/sin are cast to ``x.dtype`` first, as HF does.
    """
    shapes = ((x.shape[0], x.shape[-1]), (x.shape[0], x.shape[1], x.shape[-1])) if x.dim() == 4 else ()
    if cos.shape not in shapes or sin.shape != cos.shape:
        raise ValueError(f"apply_rotary: expected x [S, B, heads, dim] and cos/sin [S, dim] or [S, B, dim], got x "
                         f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    per_sample = cos.dim() == 3
    cos = cos.to(x.dtype)[:, :, None, :] if per_sample else cos.to(x.dtype)[:, None, None, :]
    sin = sin.to(x.dtype)[:, :, None, :] if per_sample else sin.to(x.dtype)[:, None, None, :]
    if not interleaved:
        return x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``apply_rotary`` on the first ``cos.shape[-1]`` dims of each head of ``x [S, B, heads, dim]``, the
    rest passed through (HF's partial rotary, ``partial_rotary_factor``: GLM-4.5, MiniMax-M2)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
