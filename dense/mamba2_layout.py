"""The Mamba-2 mixer's tensor-parallel row order: its fused tensors group-major, so that a tp shard is whole groups.

HF and ``mamba_ssm`` store ``in_proj`` part-major, ``[z | x | B | C | dt]`` (each part over all heads or groups),
and the convolution's channels ``[x | B | C]``. A contiguous block of those rows is not a set of whole heads, so
moefold stores them group-major: for each of the ``g`` B/C groups, that group's rows of every part in turn
(``[z_g | x_g | B_g | C_g | dt_g]``, ``[x_g | B_g | C_g]``), heads ``g r .. g r + r - 1`` (``r = heads / g``).
The order does not depend on the layout; a tp rank's ``1/tp`` block (``ColumnParallelLinear``'s ``Shard(0)``) is
then groups ``g/tp`` whole, and every per-head and per-group tensor (``dt_bias``, ``A_log``, ``D``, the gated
norm's weight) is already head-ordered. ``GroupMajor`` converts full tensors both ways (checkpoint import and
export, ``models.hf.nemotron_h``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class GroupMajor:
    """Rows ``[g * sum(widths), ...]`` group-major (moefold) <-> part-major (HF): ``widths`` are one group's rows
    of each part."""

    groups: int
    widths: tuple[int, ...]

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def to_hf(self, full: Tensor) -> Tensor:
        parts = full.reshape(self.groups, sum(self.widths), *full.shape[1:]).split(list(self.widths), dim=1)
        return _cat([p.reshape(-1, *full.shape[1:]) for p in parts]).contiguous()

    def from_hf(self, hf: Tensor, shape: tuple[int, ...]) -> Tensor:
        parts = hf.split([self.groups * w for w in self.widths], dim=0)
        per_group = [p.reshape(self.groups, w, *hf.shape[1:]) for p, w in zip(parts, self.widths)]
        return _cat(per_group, dim=1).reshape(shape).contiguous()


def _cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    import torch

    return torch.cat(tensors, dim=dim)


def in_proj_layout(num_heads: int, head_dim: int, state_size: int, num_groups: int) -> GroupMajor:
    """``in_proj``'s rows: per group z (r p), x (r p), B (n), C (n), dt (r)."""
    r = num_heads // num_groups
    return GroupMajor(num_groups, (r * head_dim, r * head_dim, state_size, state_size, r))


def conv_layout(num_heads: int, head_dim: int, state_size: int, num_groups: int) -> GroupMajor:
    """The convolution's channels: per group x (r p), B (n), C (n)."""
    r = num_heads // num_groups
    return GroupMajor(num_groups, (r * head_dim, state_size, state_size))
