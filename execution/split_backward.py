"""Split backward for the linears, and the walk that gives every deferrable GEMM of a model its store.

The store and the deferral are ``dense.split_backward`` (module docstring there: what splits, how ``I`` and ``W``
run, the memory it keeps). Here: ``SplitLinearGemm``, a linear's ``local_gemm`` whose weight gradient is handed to
the store, and ``install_weight_grad_store``, which the execution pass (``execution.apply``) runs once per model:
each column/row-parallel linear gets a split GEMM through its ``configure(gemm=...)`` (an FP8 GEMM that can split
takes the store itself; Transformer Engine's cannot and is refused), the routed experts get their backend's
split form (``ExpertGemm.with_weight_grad_store``) through ``GroupedExperts.configure(gemm=...)``. Nothing crosses
ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.split_backward import SplitWeights, WeightGradStore, accumulate_or_defer, weight_inputs
from moefold.moe.experts import GroupedExperts


def _column_major(t: Tensor) -> bool:
    """A 2-D tensor laid out column by column (autograd's ``mm`` backward picks its operand order by this)."""
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _linear_input_grad(dy: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """``dx`` as autograd computes it for ``F.linear(x, w, b)``: both of ``at::linear``'s paths (``addmm`` on the
    input viewed as 2-D, or ``matmul``, which folds it so) run ``mm`` on the output gradient *reshaped* to 2-D
    (``mm_mat1_backward`` in torch's FunctionsManual.cpp), transposing the product when the 2-D input was
    column-major. ``dy.matmul(w)`` on a non-contiguous ``dy`` (a head split's gradient) folds it differently and
    rounds differently on some CPUs (AMD EPYC, where the split backward was off by 1.9e-9)."""
    x_MK = x.reshape(-1, x.shape[-1])
    dy_MN = dy.reshape(-1, dy.shape[-1])
    dx_MK = w.t().mm(dy_MN.t()).t() if _column_major(x_MK) else dy_MN.mm(w)
    return dx_MK.view(x.shape) if dx_MK.is_contiguous() else dx_MK.reshape(x.shape)


def _linear_weight_grad(dy_MN: Tensor, x_MK: Tensor, w: Tensor) -> Tensor:
    """``dw`` as autograd computes it: ``mm_mat2_backward`` for ``mat2 = w.t()``, which is column-major for a
    row-major ``w`` (then ``dy^T x``), else ``(x^T dy)^T``."""
    return dy_MN.t().mm(x_MK) if _column_major(w.t()) else x_MK.t().mm(dy_MN).t()


class _SplitLinear(torch.autograd.Function):
    """``F.linear(x [..., K], w [N, K], b [N])``. With ``split`` (``w``/``b`` detached, see ``weight_inputs``) the
    weight and bias gradients go to ``split.edges`` now or later, else they are returned as usual. The formulas are
    autograd's for ``linear`` (``dx = dy w``, ``dw = dy^T x``, ``db = sum dy``): the same kernels, the same bits.
    One class for both, saving the same tensors: a recomputed region matches its forward whichever it was."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, store: WeightGradStore, split: SplitWeights | None,
                _anchor: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.store, ctx.split, ctx.has_bias = store, split, b is not None
        # fold to 2-D first, as at::linear does when its weight requires grad (a detached weight would let
        # ``matmul`` take its batched path for a non-contiguous x and round differently)
        return F.linear(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dx = _linear_input_grad(dy, x, w) if ctx.needs_input_grad[0] else None
        if ctx.split is None:
            need_w, need_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        else:
            need_w, need_b = (e is not None for e in ctx.split.edges)

        def compute() -> tuple[Tensor | None, Tensor | None]:
            dy_MN = dy.reshape(-1, dy.shape[-1])
            dw = _linear_weight_grad(dy_MN, x.reshape(-1, x.shape[-1]), w) if need_w else None
            return dw, dy_MN.sum(0) if need_b else None

        if ctx.split is None:
            return dx, *compute(), None, None, None
        accumulate_or_defer(ctx.store, ctx.split.edges, compute)
        return dx, None, None, None, None, None


class SplitLinearGemm:
    """A linear layer's ``local_gemm`` (``F.linear``'s signature) with deferrable weight gradients."""

    def __init__(self, store: WeightGradStore) -> None:
        self.store = store

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        (w_in, b_in), split = weight_inputs(self.store, w, b)
        return _SplitLinear.apply(x, w_in, b_in, self.store, split, None if split is None else split.anchor)

    def describe(self) -> str:
        return "F.linear, split backward"


def split_local_gemm(gemm: Callable[..., Tensor], store: WeightGradStore) -> Callable[..., Tensor]:
    """A linear layer's ``local_gemm`` that defers its weight gradient while ``store`` defers: ``F.linear``
    becomes ``SplitLinearGemm``; an FP8 GEMM that can split (``use_weight_grad_store``) takes the store.
    ValueError for one that cannot (Transformer Engine's, which has its own ``delay_wgrad_compute``)."""
    if gemm is F.linear or isinstance(gemm, SplitLinearGemm):
        return SplitLinearGemm(store)
    use = getattr(gemm, "use_weight_grad_store", None)
    if use is None:
        what = gemm.describe() if hasattr(gemm, "describe") else repr(gemm)
        raise ValueError(f"split backward (zero-bubble schedules, --delay-wgrad-compute) cannot defer the weight "
                         f"gradient of a {what} GEMM; use --fp8-backend torchao or no FP8 for the linears")
    use(store)
    return gemm


def install_weight_grad_store(model: nn.Module, store: WeightGradStore) -> list[str]:
    """Give every module of ``model`` that can defer its weight gradients ``store``: the linears (a split GEMM) and
    the routed experts (their backend's split form). Returns their names. Raises ValueError for a GEMM backend that
    cannot split (Transformer Engine)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.configure(gemm=split_local_gemm(module.local_gemm, store))
        elif isinstance(module, GroupedExperts):
            module.configure(gemm=module.gemm.with_weight_grad_store(store))
        else:
            continue
        names.append(name)
    return names


__all__ = ["SplitLinearGemm", "install_weight_grad_store", "split_local_gemm"]
