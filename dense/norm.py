"""RMSNorm computed in fp32 from statistics to weight, rounded once (Megatron-Core's norms; HF ``LlamaRMSNorm``'s math),
and its zero-centred-gamma variant (HF ``Qwen3NextRMSNorm``, Megatron's ``--apply-layernorm-1p``).

An fp32 island of the bf16 path: ``rms_norm`` upcasts the input, takes the mean square, normalises and
multiplies by the weight in fp32, and rounds to the input dtype once at the end. That is what Megatron-Core
0.16.1 computes with either of its norms: Transformer Engine's RMSNorm kernel (``rmsnorm_fwd_kernels.cuh``:
``z = output_t(gamma * (rs * x))`` in ``compute_t`` = fp32) and the torch fallback of its local spec
(``torch.nn.RMSNorm`` -> ``torch.rms_norm``, which computes in fp32 and rounds once as well). HF's
``LlamaRMSNorm`` family rounds the normalised value to bf16 before the weight multiply, a second rounding;
on the bf16 tiny recipes that rounding is the largest single source of moefold's former excess error over
Megatron-Core (benchmarks/RESULTS.md, "bf16 numerics"). In fp32 the two orders are the same operations, so
fp32 results (and the fp32 parity with HF) are unchanged. The zero-centred variant was computed in fp32 and
rounded once already (HF ``Qwen3NextRMSNorm``'s order).

The weight is replicated across TP. Under sequence parallelism each rank normalises only its
sequence shard, so the weight's gradient is partial: the ``sequence_parallel`` flag marks it
(``mark_sequence_parallel``) for an all-reduce over the tp group. Nothing crosses ranks here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moefold.parallel.sharding import mark_sequence_parallel


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32, or the input's own dtype where it is wider (float64: the tests' exact references)."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm``'s forward and backward, saving the input (its own dtype) and the fp32 inverse RMS ``[..., 1]``.

    Autograd through the fp32 ops would keep an fp32 copy of a bf16 input and the fp32 normalised value (10 bytes
    per element beyond the input); this keeps 0 beyond the input (and 4 bytes per row), as Transformer Engine's
    RMSNorm does (``transformer_engine/pytorch/ops/basic/rmsnorm.py``: ``ctx.save_for_backward(x, rstdevs)``).
    The backward recomputes the normalised value ``n = x * r`` from them in fp32 and runs autograd's own formulas in
    autograd's order (``derivatives.yaml``: mul, rsqrt, mean, pow), so gradients are bit for bit those of autograd
    through the forward's ops (and of HF's norms in fp32)::

        dn = g * w,   dw = sum_to_size(g * n),   ds = -0.5 * sum(dn * x) * r^3,   dx = dn * r + (ds / H) * 2x

    (``(ds / H) * 2x`` as ``x * (2 * (ds / H))`` on ``[..., 1]``: the same bits, three passes over the input fewer.)
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool) -> Tensor:
        c = _compute_dtype(x)
        x32 = x.to(c)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        # the weight in the compute dtype (a [hidden] vector), kept so that the backward casts no weight again
        w32 = 1.0 + weight.to(c) if zero_centered_gamma else weight.to(c)
        ctx.save_for_backward(x, w32, rstd)
        ctx.weight_dtype = weight.dtype
        if zero_centered_gamma:
            return ((x32 * rstd) * w32).to(x.dtype)
        return (w32 * (x32 * rstd)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, w32, rstd = ctx.saved_tensors
        c = _compute_dtype(x)
        x32 = x.to(c)
        n = x32 * rstd
        g = dy.to(c)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dn = g * w32
            dr = (dn * x32).sum(-1, keepdim=True)                  # mul's grad to its broadcast operand r
            dm = -0.5 * dr * rstd.pow(3)                           # rsqrt: -0.5 * grad * result^3
            # mean's grad dm / H and pow's 2 * x, per row ([..., 1]) instead of over every element: dm / H is
            # the same value in each of a row's elements, and a product with 2 (exact) rounds the same either way
            dp2 = 2.0 * (dm / x32.shape[-1])
            dx = (dn * rstd + x32 * dp2).to(x.dtype)               # mul's grad to x, plus pow's
        if ctx.needs_input_grad[1]:
            dw = (g * n).sum_to_size(w32.shape).to(ctx.weight_dtype)
        return dx, dw, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, zero_centered_gamma: bool = False) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (``(1 + weight) * ...`` with
    ``zero_centered_gamma``), computed in fp32 (float64 inputs: in float64) and rounded once to ``x.dtype``.

    x ``[..., hidden]``, weight ``[hidden]`` (any float dtypes). The fp32 island of every norm in the model
    (see the module docstring); for the backward it keeps ``x`` and the fp32 inverse RMS only
    (``_RMSNormFunction``). Nothing crosses ranks.
    """
    return _RMSNormFunction.apply(x, weight, eps, zero_centered_gamma)


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim.

    forward(x [..., hidden]) -> [..., hidden] in ``x.dtype`` (``rms_norm``: fp32 throughout, one rounding).

    ``zero_centered_gamma``: the stored weight is ``gamma - 1`` (initialised to 0, so weight decay pulls the
    scale towards 1, not 0) and the output is ``(x_normalised * (1 + weight))`` computed in fp32 and cast
    once, the order of HF ``Qwen3NextRMSNorm``.
    """

    def __init__(self, hidden: int, eps: float = 1e-6, *, sequence_parallel: bool = False,
                 zero_centered_gamma: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"RMSNorm hidden={hidden!r} must be a positive integer")
        if not eps > 0:
            raise ValueError(f"RMSNorm eps={eps!r} must be > 0")
        self.hidden, self.eps, self.zero_centered_gamma = hidden, float(eps), zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden, dtype=dtype, device=device))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"RMSNorm(hidden={self.hidden}) got an input of shape {tuple(x.shape)}")
        return rms_norm(x, self.weight, self.eps, zero_centered_gamma=self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}" + (", zero_centered_gamma" if self.zero_centered_gamma else "")
