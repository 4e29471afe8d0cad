"""The routed experts' grouped GEMM from device counts, its weight gradients fused into main-grad when asked.

``grouped_linear(x, w, counts_e, slot)`` computes ``out[rows_i] = x[rows_i] @ w[i]^T`` for every local expert i
(``w [e, M, K]``, the ``nn.Linear`` layout the experts store), differentiable in ``x`` and ``w``:

- forward and input gradient: ``torch.nn.functional.grouped_mm`` from the device counts (no host sync);
- weight gradient ``dw[i] = dy[rows_i]^T x[rows_i]`` by the grouped kernel: with a main-grad ``slot``
  (gradient-accumulation fusion, ``dense.grad_accumulation``) copied into the parameter's main-grad buffer (the
  step's first micro-batch) or added to it (later ones): one pass, no sync; without a slot returned to autograd.
  Experts without rows get a zero gradient.

The products are the ones autograd's ``grouped_mm`` backward computes. Local: nothing crosses ranks. On a CPU
the same GEMMs run on laid-out rows instead (``moe.cpu.rows_gemm``); ``weight_grad`` is what both hand autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.dense.grad_accumulation import MainGradSlot, widen_into, write_weight_grad
from moefold.moe.gemm import GemmBackend, grouped_gemm


def weight_grad(slot: MainGradSlot | None, w: Tensor, compute: Callable[[Tensor, bool], None]) -> Tensor:
    """The weight gradient for autograd: ``compute(target, accumulate)`` into the slot's main grad (then a
    placeholder, ``write_weight_grad``), or into a fresh tensor (never a workspace: it may become ``param.grad``)."""
    if slot is not None:
        return write_weight_grad(slot, w, compute)
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    compute(dw, False)
    return dw


def _aligned(t: Tensor) -> Tensor:
    """``t`` [N, D] with D zero-padded to 16-byte rows (``grouped_mm``'s stride rule)."""
    pad = (-t.shape[1]) % max(1, 16 // t.element_size())
    return F.pad(t, (0, pad)) if pad else t


def weight_grad_into(x: Tensor, dy: Tensor, counts_e: Tensor, target: Tensor, accumulate: bool) -> None:
    """``target[i] = dy_i^T x_i`` (or ``+=``) for every expert from device counts: the grouped kernel, then one copy /
    add into the target."""
    offs = torch.cumsum(counts_e, 0, dtype=torch.int32)
    # dy_i^T x_i straight in the target's [e, M, K] layout: computed as x^T dy and transposed, the widening copy
    # into the fp32 main grad read its source across rows (1.9 ms a call at Qwen3-30B-A3B's shape on the H200,
    # two thirds of the experts' backward)
    dw_eMK = F.grouped_mm(_aligned(dy).t(), _aligned(x), offs=offs)[:, :dy.shape[1], :x.shape[1]]
    widen_into(target, dw_eMK, accumulate)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts_e: Tensor, slot: MainGradSlot | None) -> Tensor:
        ctx.save_for_backward(x, w, counts_e)
        ctx.slot = slot
        return grouped_gemm(x, w, counts_e, GemmBackend.GROUPED_MM, trans_w=True)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, counts_e = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_gemm(dy, w, counts_e, GemmBackend.GROUPED_MM, trans_w=False)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(ctx.slot, w, lambda target, accumulate: weight_grad_into(x, dy, counts_e, target,
                                                                                        accumulate))
        return dx, dw, None, None


def grouped_linear(x_NK: Tensor, w_eMK: Tensor, counts_e: Tensor, slot: MainGradSlot | None = None) -> Tensor:
    """Per-expert ``x @ w[i]^T`` from device counts (module docstring); ``slot``: ``w``'s parameter's main-grad
    slot."""
    if x_NK.dtype != w_eMK.dtype:
        raise ValueError(f"grouped_linear: x is {x_NK.dtype} but w is {w_eMK.dtype}")
    return _GroupedLinear.apply(x_NK, w_eMK, counts_e, slot)


__all__ = ["grouped_linear", "weight_grad", "weight_grad_into"]
