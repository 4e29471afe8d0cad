"""Manifold-constrained hyper-connections (mHC; Xie et al., 2026; DeepSeek-V4 section 2.2).

The residual is ``N = n_hc`` parallel streams ``[S, B, N, H]`` instead of one ``[S, B, H]``. Around each
sub-layer f (the attention, the FFN) a ``HyperConnection`` computes, per token and from all N streams
(flattened to N*H, RMS-normalised without weight, one linear map ``fn`` [(2+N)N, N*H] plus ``base`` and three
scales):

    pre  [N]    = sigmoid(a_pre * s0 + b_pre) + eps          collapses the streams into f's input
    post [N]    = 2 * sigmoid(a_post * s1 + b_post)          expands f's output back onto the streams
    comb [N, N] = SinkhornKnopp(softmax(a_comb * s2 + b_comb) + eps)   mixes the streams (doubly stochastic)

    streams' = post (x) f(sum_j pre_j * streams_j) + comb^T @ streams

Sinkhorn-Knopp alternately normalises comb's columns and rows (``sinkhorn_iters`` column passes in all), so the
residual map stays on the manifold of doubly stochastic matrices and signal does not grow with depth. The
model's end collapses the streams once more (``HyperHead``: a ``pre`` from its own ``fn`` [N, N*H]).
``expand_streams`` makes the N streams from the embedding (N copies).

The math is transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``: the coefficients in fp32
(parameters fp32 whatever the model dtype), the collapsed input and the mixed streams in the activations' dtype.
Everything is per token, so nothing crosses ranks: under sequence or context parallelism each rank mixes its own
tokens, and the parameters, replicated, are marked sequence-parallel (partial gradients summed over tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from moefold.parallel.sharding import mark_sequence_parallel, normal_init, set_init


@dataclass(frozen=True)
class HyperConfig:
    """A block's mHC: ``n_hc`` streams (HF ``hc_mult``), ``sinkhorn_iters`` (``hc_sinkhorn_iters``), ``eps``
    (``hc_eps``), the coefficient maps' normal ``init_std`` (HF ``initializer_range``)."""

    n_hc: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("n_hc", "sinkhorn_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HyperConfig: {name}={value!r} must be a positive integer")
        if not self.eps >= 0 or not self.init_std > 0:
            raise ValueError(f"HyperConfig: eps={self.eps!r} must be >= 0 and init_std={self.init_std!r} > 0")


def expand_streams(x_SBH: Tensor, n_hc: int) -> Tensor:
    """``[S, B, H]`` -> ``[S, B, N, H]``: N copies of the embedding (the residual streams' start)."""
    return x_SBH.unsqueeze(-2).expand(*x_SBH.shape[:-1], n_hc, x_SBH.shape[-1]).contiguous()


def _unweighted_rms(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, in fp32 (x is fp32 here)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _check(name: str, hidden: int, n_hc: int, eps: float, norm_eps: float) -> None:
    for field, value in (("hidden", hidden), ("n_hc", n_hc)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {field}={value!r} must be a positive integer")
    if not (eps >= 0 and norm_eps > 0):
        raise ValueError(f"{name}: hc_eps={eps!r} must be >= 0 and norm_eps={norm_eps!r} > 0")


def _check_streams(name: str, streams: Tensor, n_hc: int, hidden: int) -> None:
    if streams.dim() != 4 or streams.shape[-2:] != (n_hc, hidden):
        raise ValueError(f"{name}: streams of shape {tuple(streams.shape)}, expected [S, B, {n_hc}, {hidden}]")


def _coefficient_map(rows: int, width: int, scales: int, init_std: float, sequence_parallel: bool,
                     device: torch.device | str | None) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """fp32 ``fn`` [rows, width] (normal ``init_std``), ``base`` [rows] (0), ``scale`` [scales] (1): HF's init;
    marked sequence-parallel (replicated, partial gradients over tp) when ``sequence_parallel``."""
    kw = {"dtype": torch.float32, "device": device}
    params = (nn.Parameter(torch.zeros(rows, width, **kw)), nn.Parameter(torch.zeros(rows, **kw)),
              nn.Parameter(torch.ones(scales, **kw)))
    set_init(params[0], normal_init(init_std))
    if sequence_parallel:
        for p in params:
            mark_sequence_parallel(p)
    return params


class HyperConnection(nn.Module):
    """One sub-layer's mHC (module docstring). ``fn`` [(2+N)N, N*H] (normal ``init_std``), ``base`` [(2+N)N] (0),
    ``scale`` [3] (1), all fp32.

    ``forward(streams [S, B, N, H]) -> (post [S, B, N] fp32, comb [S, B, N, N] fp32, collapsed [S, B, H])``;
    ``mix(post, comb, out [S, B, H], streams) -> streams'``.
    """

    def __init__(self, hidden: int, n_hc: int, *, sinkhorn_iters: int = 20, hc_eps: float = 1e-6,
                 norm_eps: float = 1e-6, init_std: float = 0.02, sequence_parallel: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        _check("HyperConnection", hidden, n_hc, hc_eps, norm_eps)
        if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
            raise ValueError(f"HyperConnection: sinkhorn_iters={sinkhorn_iters!r} must be a positive integer")
        self.hidden, self.n_hc, self.sinkhorn_iters = hidden, n_hc, sinkhorn_iters
        self.hc_eps, self.norm_eps = float(hc_eps), float(norm_eps)
        self.fn, self.base, self.scale = _coefficient_map((2 + n_hc) * n_hc, n_hc * hidden, 3, init_std,
                                                          sequence_parallel, device)

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _check_streams("HyperConnection", streams, self.n_hc, self.hidden)
        n = self.n_hc
        flat = _unweighted_rms(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def mix(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor) -> Tensor:
        """``post (x) out + comb^T @ streams`` ``[S, B, N, H]`` in the streams' dtype (the sub-layer's residual)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, n_hc={self.n_hc}, sinkhorn_iters={self.sinkhorn_iters}"


class HyperHead(nn.Module):
    """The final collapse of the streams: ``hc_fn`` [N, N*H] (normal ``init_std``), ``hc_base`` [N] (0),
    ``hc_scale`` [1] (1), fp32. ``forward(streams [S, B, N, H]) -> [S, B, H]`` (then the final norm)."""

    def __init__(self, hidden: int, n_hc: int, *, hc_eps: float = 1e-6, norm_eps: float = 1e-6,
                 init_std: float = 0.02, sequence_parallel: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        _check("HyperHead", hidden, n_hc, hc_eps, norm_eps)
        self.hidden, self.n_hc, self.hc_eps, self.norm_eps = hidden, n_hc, float(hc_eps), float(norm_eps)
        self.hc_fn, self.hc_base, self.hc_scale = _coefficient_map(n_hc, n_hc * hidden, 1, init_std,
                                                                   sequence_parallel, device)

    def forward(self, streams: Tensor) -> Tensor:
        _check_streams("HyperHead", streams, self.n_hc, self.hidden)
        flat = _unweighted_rms(streams.flatten(-2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, n_hc={self.n_hc}"


__all__ = ["HyperConfig", "HyperConnection", "HyperHead", "expand_streams"]
