"""Gradient-accumulation fusion (Megatron's ``--gradient-accumulation-fusion``): a weight-gradient GEMM writes
its product straight into the parameter's main-grad buffer instead of returning a gradient for autograd to add.

The trainer's ``GradSync`` (``training.optim.grad_sync``) gives each parameter it owns a ``MainGradSlot``
(``param.moefold_grad_slot``): the parameter's view of the flat main-grad buffer and whether this step has
written it yet. ``execution.grad_accumulation.enable_grad_accumulation_fusion(model)`` switches the modules that
can fuse (the column/row-parallel linears' ``F.linear``, the routed experts' grouped GEMMs) to GEMMs that, in
backward, call ``write_weight_grad`` (this module: the slot and the writes, which the experts' GEMMs and the
trainer's ``GradSync`` use from below; the fused linear GEMM is ``execution.grad_accumulation``):

- the step's first write of a parameter is a plain product into its slice of the buffer (BLAS beta = 0:
  ``torch.mm(..., out=main_grad)``), so no pass zeroes the buffer before the step; later micro-batches (and
  a second use in the same one) accumulate (beta = 1: ``addmm_`` / ``baddbmm_``, cuBLAS's beta on CUDA);
- the GEMM then returns a placeholder gradient (uninitialised, never read: ``torch.empty``, which autograd's
  ``AccumulateGrad`` takes over without a copy) so that the parameter's post-accumulate hook runs exactly
  once per backward on the usual thread: ``GradSync`` sees ``slot.fused`` there, drops the placeholder and
  counts the parameter as reported (its bucket's reduce-scatter may start). Megatron-Core does the same
  (``grad_added_to_main_grad`` and a dummy ``grad_weight``).

Parameters whose gradient comes through autograd (norms, embeddings, routers, FP8 / Transformer Engine
linears) are copied into the buffer on their first report and added later (``GradSync``): no zeroing pass
either. A weight must be used either only by fused GEMMs or only by plain autograd within one backward
(autograd would add the placeholder to a real gradient); moefold's modules satisfy that.

dtypes: with the main-grad dtype equal to the inputs' (fp32 training, or ``--main-grads-dtype bf16``), the
GEMM writes the buffer itself. bf16 inputs into fp32 main grads: on CUDA ``torch.mm`` / ``torch.addmm`` with
``out_dtype=torch.float32`` (cuBLAS accumulating in fp32, Megatron's ``wgrad_gemm_accum_fp32``); on CPU, where
torch has no mixed-dtype GEMM (``mm.dtype`` / ``addmm.dtype`` have no CPU kernel in torch 2.13), the product
lands in a reused bf16 workspace and is cast into the fp32 buffer (first write, one pass) or widened and added
(``widen_into``: two vectorised passes, faster than torch's mixed-dtype add). Deferred weight gradients (split
backward) call ``write_weight_grad`` whenever they run: it needs only the slot, the weight and the GEMM's operands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moefold.dense.workspace import workspace

SLOT_ATTR = "moefold_grad_slot"


@dataclass(eq=False)
class MainGradSlot:
    """A parameter's place in the main-grad buffer (``main_grad``, shaped like the parameter) and its state in
    the running step: ``written`` once anything reached it this step, ``fused`` while a GEMM's direct write
    awaits its post-accumulate report (the gradient autograd brings then is a placeholder)."""

    main_grad: Tensor
    written: bool = False
    fused: bool = False


def grad_slot(weight: Tensor) -> MainGradSlot | None:
    """The slot of ``weight`` (or of the parameter it is a view of, passed alongside), None when no one set one."""
    return getattr(weight, SLOT_ATTR, None)


def set_grad_slot(param: nn.Parameter, main_grad: Tensor | None) -> None:
    """Give ``param`` a slot over ``main_grad`` (None: remove it, GEMMs then return their gradients)."""
    if main_grad is None:
        if hasattr(param, SLOT_ATTR):
            delattr(param, SLOT_ATTR)
    else:
        setattr(param, SLOT_ATTR, MainGradSlot(main_grad))


def write_weight_grad(slot: MainGradSlot, like: Tensor, compute: Callable[[Tensor, bool], None]) -> Tensor:
    """Run ``compute(target, accumulate)``, which writes (``accumulate`` False) or adds its weight gradient into
    ``target`` (the slot's buffer viewed with ``like``'s shape), then return the placeholder gradient for
    autograd (see the module docstring). ``like``: the weight as the GEMM saw it (a reshaped view is fine)."""
    compute(slot.main_grad.view(like.shape), slot.written)
    slot.written = slot.fused = True
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def mm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out = a @ b`` or ``out += a @ b`` (2-D; ``out`` may be a transposed view), in ``out``'s dtype."""
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.device.type == "cuda":   # cuBLAS: bf16/fp16 inputs, fp32 accumulation into the fp32 buffer
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        prod = workspace(out.device).empty((a.shape[0], b.shape[1]), a.dtype)
        torch.mm(a, b, out=prod)
        widen_into(out, prod, accumulate)


def widen_into(out: Tensor, src: Tensor, accumulate: bool) -> None:
    """``out = src`` or ``out += src`` where ``src`` may be narrower than ``out`` (a bf16 weight gradient into the fp32
    main grad). On CPU torch's mixed-dtype ``add_`` runs a per-element casting loop, 4-5x a same-dtype add for the
    same bytes; widening ``src`` into a reused fp32 workspace first (one vectorised cast, one vectorised add) gives
    the same sums bit for bit (``add_`` widens each element before adding) at half the time. CUDA's mixed add is
    already a memory-bound kernel, and the first write (``copy_``) a vectorised cast everywhere."""
    if not accumulate:
        out.copy_(src)
    elif src.dtype == out.dtype or out.device.type != "cpu":
        out.add_(src)
    else:
        out.add_(workspace(out.device).empty(src.shape, out.dtype).copy_(src))


__all__ = ["MainGradSlot", "grad_slot", "mm_into", "set_grad_slot", "widen_into", "write_weight_grad"]
