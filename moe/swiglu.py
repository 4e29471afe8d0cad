"""SwiGLU ``silu(gate) * up``, weighted by each row's routing prob, over the halves of one GEMM's output, in reused
buffers and without a ``cat``.

``swiglu_rows(h_NGf, probs_N)``: ``h [N, 2f]`` (gate ``h[:, :f]``, up ``h[:, f:]``, as the experts' single input
projection writes them), ``probs_N [N]`` fp32 (or None) -> ``act [N, f] = (silu(gate) * up * p).to(h.dtype)``: the
weighted activation of ``moe.activation`` (Megatron-Core's ``activation_func_with_probs``; the product with the fp32
prob rounded once). Autograd's version allocates ``silu(gate)``, the products, and in backward more ``[N, f]``
tensors and a ``cat`` into a fresh ``[N, 2f]`` gradient: on CPU each is a new, page-faulted buffer per call (the
``cat`` alone took 43 ms on 64 MB in the issue's profile), and it saves ``silu(gate) * up`` for the probs' gradient.
Here forward is three passes into one workspace (``silu`` out, ``mul_`` up, the probs' product); backward writes
the two halves of one workspace ``dh`` directly, recomputing ``a = silu(gate) * up`` for the probs' gradient (as
Megatron's fused ``weighted_swiglu`` does)::

    d_p    = sum_f g * a                (g: d_out widened to fp32, the product's dtype)
    d_act  = (g * p) rounded to h's dtype
    d_up   = silu(gate) * d_act
    d_gate = silu'(gate) * (up * d_act)        (aten's silu_backward, in place)

The products with the fp32 probs run in cache-sized row blocks (``moe.prob_rows``): aten's CPU type promotion
would widen whole bf16 operands into fresh fp32 tensors, which tripled this op's time; ``a`` and the two products
that take ``d_act`` run in the same blocks, while ``d_act`` is in cache.
Saves only ``h`` and ``p``. The kernels are aten's own (``silu``, ``mul``, ``silu_backward``, ``sum``), in the
order autograd runs them for ``(F.silu(gate) * up * p[:, None]).to(h.dtype)``, so the values equal autograd's bit
for bit. On CUDA the workspace is the caching allocator. ``--compile`` fuses the same math into one generated kernel
per direction instead (``moe.activation.fused_weighted_activation``); under selective recompute of the activation
(which frees its output's storage) the experts use ``moe.activation.Weighted`` (a workspace must never be freed
under the pool).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moefold.dense.workspace import workspace
from moefold.moe.prob_rows import prob_grads, scale_rows_


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NGf: Tensor, probs_N: Tensor | None) -> Tensor:
        N, f = h_NGf.shape[0], h_NGf.shape[1] // 2
        gate, up = h_NGf[:, :f], h_NGf[:, f:]
        act = workspace(h_NGf.device).empty((N, f), h_NGf.dtype)
        torch.ops.aten.silu.out(gate, out=act)
        act.mul_(up)
        if probs_N is not None:   # in the fp32 of the probs, rounded once to h's dtype on the store
            scale_rows_(act, probs_N)
        ctx.save_for_backward(h_NGf, probs_N)
        return act

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor, Tensor | None]:
        h_NGf, probs_N = ctx.saved_tensors
        N, f = h_NGf.shape[0], h_NGf.shape[1] // 2
        gate, up = h_NGf[:, :f], h_NGf[:, f:]
        pool = workspace(h_NGf.device)
        dh = pool.empty((N, 2 * f), h_NGf.dtype)
        d_gate, d_up = dh[:, :f], dh[:, f:]
        torch.ops.aten.silu.out(gate, out=d_up)
        def products(rows: slice, d_act: Tensor) -> None:   # d_up = silu(gate) * d_act, d_gate = up * d_act
            d_up[rows].mul_(d_act)
            torch.mul(up[rows], d_act, out=d_gate[rows])

        d_p = None
        if probs_N is None:
            products(slice(None), d_out)
        else:   # per row block: a = silu(gate) * up recomputed for d_p, d_act = (g * p) rounded, then the products
            a_of = (lambda rows: d_up[rows] * up[rows]) if ctx.needs_input_grad[1] else None
            _, d_p = prob_grads(d_out, probs_N, a_of, out=pool.empty((N, f), h_NGf.dtype), then=products)
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return dh, d_p


def swiglu_rows(h_NGf: Tensor, probs_N: Tensor | None = None, /) -> Tensor:
    """[N, 2f] (gate, up), [N] fp32 probs or None -> [N, f] ``(silu(gate) * up * p).to(h.dtype)`` (module
    docstring)."""
    if h_NGf.dim() != 2 or h_NGf.shape[1] % 2:
        raise ValueError(f"swiglu_rows expects [N, 2f], got {tuple(h_NGf.shape)}")
    if probs_N is not None and tuple(probs_N.shape) != (h_NGf.shape[0],):
        raise ValueError(f"swiglu_rows: probs of shape {tuple(probs_N.shape)} for {h_NGf.shape[0]} rows")
    return _SwiGLU.apply(h_NGf.contiguous(), probs_N)


__all__ = ["swiglu_rows"]
