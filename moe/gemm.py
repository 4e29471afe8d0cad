"""Grouped GEMM: one matrix product per local expert over its contiguous block of rows.

``grouped_gemm(x_NK, w, tokens_per_expert_e, backend)`` computes, for every local expert i,
``out[rows_i] = x[rows_i] @ w[i]`` (``w`` is ``[e, K, M]``) or, with ``trans_w=True``,
``x[rows_i] @ w[i].T`` (``w`` is ``[e, M, K]``, the ``nn.Linear`` ``[out, in]`` layout experts
store). Rows are expert-major: the first ``tokens_per_expert_e[0]`` rows belong to expert 0, etc.
Every backend is differentiable with respect to ``x`` and ``w``. With no rows at all (N = 0: a
rank or micro-batch whose experts got no tokens) no kernel runs and ``x`` and ``w`` get zero
gradients, so gradient hooks fire as on every other step.

Backends (``GemmBackend``; its values are ``--moe-grouped-gemm-backend``'s):

- ``grouped_mm``   ``torch.nn.functional.grouped_mm`` (default). One call, offsets are the int32
                   cumsum of the counts on the device. On CUDA its grouped kernel (CUTLASS) runs
                   bf16 on sm90/sm100 GPUs (H100/H200/B200) without a host sync; other dtypes and
                   GPUs take torch's fallback, a loop over groups that copies the offsets to the
                   host (one sync per call: three per GEMM forward + backward). Row strides must be
                   multiples of 16 bytes: K and M are zero-padded to the next multiple when they
                   are not (a copy; choose aligned sizes to avoid it). Zero-size groups are fine.
                   On CPU (torch 2.13) fp32, bf16 and fp16 all work.
- ``loop``         one ``mm`` per expert; the reference the tests compare against.
- ``grouped_gemm`` ``grouped_gemm.ops.gmm`` (``pip install grouped-gemm``; CUDA, bf16 only: checked
                   when the experts are built). It takes int64 batch sizes on the host. Its weight
                   gradient comes from ``torch.empty`` and an expert with no rows writes none of its
                   block (tgale96/grouped_gemm issue 36): those blocks are zeroed here, whatever the
                   kernel left in them.
- ``te``           Transformer Engine ``GroupedLinear`` (``pip install transformer-engine[pytorch]``;
                   CUDA), host ``m_splits``. It keeps per-module state (FP8 scaling), so it runs
                   through ``moe.te_gemm.TEGroupedLinear`` objects that ``GroupedExperts`` owns, not
                   through this function.

Host counts: ``loop``, ``grouped_gemm`` and ``te`` take the counts on the host; pass them as
``counts_host`` when the dispatcher already has them (``Dispatched.tokens_per_expert_host``),
else they are read from the device (one host synchronisation).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.moe.gemm_backend import GemmBackend

_INSTALL = {GemmBackend.GROUPED_GEMM: "pip install --no-build-isolation grouped-gemm (builds with nvcc)",
            GemmBackend.TE: "pip install --no-build-isolation transformer-engine[pytorch]"}
_MODULE = {GemmBackend.GROUPED_GEMM: "grouped_gemm.ops", GemmBackend.TE: "transformer_engine.pytorch"}


def check_gemm_backend(backend: GemmBackend, dtype: torch.dtype | None = None) -> None:
    """Fail now (ValueError / ImportError naming what to use or install) if ``backend`` cannot run here.

    ``dtype``: the experts' parameter dtype (None: torch's default dtype), checked against what the
    backend's kernels accept.
    """
    backend = GemmBackend(backend)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if backend is GemmBackend.GROUPED_GEMM and dtype != torch.bfloat16:
        raise ValueError(f"gemm backend 'grouped_gemm' (grouped_gemm.ops.gmm) runs bf16 only, but the experts are "
                         f"{dtype}: train in bf16 (--bf16), or use backend 'grouped_mm' (fp32/bf16/fp16), "
                         f"'te' or 'loop'")
    if backend in _MODULE:
        import_backend(backend)


def import_backend(backend: GemmBackend) -> ModuleType:
    """The backend's Python module, or ImportError naming the package to install."""
    try:
        return importlib.import_module(_MODULE[backend])
    except ImportError as err:
        raise ImportError(f"gemm backend '{backend}' needs the {_MODULE[backend].split('.')[0]} package, "
                          f"which is not installed: {_INSTALL[backend]} (or use backend 'grouped_mm')") from err


def grouped_gemm(x_NK: Tensor, w: Tensor, tokens_per_expert_e: Tensor,
                 backend: GemmBackend = GemmBackend.GROUPED_MM, *,
                 trans_w: bool = False, counts_host: Sequence[int] | None = None) -> Tensor:
    """Per-expert ``x @ w[i]`` (``w [e, K, M]``) or ``x @ w[i].T`` (``trans_w``, ``w [e, M, K]``) -> ``[N, M]``.

    ``tokens_per_expert_e``: ``[e]`` integer counts (any device) summing to ``N``; with ``grouped_mm`` they may
    cover fewer rows (a sync-free dispatcher's worst-case rows past the last expert's block): those rows are not
    computed and their outputs are unspecified. ``counts_host``: the same counts as host ints, if known. Local
    only: nothing crosses ranks.
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
    backend = GemmBackend(backend)
    if backend is GemmBackend.TE:
        raise ValueError("gemm backend 'te' keeps per-module state: use moe.te_gemm.TEGroupedLinear "
                         "(GroupedExperts does), not the stateless grouped_gemm()")
    if x_NK.shape[0] == 0:
        return no_rows(x_NK, w, trans_w)
    if backend is GemmBackend.GROUPED_MM:
        return _grouped_mm(x_NK, w, tokens_per_expert_e, trans_w)
    counts = list(counts_host) if counts_host is not None else tokens_per_expert_e.tolist()
    if backend is GemmBackend.LOOP:
        return _loop(x_NK, w, counts, trans_w)
    gg = import_backend(backend)
    # gmm checks for contiguous bf16 operands, int64 batch sizes on the host and w [e, K, M]
    # (or [e, M, K] with trans_b)
    batch_sizes = torch.tensor(counts, dtype=torch.int64, device="cpu")
    empty = tuple(i for i, c in enumerate(counts) if c == 0)
    w = w.contiguous()
    if empty and w.requires_grad:
        w = _ZeroEmptyExpertGrads.apply(w, empty)
    return gg.gmm(x_NK.contiguous(), w, batch_sizes, trans_b=trans_w)


class _ZeroEmptyExpertGrads(torch.autograd.Function):
    """Identity on ``w [e, ., .]`` forward; backward zeroes the gradient of the experts in ``empty`` (no rows).

    grouped_gemm's weight gradient is allocated with ``torch.empty`` (``grouped_gemm/backend.py``
    ``_allocate_output``) and the kernel skips an expert whose batch size is 0, leaving its block as it found
    it (tgale96/grouped_gemm issue 36): garbage or NaN in that expert's gradient. Zeroed in place: the incoming
    gradient is gmm's fresh output and this node its only consumer. ``empty`` are host ints (no sync).
    """

    @staticmethod
    def forward(ctx, w: Tensor, empty: tuple[int, ...]) -> Tensor:
        ctx.empty = empty
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        for i in ctx.empty:
            grad[i].zero_()
        return grad, None


def no_rows(x_NK: Tensor, w: Tensor, trans_w: bool) -> Tensor:
    """The [0, M] output for N = 0 rows without a grouped kernel (some assert that a group has rows).

    An empty product with one expert's weight: autograd then gives ``x`` its [0, K] gradient and
    ``w`` an all-zero one (not None), so per-parameter gradient hooks still fire.
    """
    return x_NK @ (w[0].T if trans_w else w[0])


# --------------------------------------------------------------------------------------------
def _loop(x_NK: Tensor, w: Tensor, counts: list[int], trans_w: bool) -> Tensor:
    # unbind (not w[i]): its backward stacks the e gradients once instead of adding e zero-filled
    # [e, ...] tensors. Empty groups stay in, so w and x get (zero) gradients even with no rows.
    rows = x_NK.split(counts)
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


def row_experts(tokens_per_expert_e: Tensor, N: int) -> Tensor:
    """[N] int64 local expert of each of ``N`` expert-major rows; ``e`` for rows past the last expert's block (a
    sync-free dispatcher's worst-case rows). Device ops only (``output_size`` keeps repeat_interleave sync-free)."""
    e = tokens_per_expert_e.shape[0]
    counts = tokens_per_expert_e.long()
    counts = torch.cat([counts, (N - counts.sum()).reshape(1)])
    return torch.repeat_interleave(torch.arange(e + 1, device=tokens_per_expert_e.device), counts, output_size=N)


def flops_per_token(hidden: int, ffn: int, gated: bool) -> int:
    """Forward FLOPs of one expert MLP per routed token copy (2 per multiply-add)."""
    return 2 * hidden * ffn * (3 if gated else 2)


__all__ = ["GemmBackend", "check_gemm_backend", "flops_per_token", "grouped_gemm", "import_backend", "no_rows",
           "row_experts"]
