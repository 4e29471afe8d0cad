"""Grouped GEMM: one matrix product per local expert over its contiguous block of rows.

``grouped_gemm(x_NK, w, tokens_per_expert_e, backend)`` computes, for every local expert i,
``out[rows_i] = x[rows_i] @ w[i]`` (``w`` is ``[e, K, M]``) or, with ``trans_w=True``,
``x[rows_i] @ w[i].T`` (``w`` is ``[e, M, K]``, the ``nn.Linear`` ``[out, in]`` layout experts
store). Rows are expert-major: the first ``tokens_per_expert_e[0]`` rows belong to expert 0, etc.
Every backend is differentiable with respect to ``x`` and ``w``.

Backends (``GEMM_BACKENDS``):

- ``grouped_mm``   ``torch.nn.functional.grouped_mm`` (default). One call, offsets are the int32
                   cumsum of the counts and stay on the device (no host sync). Its kernels need
                   row strides that are multiples of 16 bytes: K and M are zero-padded to the next
                   multiple when they are not (a copy; choose aligned sizes to avoid it). Zero-size
                   groups and N = 0 are fine. On CPU (torch 2.13) fp32, bf16 and fp16 all work.
- ``loop``         one ``mm`` per expert; the reference the tests compare against (host sync on
                   the counts).
- ``grouped_gemm`` ``grouped_gemm.ops.gmm`` (``pip install grouped-gemm``; CUDA only; counts are
                   moved to the host, as the library requires int64 CPU batch sizes).
- ``te``           Transformer Engine ``GroupedLinear`` (``pip install transformer-engine[pytorch]``;
                   CUDA only) run functionally on our stacked weight, ``m_splits`` from the host.
"""

from __future__ import annotations

import importlib
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

GemmBackend = Literal["grouped_mm", "loop", "grouped_gemm", "te"]
GEMM_BACKENDS: tuple[str, ...] = ("grouped_mm", "loop", "grouped_gemm", "te")

_INSTALL = {"grouped_gemm": "pip install grouped-gemm",
            "te": "pip install transformer-engine[pytorch]"}
_MODULE = {"grouped_gemm": "grouped_gemm.ops", "te": "transformer_engine.pytorch"}


def check_gemm_backend(backend: str) -> None:
    """Fail now (ValueError / ImportError naming what to install) if ``backend`` cannot run here."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend {backend!r} is unknown; valid backends: {', '.join(GEMM_BACKENDS)}")
    if backend in _MODULE:
        _import_backend(backend)


def _import_backend(backend: str):
    try:
        return importlib.import_module(_MODULE[backend])
    except ImportError as err:
        raise ImportError(f"gemm backend {backend!r} needs the {_MODULE[backend].split('.')[0]} package, "
                          f"which is not installed: {_INSTALL[backend]} (or use backend 'grouped_mm')") from err


def grouped_gemm(x_NK: Tensor, w: Tensor, tokens_per_expert_e: Tensor, backend: str = "grouped_mm", *,
                 trans_w: bool = False) -> Tensor:
    """Per-expert ``x @ w[i]`` (``w [e, K, M]``) or ``x @ w[i].T`` (``trans_w``, ``w [e, M, K]``) -> ``[N, M]``.

    ``tokens_per_expert_e``: ``[e]`` integer counts (any device) summing to ``N``. Local only:
    nothing crosses ranks.
    """
    if x_NK.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_gemm expects x [N, K] and w [e, ., .], got {tuple(x_NK.shape)} and {tuple(w.shape)}")
    K = x_NK.shape[1]
    if (w.shape[2] if trans_w else w.shape[1]) != K:
        layout = "[e, M, K]" if trans_w else "[e, K, M]"
        raise ValueError(f"grouped_gemm: x has K={K} but w {tuple(w.shape)} is not {layout} with that K")
    if tokens_per_expert_e.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm: tokens_per_expert has shape {tuple(tokens_per_expert_e.shape)}, "
                         f"expected ({w.shape[0]},) (one count per expert in w)")
    if x_NK.dtype != w.dtype:
        raise ValueError(f"grouped_gemm: x is {x_NK.dtype} but w is {w.dtype}")
    if backend == "grouped_mm":
        return _grouped_mm(x_NK, w, tokens_per_expert_e, trans_w)
    if backend == "loop":
        return _loop(x_NK, w, tokens_per_expert_e, trans_w)
    if backend == "grouped_gemm":
        gg = _import_backend(backend)
        # gmm wants int64 batch sizes on the host and [e, K, M] (or trans_b with [e, M, K]) weights.
        return gg.gmm(x_NK, w, tokens_per_expert_e.to("cpu", torch.int64), trans_b=trans_w)
    if backend == "te":
        return _te(x_NK, w, tokens_per_expert_e, trans_w)
    raise ValueError(f"gemm backend {backend!r} is unknown; valid backends: {', '.join(GEMM_BACKENDS)}")


# --------------------------------------------------------------------------------------------
def _loop(x_NK: Tensor, w: Tensor, counts_e: Tensor, trans_w: bool) -> Tensor:
    # unbind (not w[i]): its backward stacks the e gradients once instead of adding e zero-filled
    # [e, ...] tensors. Empty groups stay in, so w and x get (zero) gradients even with no rows.
    rows = x_NK.split(counts_e.tolist())
    return torch.cat([xi @ (wi.T if trans_w else wi) for xi, wi in zip(rows, w.unbind(0))])


def _pad_to(t: Tensor, dim: int, multiple: int) -> Tensor:
    pad = (-t.shape[dim]) % multiple
    if pad == 0:
        return t
    spec = [0, 0] * (t.dim() - dim % t.dim() - 1) + [0, pad]
    return F.pad(t, spec)


def _grouped_mm(x_NK: Tensor, w: Tensor, counts_e: Tensor, trans_w: bool) -> Tensor:
    # Row strides must be multiples of 16 bytes: pad K (both operands) and M (w) with zeros.
    align = max(1, 16 // x_NK.element_size())
    K = x_NK.shape[1]
    M = w.shape[1] if trans_w else w.shape[2]
    if K % align or M % align:
        x_NK = _pad_to(x_NK, 1, align)
        k_dim, m_dim = (2, 1) if trans_w else (1, 2)
        w = _pad_to(_pad_to(w, k_dim, align), m_dim, align)
    w_eKM = w.transpose(1, 2) if trans_w else w
    if x_NK.stride(-1) != 1:
        x_NK = x_NK.contiguous()
    offs = torch.cumsum(counts_e, 0, dtype=torch.int32)
    out = F.grouped_mm(x_NK, w_eKM, offs=offs)
    return out[:, :M] if out.shape[1] != M else out


def _te(x_NK: Tensor, w: Tensor, counts_e: Tensor, trans_w: bool) -> Tensor:
    te = _import_backend("te")
    w_eMK = w if trans_w else w.transpose(1, 2)
    e, M, K = w_eMK.shape
    # GroupedLinear owns per-expert parameters weight0..weight{e-1} ([out, in]); run it with ours
    # substituted so autograd reaches the stacked tensor. Built on the meta device: no storage.
    layer = te.GroupedLinear(e, K, M, bias=False, params_dtype=w.dtype, device="meta")
    params = {f"weight{i}": w_eMK[i] for i in range(e)}
    return torch.func.functional_call(layer, params, (x_NK, counts_e.tolist()))


def flops_per_token(hidden: int, ffn: int, gated: bool) -> int:
    """Forward FLOPs of one expert MLP per routed token copy (2 per multiply-add)."""
    return 2 * hidden * ffn * (3 if gated else 2)


__all__ = ["GEMM_BACKENDS", "GemmBackend", "check_gemm_backend", "flops_per_token", "grouped_gemm"]
