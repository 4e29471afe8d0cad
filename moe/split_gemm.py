"""The routed experts' grouped GEMM with a split backward: input gradient now, weight gradient deferrable.

``SplitGroupedGemm(store)`` has ``moe.gemm.grouped_gemm``'s signature and computes the same forward. Its
backward computes, per local expert i over its rows (``w[i]`` in the experts' ``[out, in]`` layout with
``trans_w``)::

    dx[rows_i] = dy[rows_i] @ w[i]          (now: the dispatch's backward exchange waits for it)
    dw[i]      = dy[rows_i]^T @ x[rows_i]   (now, or at the deferral's run(): ``dense.split_backward``)

with the kernels autograd uses for the backend's forward (``grouped_mm``: the 2-D x 2-D grouped product over
each expert's rows; ``loop``: one ``mm`` per expert; ``grouped_gemm``: ``backend.gmm(..., trans_a=True)`` as
``grouped_gemm.ops``), so the gradients equal the plain backward's. An expert without rows gets a zero
``dw[i]``; with no rows at all (N = 0) ``dw`` is all zeros, as ``moe.gemm.no_rows`` gives, so the
gradient hooks still fire. Local only: nothing crosses ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.dense.split_backward import SplitWeights, WeightGradStore, accumulate_or_defer, weight_inputs
from moefold.moe.gemm import GemmBackend, grouped_gemm, import_backend


def _aligned(t: Tensor, dim: int) -> Tensor:
    """``t`` zero-padded along ``dim`` to 16-byte rows (``F.grouped_mm``'s stride rule)."""
    align = max(1, 16 // t.element_size())
    pad = (-t.shape[dim]) % align
    if pad == 0:
        return t
    spec = [0, 0] * (t.dim() - dim % t.dim() - 1) + [0, pad]
    return F.pad(t, spec)


def grouped_weight_grad(x_NK: Tensor, dy_NM: Tensor, counts_e: Tensor, backend: GemmBackend,
                        counts_host: Sequence[int] | None, trans_w: bool) -> Tensor:
    """Per expert ``dy_i^T x_i`` -> ``[e, M, K]`` (``trans_w``) or ``x_i^T dy_i`` -> ``[e, K, M]``."""
    e, N = counts_e.shape[0], x_NK.shape[0]
    lhs, rhs = (dy_NM, x_NK) if trans_w else (x_NK, dy_NM)   # out[i] = lhs_i^T rhs_i
    if N == 0:
        return lhs.new_zeros((e, lhs.shape[1], rhs.shape[1]))
    if backend is GemmBackend.GROUPED_MM:
        a, b = _aligned(lhs, 1), _aligned(rhs, 1)
        out = F.grouped_mm(a.t(), b.contiguous(), offs=torch.cumsum(counts_e, 0, dtype=torch.int32))
        return out[:, :lhs.shape[1], :rhs.shape[1]]
    counts = list(counts_host) if counts_host is not None else counts_e.tolist()
    if backend is GemmBackend.LOOP:
        return torch.stack([li.t().mm(ri) for li, ri in zip(lhs.split(counts), rhs.split(counts))])
    gg = import_backend(GemmBackend.GROUPED_GEMM)   # grouped_gemm.ops; its backend module computes the K-grouped form
    batch_sizes = torch.tensor(counts, dtype=torch.int64, device="cpu")
    return gg.backend.gmm(lhs.contiguous(), rhs.contiguous(), batch_sizes, trans_a=True)


class _SplitGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts_e: Tensor, backend: GemmBackend, trans_w: bool,
                counts_host: tuple[int, ...] | None, store: WeightGradStore, split: SplitWeights | None,
                _anchor: Tensor | None) -> Tensor:
        # with split, w is detached: its gradient goes to split.edges (dense.split_backward), else it is returned
        ctx.save_for_backward(x, w, counts_e)
        ctx.backend, ctx.trans_w, ctx.counts_host, ctx.store, ctx.split = backend, trans_w, counts_host, store, split
        return grouped_gemm(x, w, counts_e, backend, trans_w=trans_w, counts_host=counts_host)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, counts_e = ctx.saved_tensors
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            # dx_i = dy_i @ w[i] (trans_w) or dy_i @ w[i]^T: the forward GEMM with the other layout
            dx = grouped_gemm(dy, w, counts_e, ctx.backend, trans_w=not ctx.trans_w, counts_host=ctx.counts_host)

        def compute() -> tuple[Tensor]:
            return (grouped_weight_grad(x, dy, counts_e, ctx.backend, ctx.counts_host, ctx.trans_w),)

        dw = None
        if ctx.split is not None:
            accumulate_or_defer(ctx.store, ctx.split.edges, compute)
        elif ctx.needs_input_grad[1]:
            (dw,) = compute()
        return dx, dw, None, None, None, None, None, None, None


class SplitGroupedGemm:
    """``moe.gemm.grouped_gemm`` with a deferrable weight gradient (``grouped_mm``, ``loop``, ``grouped_gemm``)."""

    def __init__(self, store: WeightGradStore) -> None:
        self.store = store

    def __call__(self, x_NK: Tensor, w: Tensor, tokens_per_expert_e: Tensor,
                 backend: GemmBackend = GemmBackend.GROUPED_MM, *, trans_w: bool = False,
                 counts_host: Sequence[int] | None = None) -> Tensor:
        backend = GemmBackend(backend)
        host = None if counts_host is None else tuple(int(c) for c in counts_host)
        (w_in,), split = weight_inputs(self.store, w)
        return _SplitGroupedMM.apply(x_NK, w_in, tokens_per_expert_e, backend, trans_w, host, self.store, split,
                                     None if split is None else split.anchor)


__all__ = ["SplitGroupedGemm", "grouped_weight_grad"]
