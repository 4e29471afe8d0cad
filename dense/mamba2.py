"""Mamba-2 mixer (the ``mamba`` layers of Nemotron-H), world 1, in plain torch.

transformers 5.25's ``NemotronHMamba2Mixer`` semantics, per token (``d = heads * head_dim``, ``g`` groups of
B and C with state size ``n``)::

    z, xBC, dt = in_proj(x)                         (widths d, d + 2 g n, heads)
    xBC        = silu(causal_depthwise_conv(xBC))   (kernel ``conv_kernel``, with a bias when ``conv_bias``)
    x, B, C    = xBC                                (widths d, g n, g n)
    dt         = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    y          = ssd(x, dt, A, B, C) + D x          (``dense.ssd_scan``: chunked, fp32)
    out        = out_proj(group_rms_norm(y * silu(z)) * norm.weight)   (the norm over each of the g groups)

Parameter names are HF's under ``mixer.``: ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``,
``out_proj``, with ``in_proj``'s rows and the convolution's channels group-major (``dense.mamba2_layout``: what a
tensor-parallel shard of whole groups needs). Activations are ``[S, B, H]`` (moefold's sequence-first layout).
Context parallelism (the SSM state and the convolution's last ``k - 1`` tokens handed from one sequence chunk to
the next) and a decoding cache are not built: ``models.layer_factory.check_layout`` refuses cp > 1. In a decoder it
sits in the block's token-mixer slot, ``forward(x, position_ids)`` (a state-space scan reads no positions). ``backend``
``mamba_ssm`` runs the convolution and the scan in ``causal_conv1d`` / ``mamba_ssm``'s CUDA kernels
(``dense.mamba2_kernels``), the rest (projections, gated norm) as here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.gated_deltanet import heads_to_sequence, sequence_to_heads
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.mamba2_kernels import (
    MambaBackend,
    check_kernel_inputs,
    kernel_conv,
    kernel_scan,
    require_mamba_ssm,
)
from moefold.dense.mamba2_layout import in_proj_layout
from moefold.dense.ssd_scan import ssd_chunk_scan
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import Shard, mark_sharded, normal_init, set_init


def _zeros(t: Tensor, gen: torch.Generator) -> None:
    t.zero_()


@dataclass(frozen=True)
class Mamba2Config:
    """Sizes of one Mamba-2 mixer (HF ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``,
    ``conv_kernel``, ``use_conv_bias``, ``mamba_proj_bias`` / ``use_bias``, ``chunk_size``, ``time_step_limit``,
    ``layer_norm_epsilon``)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int = 1
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 128
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    norm_eps: float = 1e-5
    backend: MambaBackend = MambaBackend.TORCH

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", MambaBackend(self.backend))
        if self.backend is MambaBackend.MAMBA_SSM:
            require_mamba_ssm()
        for name in ("hidden_size", "num_heads", "head_dim", "state_size", "num_groups", "conv_kernel",
                     "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Mamba2Config.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_groups:
            raise ValueError(f"Mamba2Config: num_heads={self.num_heads} is not a multiple of "
                             f"num_groups={self.num_groups}")
        low, high = self.time_step_limit
        if not 0.0 <= low <= high:
            raise ValueError(f"Mamba2Config.time_step_limit={self.time_step_limit!r} must be (low, high) with "
                             "0 <= low <= high")
        if not self.norm_eps > 0:
            raise ValueError(f"Mamba2Config.norm_eps={self.norm_eps!r} must be > 0")

    def check_parallel(self, tp: int, cp: int = 1) -> None:
        """Tensor parallelism splits whole B/C groups (and their heads), context parallelism a tp rank's groups."""
        if self.num_groups % tp:
            raise ValueError(f"Mamba2Config: num_groups={self.num_groups} (n_groups) is not divisible by tp={tp}")
        if (self.num_groups // tp) % cp:
            raise ValueError(f"Mamba-2 under context parallelism runs each cp rank on the whole sequence for 1/cp of "
                             f"its B/C groups: num_groups={self.num_groups} / tp={tp} is not divisible by cp={cp}")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size


class Mamba2Mixer(nn.Module):
    """``forward(x [S, B, H]) -> [S, B, H]`` (module docstring; under ``sequence_parallel`` ``[S/tp, B, H]`` in and
    out); ``dtype`` / ``device``: where its weights are made (A_log stays fp32).

    Tensor parallelism splits the B/C groups (and their heads) over ``tp_group``: ``in_proj`` column-parallel and
    ``out_proj`` row-parallel, ``in_proj`` and the convolution in the group-major row order of
    ``dense.mamba2_layout`` (a rank's block is whole groups), the per-head tensors and the gated norm's weight
    split along their one dim. Crosses ranks: the input's all-gather (SP) or region entry, the output's
    reduce-scatter (SP) or all-reduce; the scan and the norm are per group, local."""

    def __init__(self, config: Mamba2Config, tp_group: Group = None, cp_group: Group = None, *,
                 sequence_parallel: bool = False, init_std: float = 0.02, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        c = config
        tp, rank = group_size(tp_group), group_rank(tp_group)
        self.cp_group, self.cp, self.cp_rank = cp_group, group_size(cp_group), group_rank(cp_group)
        c.check_parallel(tp, self.cp)
        self.config, self.tp_group, self.sequence_parallel = c, tp_group, sequence_parallel
        self.local_groups, self.local_heads = c.num_groups // tp, c.num_heads // tp
        # under cp this rank scans 1/cp of its groups over the whole sequence: their heads, channels and weights
        self.scan_groups, self.scan_heads = self.local_groups // self.cp, self.local_heads // self.cp
        r, width = c.num_heads // c.num_groups, c.conv_channels // c.num_groups
        g0 = self.cp_rank * self.scan_groups
        self._heads = slice(g0 * r, (g0 + self.scan_groups) * r)
        self._channels = slice(g0 * width, (g0 + self.scan_groups) * width)
        kw = {"dtype": dtype, "device": device}
        rows = in_proj_layout(c.num_heads, c.head_dim, c.state_size, c.num_groups)
        self.in_proj = ColumnParallelLinear(c.hidden_size, c.num_groups * sum(rows.widths), tp_group,
                                            bias=c.proj_bias, sequence_parallel=sequence_parallel,
                                            init_std=init_std, **kw)
        channels = c.conv_channels // tp
        self.conv1d = nn.Conv1d(channels, channels, c.conv_kernel, groups=channels, padding=c.conv_kernel - 1,
                                bias=c.conv_bias, **kw)
        # Mamba-2's initialisation (transformers' and mamba_ssm's): A = 1 .. heads, D = 1, dt_bias = 1
        heads = torch.arange(rank * self.local_heads + 1, (rank + 1) * self.local_heads + 1, dtype=torch.float32,
                             device=device)
        self.dt_bias = nn.Parameter(torch.ones(self.local_heads, **kw))
        self.A_log = nn.Parameter(torch.log(heads))
        self.D = nn.Parameter(torch.ones(self.local_heads, **kw))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.local_heads * c.head_dim, **kw))
        self.out_proj = RowParallelLinear(c.inner_size, c.hidden_size, tp_group, bias=c.proj_bias,
                                          sequence_parallel=sequence_parallel, init_std=init_std, **kw)
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            if p is not None:
                mark_sharded(p, Shard.over(tp_group, 0))
        # layout-independent init (parallel.sharding.init_parameters): the convolution drawn normal, its bias zero;
        # A_log, D and dt_bias keep Mamba-2's constructor values (the projections' init is their layers')
        set_init(self.conv1d.weight, normal_init(init_std))
        if self.conv1d.bias is not None:
            set_init(self.conv1d.bias, _zeros)

    def _gated_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """RMSNorm over each group of ``inner_size / groups`` channels of ``y * silu(z)`` (fp32), then the weight."""
        h = (y.float() * F.silu(z.float())).unflatten(-1, (self.scan_groups, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        p = self.config.head_dim
        return self.norm.weight[self._heads.start * p:self._heads.stop * p] * h.flatten(-2).to(y.dtype)

    def _parts(self, x_SBH: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """in_proj's z [B, S, h p], the convolution's input [B, S, c] (group-major) and dt [B, S, h], for the groups
        this rank scans (under cp: the whole sequence, ``1/cp`` of its groups, one all-to-all)."""
        c = self.config
        r = c.num_heads // c.num_groups
        h = self.in_proj(x_SBH).unflatten(-1, (self.local_groups, -1))
        if self.cp > 1:
            h = heads_to_sequence(h, self.cp_group)
        h = h.transpose(0, 1)
        z, xs, Bs, Cs, dt = h.split([r * c.head_dim, r * c.head_dim, c.state_size, c.state_size, r], dim=-1)
        return z.flatten(-2), torch.cat([xs, Bs, Cs], dim=-1).flatten(-2), dt.flatten(-2)

    def _split_heads(self, xbc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, h, p], B and C [B, S, g, n] of the convolution's (group-major) channels."""
        c = self.config
        r = c.num_heads // c.num_groups
        xs, Bs, Cs = xbc.unflatten(-1, (self.scan_groups, -1)).split([r * c.head_dim, c.state_size, c.state_size],
                                                                      dim=-1)
        return xs.reshape(*xs.shape[:2], self.scan_heads, c.head_dim), Bs, Cs

    def _conv_weights(self) -> tuple[Tensor, Tensor | None]:
        """The convolution's weight and bias of the channels this rank scans."""
        bias = self.conv1d.bias
        return self.conv1d.weight[self._channels], None if bias is None else bias[self._channels]

    def forward(self, x_SBH: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """``position_ids``: the block's token-mixer call passes them; the scan reads none."""
        c = self.config
        z, xbc, dt = self._parts(x_SBH)
        if c.backend is MambaBackend.MAMBA_SSM:
            y = self._kernel_scan(xbc, dt)
        else:
            S = xbc.shape[1]
            weight, bias = self._conv_weights()
            xbc = F.silu(F.conv1d(xbc.transpose(1, 2), weight, bias, padding=c.conv_kernel - 1,
                                  groups=weight.shape[0])[..., :S].transpose(1, 2))
            dt = F.softplus(dt.float() + self.dt_bias[self._heads].float()).clamp(*c.time_step_limit)
            xs, Bs, Cs = self._split_heads(xbc)
            y, _ = ssd_chunk_scan(xs, dt, -torch.exp(self.A_log[self._heads].float()), Bs, Cs, c.chunk_size,
                                  D=self.D[self._heads])
        out = self._gated_norm(y.flatten(-2), z).to(x_SBH.dtype).transpose(0, 1)   # [S, B, scanned heads p]
        if self.cp > 1:   # back to this rank's tokens, every group of its tp rank
            out = sequence_to_heads(out.unflatten(-1, (self.scan_groups, -1)), self.cp_group).flatten(-2)
        return self.out_proj(out)

    def _kernel_scan(self, xbc: Tensor, dt: Tensor) -> Tensor:
        """The ``mamba_ssm`` backend's convolution and scan: y [B, S, h, p]. The inputs are checked against what
        the kernels refuse before either runs."""
        c = self.config
        A = -torch.exp(self.A_log[self._heads].float())
        weight, bias = self._conv_weights()
        xs, Bs, Cs = self._split_heads(xbc)
        check_kernel_inputs(xs, dt, A, Bs, Cs, weight)
        xs, Bs, Cs = self._split_heads(kernel_conv(xbc, weight, bias))
        return kernel_scan(xs, dt, A, Bs, Cs, c.chunk_size, self.D[self._heads], self.dt_bias[self._heads],
                           tuple(c.time_step_limit))
