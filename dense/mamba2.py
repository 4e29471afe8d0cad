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
``out_proj``. Activations are ``[S, B, H]`` (moefold's sequence-first layout). Tensor and context parallelism
of this mixer and its decoding cache are not built: the module runs at tp = cp = 1 only
and takes no process group (``models.layer_factory.check_layout`` refuses other layouts); in a decoder it sits in
the block's token-mixer slot, ``forward(x, position_ids)`` (a state-space scan reads no positions). ``backend``
``mamba_ssm`` runs the convolution and the scan in ``causal_conv1d`` / ``mamba_ssm``'s CUDA kernels
(``dense.mamba2_kernels``), the rest (projections, gated norm) as here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.mamba2_kernels import (
    MambaBackend,
    check_kernel_inputs,
    kernel_conv,
    kernel_scan,
    require_mamba_ssm,
)
from moefold.dense.ssd_scan import ssd_chunk_scan
from moefold.parallel.sharding import normal_init, set_init


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

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size


class Mamba2Mixer(nn.Module):
    """``forward(x [S, B, H]) -> [S, B, H]`` (module docstring); ``dtype`` / ``device``: where its weights are made
    (A_log stays fp32)."""

    def __init__(self, config: Mamba2Config, *, init_std: float = 0.02, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        kw = {"dtype": dtype, "device": device}
        self.in_proj = nn.Linear(c.hidden_size, c.inner_size + c.conv_channels + c.num_heads, bias=c.proj_bias, **kw)
        self.conv1d = nn.Conv1d(c.conv_channels, c.conv_channels, c.conv_kernel, groups=c.conv_channels,
                                padding=c.conv_kernel - 1, bias=c.conv_bias, **kw)
        # Mamba-2's initialisation (transformers' and mamba_ssm's): A = 1 .. heads, D = 1, dt_bias = 1
        self.dt_bias = nn.Parameter(torch.ones(c.num_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, c.num_heads + 1, dtype=torch.float32, device=device)))
        self.D = nn.Parameter(torch.ones(c.num_heads, **kw))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(c.inner_size, **kw))
        self.out_proj = nn.Linear(c.inner_size, c.hidden_size, bias=c.proj_bias, **kw)
        # layout-independent init (parallel.sharding.init_parameters): the projections and the convolution drawn
        # normal, biases zero; A_log, D and dt_bias keep Mamba-2's constructor values
        for lin in (self.in_proj, self.out_proj, self.conv1d):
            set_init(lin.weight, normal_init(init_std))
            if lin.bias is not None:
                set_init(lin.bias, _zeros)

    def _gated_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """RMSNorm over each group of ``inner_size / groups`` channels of ``y * silu(z)`` (fp32), then the weight."""
        c = self.config
        h = (y.float() * F.silu(z.float())).unflatten(-1, (c.num_groups, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        return self.norm.weight * h.flatten(-2).to(y.dtype)

    def forward(self, x_SBH: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """``position_ids``: the block's token-mixer call passes them; the scan reads none."""
        c = self.config
        S = x_SBH.shape[0]
        x = x_SBH.transpose(0, 1)                                                 # [B, S, H]
        z, xbc, dt = self.in_proj(x).split([c.inner_size, c.conv_channels, c.num_heads], dim=-1)
        if c.backend is MambaBackend.MAMBA_SSM:
            return self._kernel_forward(x, z, xbc, dt).transpose(0, 1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :S].transpose(1, 2))
        xs, Bs, Cs = xbc.split([c.inner_size, c.num_groups * c.state_size, c.num_groups * c.state_size], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*c.time_step_limit)
        y, _ = ssd_chunk_scan(xs.unflatten(-1, (c.num_heads, c.head_dim)), dt, -torch.exp(self.A_log.float()),
                              Bs.unflatten(-1, (c.num_groups, c.state_size)),
                              Cs.unflatten(-1, (c.num_groups, c.state_size)), c.chunk_size, D=self.D)
        out = self.out_proj(self._gated_norm(y.flatten(-2), z).to(x.dtype))
        return out.transpose(0, 1)

    def _split_heads(self, xbc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, h, p], B and C [B, S, g, n] of the convolution's channels."""
        c = self.config
        xs, Bs, Cs = xbc.split([c.inner_size, c.num_groups * c.state_size, c.num_groups * c.state_size], dim=-1)
        return (xs.unflatten(-1, (c.num_heads, c.head_dim)), Bs.unflatten(-1, (c.num_groups, c.state_size)),
                Cs.unflatten(-1, (c.num_groups, c.state_size)))

    def _kernel_forward(self, x: Tensor, z: Tensor, xbc: Tensor, dt: Tensor) -> Tensor:
        """The ``mamba_ssm`` backend from the input projection's parts: [B, S, H] out. The inputs are checked
        against what the kernels refuse before either runs."""
        c = self.config
        A = -torch.exp(self.A_log.float())
        check_kernel_inputs(*self._split_heads(xbc)[:1], dt, A, *self._split_heads(xbc)[1:], self.conv1d.weight)
        xs, Bs, Cs = self._split_heads(kernel_conv(xbc, self.conv1d.weight, self.conv1d.bias))
        y = kernel_scan(xs, dt, A, Bs, Cs, c.chunk_size, self.D, self.dt_bias, tuple(c.time_step_limit))
        return self.out_proj(self._gated_norm(y.flatten(-2), z).to(x.dtype))
