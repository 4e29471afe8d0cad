"""Gradient-accumulation fusion for the linears (Megatron's ``--gradient-accumulation-fusion``), and the walk that
switches a model's GEMMs to it.

The slots and the writes are ``dense.grad_accumulation`` (module docstring there: first write vs accumulate, the
placeholder gradient, dtypes). Here: ``fused_linear``, a linear's ``local_gemm`` whose weight gradient is written
into the weight's main-grad slot, and ``enable_grad_accumulation_fusion``, which the execution pass runs once per
model: each column/row-parallel linear with a plain ``F.linear`` gets ``fused_linear`` through its
``configure(gemm=...)`` (an FP8 GEMM keeps its own backward), the routed experts on a backend that fuses get
``weight_grads=WeightGrads.MAIN_GRAD`` through their ``configure``. Nothing crosses ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.grad_accumulation import MainGradSlot, grad_slot, mm_into, widen_into, write_weight_grad
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.workspace import workspace
from moefold.moe.expert_gemm import WeightGrads
from moefold.moe.experts import GroupedExperts


class _FusedWgradLinear(torch.autograd.Function):
    """``F.linear(x [..., K], w [N, K], b [N])`` whose weight gradient ``dy^T x`` goes into ``slot``. The input
    and bias gradients are autograd's formulas; the weight gradient is computed as autograd's linear does
    (``x^T dy`` into the transposed buffer), so it equals the unfused one."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, slot: MainGradSlot) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.slot, ctx.has_bias = slot, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy_MN = dy.reshape(-1, dy.shape[-1])
        dw = db = None
        if ctx.needs_input_grad[1]:
            x_MK = x.reshape(-1, x.shape[-1])
            dw = write_weight_grad(ctx.slot, weight, lambda t, acc: _weight_grad_into(t, x_MK, dy_MN, acc))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy_MN.sum(0)
        return dx, dw, db, None


def _weight_grad_into(target_NK: Tensor, x_MK: Tensor, dy_MN: Tensor, accumulate: bool) -> None:
    """``target = x^T dy`` transposed (or ``+=``): autograd's product ``x^T dy`` [K, N] into the [N, K] buffer.

    On a CPU with a wider buffer (bf16 GEMM, fp32 main grads) the product lands in a bf16 workspace and is widened
    into the buffer (``dense.grad_accumulation``); widened straight into the transposed view, every element is a
    strided write across rows (the 57.7M model's [4096, 512] output layer: 6.6 ms a step, one thread). Here the
    bf16 product is first transposed into a contiguous workspace (torch's blocked same-dtype transpose copy), then
    widened contiguously (1.3 ms). The same GEMM call and exact copies: the same bits."""
    if target_NK.dtype == x_MK.dtype or target_NK.device.type != "cpu" or target_NK.dim() != 2:
        mm_into(target_NK.t(), x_MK.t(), dy_MN, accumulate)
        return
    pool = workspace(target_NK.device)
    prod_KN = pool.empty((x_MK.shape[1], dy_MN.shape[1]), x_MK.dtype)
    torch.mm(x_MK.t(), dy_MN, out=prod_KN)
    widen_into(target_NK, pool.empty(target_NK.shape, x_MK.dtype).copy_(prod_KN.t()), accumulate)


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``'s signature; the weight gradient goes into the weight's main-grad slot when it has one (and
    autograd is recording), else this is ``F.linear`` itself."""
    slot = grad_slot(weight)
    if slot is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    return _FusedWgradLinear.apply(x, weight, bias, slot)


def _use_fusion(layer: ColumnParallelLinear | RowParallelLinear, enabled: bool) -> bool:
    """Fusion for a plain ``F.linear`` layer (an FP8 GEMM keeps its own backward); whether the layer fuses now."""
    if enabled and layer.local_gemm is F.linear:
        layer.configure(gemm=fused_linear)
    elif not enabled and layer.local_gemm is fused_linear:
        layer.configure(gemm=F.linear)
    return layer.local_gemm is fused_linear


def _use_expert_fusion(experts: GroupedExperts, enabled: bool) -> bool:
    """Fusion for routed experts whose backend writes main-grad slots (``grouped_mm`` without FP8 or split backward;
    the others keep autograd's gradients); whether they fuse now."""
    if experts.gemm.fuses_wgrad:
        experts.configure(weight_grads=WeightGrads.MAIN_GRAD if enabled else WeightGrads.AUTOGRAD)
    return experts.weight_grads is WeightGrads.MAIN_GRAD


def enable_grad_accumulation_fusion(model: nn.Module, enabled: bool = True) -> list[str]:
    """Switch every module of ``model`` that can fuse (the linears with ``F.linear``, the routed experts on the
    default GEMM path) to GEMMs that write into main-grad slots (or back). Returns the names of the modules that
    fused. The slots themselves come from ``GradSync``; without them the fused GEMMs behave exactly like the plain
    ones."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            fused = _use_fusion(module, enabled)
        elif isinstance(module, GroupedExperts):
            fused = _use_expert_fusion(module, enabled)
        else:
            fused = False
        if fused:
            names.append(name)
    return names


__all__ = ["enable_grad_accumulation_fusion", "fused_linear"]
