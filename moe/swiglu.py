"""SwiGLU ``silu(gate) * up`` over the halves of one GEMM's output, in reused buffers and without a ``cat``.

``swiglu_rows(h_NGf)``: ``h [N, 2f]`` (gate ``h[:, :f]``, up ``h[:, f:]``, as the experts' single input
projection writes them) -> ``act [N, f]``. Autograd's version allocates ``silu(gate)``, the product, and in
backward four more ``[N, f]`` tensors and a ``cat`` into a fresh ``[N, 2f]`` gradient: on CPU each is a new,
page-faulted buffer per call (the ``cat`` alone took 43 ms on 64 MB in the issue's profile). Here forward is
two passes into one workspace (``silu`` out, ``mul_``), backward four passes that write the two halves of
one workspace ``dh`` directly::

    d_up   = silu(gate) * d_act
    d_gate = silu'(gate) * (up * d_act)        (aten's silu_backward, in place)

Saves only ``h`` (autograd saves ``h``'s halves and ``silu(gate)``). The kernels are aten's own (``silu``,
``mul``, ``silu_backward``), so the values equal autograd's bit for bit. On CUDA the workspace is the
caching allocator. ``--compile`` fuses the same math into one generated kernel per direction instead
(``moe.activation.fused_activation``); under selective recompute of the activation (which frees its output's
storage) the experts use autograd's version (a workspace must never be freed under the pool).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moefold.dense.workspace import workspace


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NGf: Tensor) -> Tensor:
        N, f = h_NGf.shape[0], h_NGf.shape[1] // 2
        gate, up = h_NGf[:, :f], h_NGf[:, f:]
        act = workspace(h_NGf.device).empty((N, f), h_NGf.dtype)
        torch.ops.aten.silu.out(gate, out=act)
        act.mul_(up)
        ctx.save_for_backward(h_NGf)
        return act

    @staticmethod
    def backward(ctx, d_act: Tensor) -> Tensor:
        (h_NGf,) = ctx.saved_tensors
        N, f = h_NGf.shape[0], h_NGf.shape[1] // 2
        gate, up = h_NGf[:, :f], h_NGf[:, f:]
        dh = workspace(h_NGf.device).empty((N, 2 * f), h_NGf.dtype)
        d_gate, d_up = dh[:, :f], dh[:, f:]
        torch.ops.aten.silu.out(gate, out=d_up)
        d_up.mul_(d_act)
        torch.mul(up, d_act, out=d_gate)
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return dh


def swiglu_rows(h_NGf: Tensor) -> Tensor:
    """[N, 2f] (gate, up) -> [N, f] ``silu(gate) * up`` (module docstring)."""
    if h_NGf.dim() != 2 or h_NGf.shape[1] % 2:
        raise ValueError(f"swiglu_rows expects [N, 2f], got {tuple(h_NGf.shape)}")
    return _SwiGLU.apply(h_NGf.contiguous())


__all__ = ["swiglu_rows"]
