"""The routing probs' products with the experts' rows, in the probs' fp32, in row blocks.

The weighted activation (``moe.activation``) multiplies bf16 (or fp16) rows by fp32 probs and rounds once
(Megatron-Core's ``(act(h) * probs).to(dtype)``). aten runs such a mixed-dtype op on CPU by widening each narrow
operand into a new tensor of the whole operand's size and writing the result into another before rounding it
back (TensorIterator's CPU type promotion; CUDA casts inside the kernel instead). At T = 4096 those are
32-128 MB fp32 tensors, fresh ``mmap``s that the kernel page-faults and zeroes on every call: with them the
probs tripled the bf16 SwiGLU's time (``benchmarks/RESULTS.md``). Here each mixed product is an explicit widening
of one row block into a small fp32 scratch, reused across blocks and warm in cache, and one rounding store.

The values are aten's: a widening is exact, an fp32 product is correctly rounded whichever way it is vectorised,
the store rounds to nearest-even once, and each row's sum over ``f`` runs in the same order (blocks hold no fewer
rows than threads, so aten splits a block's row sums over rows as it splits the whole tensor's).

    scale_rows_(a_Nf, p_N)                     # a <- (a * p[:, None]) rounded to a's dtype
    d_act_Nf, d_p_N = prob_grads(g_Nf, p_N, lambda rows: a_Nf[rows])   # (g * p) rounded; sum_f g * a in fp32

Nothing crosses ranks. fp32 rows are weighted in place and their gradients' products run in the same blocks
(``g * a`` would still be a whole temporary); on a GPU both functions are autograd's own ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 16
"""Elements of one row block: its fp32 scratch (256 KB) stays in cache from the widening to the store."""


def _block_rows(N: int, f: int) -> int:
    """Rows per block: ``CHUNK_ELEMENTS`` worth, at least one row and no fewer than the threads (module docstring)."""
    return max(1, CHUNK_ELEMENTS // max(f, 1), torch.get_num_threads())


def _in_blocks(x: Tensor) -> bool:
    """Whether products with ``x`` run in row blocks: on CPU, where aten would allocate whole temporaries. CUDA
    widens inside its kernels and its allocator caches: there one product over all rows is one launch (no block
    loop on a GPU's path)."""
    return x.device.type == "cpu"


def scale_rows_(a_Nf: Tensor, p_N: Tensor) -> Tensor:
    """``a [N, f] <- (a * p[:, None])``, the product in the promoted dtype (fp32), rounded once to ``a``'s."""
    dtype = torch.promote_types(a_Nf.dtype, p_N.dtype)
    if a_Nf.dtype == dtype or not _in_blocks(a_Nf):   # nothing to widen, or widened inside the kernel
        return a_Nf.mul_(p_N.unsqueeze(1))
    N, f = a_Nf.shape
    step = _block_rows(N, f)
    wide = torch.empty((min(N, step), f), dtype=dtype, device=a_Nf.device)
    for r in range(0, N, step):
        a = a_Nf[r:r + step]
        a.copy_(wide[: a.shape[0]].copy_(a).mul_(p_N[r:r + step, None]))
    return a_Nf


def prob_grads(g_Nf: Tensor, p_N: Tensor, a_of: Callable[[slice], Tensor] | None, out: Tensor | None = None,
               then: Callable[[slice, Tensor], None] | None = None) -> tuple[Tensor, Tensor | None]:
    """The gradients of ``(a * p[:, None]).to(a.dtype)`` for the output gradient ``g [N, f]``: ``d_a = (g * p)``
    rounded to ``g``'s dtype ``[N, f]`` (into ``out`` when given), and, when ``a_of`` is given, ``d_p = sum_f g * a``
    ``[N]`` in ``p``'s dtype (autograd's values: ``g`` widened to the product's dtype first). ``a_of(rows)`` gives
    ``a``'s rows (a block, or all of them), computed when needed; ``then(rows, d_a[rows])`` runs after each block's
    ``d_a``, while it is in cache (once over all rows on a GPU). On CPU in row blocks whatever the dtype: ``g * a``
    is a temporary as large as ``g`` even in fp32."""
    dtype = torch.promote_types(g_Nf.dtype, p_N.dtype)
    d_a = torch.empty_like(g_Nf) if out is None else out
    if not _in_blocks(g_Nf):   # autograd's own ops
        every = slice(None)
        g = g_Nf.to(dtype)
        d_p = (g * a_of(every)).sum(1).to(p_N.dtype) if a_of is not None else None
        torch.mul(g, p_N.unsqueeze(1), out=d_a)
        if then is not None:
            then(every, d_a)
        return d_a, d_p
    N, f = g_Nf.shape
    step = _block_rows(N, f)
    widen = g_Nf.dtype != dtype
    wide = torch.empty((min(N, step), f), dtype=dtype, device=g_Nf.device) if widen else None
    prod = torch.empty((min(N, step), f), dtype=dtype, device=g_Nf.device) if a_of is not None else None
    d_p = torch.empty((N,), dtype=dtype, device=g_Nf.device) if a_of is not None else None
    for r in range(0, N, step):
        s = slice(r, r + step)
        g = wide[: min(step, N - r)].copy_(g_Nf[s]) if widen else g_Nf[s]
        if a_of is not None:
            a = prod[: g.shape[0]]
            torch.sum(a.copy_(a_of(s)).mul_(g) if widen else torch.mul(g, a_of(s), out=a), 1, out=d_p[s])
        if widen:
            d_a[s].copy_(g.mul_(p_N[s, None]))
        else:
            torch.mul(g, p_N[s, None], out=d_a[s])
        if then is not None:
            then(s, d_a[s])
    return d_a, (d_p.to(p_N.dtype) if d_p is not None else None)


__all__ = ["CHUNK_ELEMENTS", "prob_grads", "scale_rows_"]
