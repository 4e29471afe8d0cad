"""A CPU stand-in for ``grouped_gemm.ops`` (tgale96/grouped_gemm at ebeae0b, the source of the ``grouped-gemm``
PyPI package), for protocol tests: ``gmm(a, b, batch_sizes, trans_b=False)`` with the library's autograd
(``grouped_gemm/ops.py``: forward ``gmm(a, b)``; backward ``agrad = gmm(grad, b, trans_b=not trans_b)``,
``bgrad = gmm(lhs, rhs, trans_a=True)``) and every check its C++ makes on the arguments (``csrc/grouped_gemm.cu``,
lines below; the default build, without ``GROUPED_GEMM_CUTLASS``: cuBLAS, host batch sizes).

It also reproduces what the real kernel leaves behind: outputs come from ``torch.empty``
(``grouped_gemm/backend.py:22`` ``_allocate_output``) and an expert whose batch size is 0 writes none of its block
of the ``trans_a`` (weight-gradient) output (tgale96/grouped_gemm issue 36: "that region of the output tensor is
never written"): the stand-in fills that block with NaN, the worst garbage ``torch.empty`` can hold. Arithmetic
is a per-expert matmul in fp32, rounded to bf16 (``CublasGemm`` accumulates in fp32: ``CUDA_R_32F``,
``csrc/grouped_gemm.cu:392``), so gradients through it are real.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

# What the real library rejects and the stand-in with it: (what, tgale96/grouped_gemm file:line at ebeae0b).
PRECONDITIONS: tuple[tuple[str, str], ...] = (
    ("batch_sizes on the host (cuBLAS build)", "csrc/grouped_gemm.cu:480"),
    ("batch_sizes 1-D int64", "csrc/grouped_gemm.cu:485-486"),
    ("a bf16 2-D", "csrc/grouped_gemm.cu:491-492"),
    ("b bf16", "csrc/grouped_gemm.cu:505"),
    ("b 3-D [experts, K, N] (or [experts, N, K] with trans_b)", "csrc/grouped_gemm.cu:524"),
    ("a's K equals b's K", "csrc/grouped_gemm.cu:531"),
    ("one batch size per expert", "csrc/grouped_gemm.cu:534"),
    ("a contiguous", "csrc/grouped_gemm.cu:538"),
    ("b contiguous", "csrc/grouped_gemm.cu:539"),
)


def _check(ok: bool, where: str, cond: str) -> None:
    """``TORCH_CHECK(cond)`` at ``where``: a RuntimeError."""
    if not ok:
        raise RuntimeError(f"Expected {cond} to be true, but got false. ({where})")


class Recorder:
    """The batch sizes of every ``gmm`` call (forward and backward); ``host`` wraps the stand-in's own reads of the
    host batch sizes (a test's sync counter pauses there: they are the library's, not moefold's)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.host: Callable[[], AbstractContextManager] = nullcontext


def _backend_gmm(recorder: Recorder, a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor,
                 trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm_backend.gmm`` (``csrc/grouped_gemm.cu`` ``GroupedGemm``) into a ``torch.empty`` output."""
    _check(not (trans_a and trans_b), "csrc/grouped_gemm.cu:476", "!(trans_a && trans_b)")
    _check(batch_sizes.device.type == "cpu", "csrc/grouped_gemm.cu:480", "batch_sizes.is_cpu()")
    _check(batch_sizes.dim() == 1, "csrc/grouped_gemm.cu:485", "batch_sizes.ndimension() == 1")
    _check(batch_sizes.dtype == torch.int64, "csrc/grouped_gemm.cu:486", "batch_sizes.scalar_type() == torch::kInt64")
    _check(a.dim() == 2, "csrc/grouped_gemm.cu:491", "a.ndimension() == 2")
    _check(a.dtype == torch.bfloat16, "csrc/grouped_gemm.cu:492", "a.scalar_type() == torch::kBFloat16")
    _check(b.dtype == torch.bfloat16, "csrc/grouped_gemm.cu:505", "b.scalar_type() == torch::kBFloat16")
    if trans_a:
        _check(b.dim() == 2 and b.shape[0] == a.shape[0], "csrc/grouped_gemm.cu:517-519",
               "b.ndimension() == 2 && b.size(0) == a.size(0)")
    else:
        _check(b.dim() == 3, "csrc/grouped_gemm.cu:524", "b.ndimension() == 3")
        _check((b.shape[2] if trans_b else b.shape[1]) == a.shape[1], "csrc/grouped_gemm.cu:531",
               "hidden_in == a.size(1)")
        _check(batch_sizes.shape[0] == b.shape[0], "csrc/grouped_gemm.cu:534", "batch_sizes.size(0) == num_experts")
    _check(a.is_contiguous(), "csrc/grouped_gemm.cu:538", "a.is_contiguous()")
    _check(b.is_contiguous(), "csrc/grouped_gemm.cu:539", "b.is_contiguous()")
    with recorder.host():
        sizes = batch_sizes.tolist()
    recorder.calls.append(sizes)
    if trans_a:   # the weight gradient: [experts, a's K, b's N], one block per expert over its rows
        c = torch.empty(len(sizes), a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
        for i, (xa, xb) in enumerate(zip(a.split(sizes), b.split(sizes))):
            if sizes[i] == 0:
                c[i] = float("nan")   # never written by the kernel (issue 36): torch.empty's garbage
            else:
                c[i] = (xa.float().T @ xb.float()).to(a.dtype)
        return c
    rows = [xa.float() @ (w.float().T if trans_b else w.float()) for xa, w in zip(a.split(sizes), b.unbind(0))]
    return torch.cat(rows).to(a.dtype)


def module(recorder: Recorder | None = None) -> types.ModuleType:
    """A fresh ``grouped_gemm.ops`` (its ``gmm`` and ``GroupedGemm``) recording into ``recorder``."""
    recorder = recorder or Recorder()

    class GroupedGemm(torch.autograd.Function):   # grouped_gemm/ops.py:5-29
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool):
            ctx.save_for_backward(a, b, batch_sizes)
            ctx.trans_b = trans_b
            return _backend_gmm(recorder, a, b, batch_sizes, trans_a=False, trans_b=trans_b)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor):
            grad = grad.contiguous()
            a, b, batch_sizes = ctx.saved_tensors
            agrad = bgrad = None
            if ctx.needs_input_grad[0]:
                agrad = _backend_gmm(recorder, grad, b, batch_sizes, trans_a=False, trans_b=not ctx.trans_b)
            if ctx.needs_input_grad[1]:
                lhs, rhs = (grad, a) if ctx.trans_b else (a, grad)
                bgrad = _backend_gmm(recorder, lhs, rhs, batch_sizes, trans_a=True, trans_b=False)
            return agrad, bgrad, None, None

    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
        return GroupedGemm.apply(a, b, batch_sizes, trans_b)

    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm, ops.GroupedGemm, ops.recorder = gmm, GroupedGemm, recorder
    return ops


def install(monkeypatch: Any) -> Recorder:
    """Put the stand-in under ``grouped_gemm`` / ``grouped_gemm.ops`` (undone by ``monkeypatch``)."""
    ops = module()
    pkg = types.ModuleType("grouped_gemm")
    pkg.ops = ops
    monkeypatch.setitem(sys.modules, "grouped_gemm", pkg)
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", ops)
    return ops.recorder


__all__ = ["PRECONDITIONS", "Recorder", "install", "module"]
