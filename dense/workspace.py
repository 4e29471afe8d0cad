"""Reused buffers for the large, short-lived tensors of the expert path (CPU), instead of fresh allocations.

Here, in ``dense``, because that is the lowest package whose code takes them: the main-grad writes' CPU path
(``dense.grad_accumulation``: a bf16 weight gradient widened into the fp32 buffer, which the linears' fused GEMMs,
the experts' and the trainer's ``GradSync`` all run). The experts' CPU rows path (``moe.cpu``) and SwiGLU
(``moe.swiglu``) use them from above.

    from moefold.dense.workspace import workspace
    h_NM = workspace(x.device).empty((N, M), x.dtype)   # a buffer nobody else holds, or a new one

Why: on CPU, torch allocates with glibc ``malloc``. glibc serves a block above its mmap threshold (which
adapts up to 32 MiB) with a fresh ``mmap`` and unmaps it when freed, so every activation of that size
(the permuted rows, SwiGLU's ``[N, 2F]`` projections and their gradients: 32-268 MB at T = 4096) is
page-faulted and zeroed by the kernel again on every call. That costs as much as a good share of the GEMMs
(``benchmarks/RESULTS.md``). A CUDA (or other accelerator) device has a caching allocator that already
reuses blocks, so ``empty`` there is plain ``torch.empty``.

How a buffer is known to be free: the pool keeps one reference to each buffer; when the storage's use
count says that no other tensor (a view handed out, a tensor autograd saved for backward, a gradient in
flight) shares it, it may be handed out again. So a buffer saved by micro-batch 1's forward is never reused
by micro-batch 2's forward while micro-batch 1's backward is pending (pipeline schedules, gradient
accumulation, recompute): those get a buffer of their own. Nothing is ever handed out twice at once.

Size: buffers are allocated with up to 1/8 slack (so that next call's slightly different row count
fits) and handed out only for requests of at least half their size. The pool keeps at most
``max_free_bytes`` of buffers that nobody holds (the largest go first); what it holds beyond that is in use
anyway. ``release()`` drops every free buffer. One pool per device per process (like torch's own
allocator), shared by every layer; nothing crosses ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

MIN_BYTES = 1 << 20          # smaller requests: torch.empty (glibc's heap serves them without page faults)
_FREE_REFS = 2               # the pool's own tensor + the temporary Storage object of the check


def _in_use(buf: Tensor) -> bool:
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > _FREE_REFS


def _capacity(numel: int) -> int:
    """``numel`` rounded up to 1/8 of its power-of-two class (<= 12.5% slack)."""
    step = max(1, 1 << max(0, numel.bit_length() - 4))
    return -(-numel // step) * step


class WorkspacePool:
    """Buffers of one device, reused when no tensor outside the pool holds them (module docstring)."""

    def __init__(self, device: torch.device, max_free_bytes: int = 4 << 30) -> None:
        self.device = torch.device(device)
        self.max_free_bytes = max_free_bytes
        self.reuse = self.device.type == "cpu"
        self._buffers: dict[torch.dtype, list[Tensor]] = {}
        self._lock = threading.Lock()   # backward may run on autograd's device threads
        self.allocated = 0               # buffers created (tests, diagnostics)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous tensor of ``shape`` that no other live tensor shares."""
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        if not self.reuse or numel * dtype.itemsize < MIN_BYTES:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with self._lock:
            buffers = self._buffers.setdefault(dtype, [])
            best = None
            for buf in buffers:
                n = buf.numel()
                if numel <= n <= 2 * numel and (best is None or n < best.numel()) and not _in_use(buf):
                    best = buf
            if best is None:
                self._trim()
                best = torch.empty(_capacity(numel), dtype=dtype, device=self.device)
                buffers.append(best)
                self.allocated += 1
            return best[:numel].view(shape)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        return self.empty(shape, dtype).zero_()

    def free_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bs in self._buffers.values() for b in bs if not _in_use(b))

    def _trim(self) -> None:
        """Drop free buffers, largest first, until the free ones fit ``max_free_bytes``."""
        free = sorted(((b.numel() * b.element_size(), id(b), dt, b) for dt, bs in self._buffers.items() for b in bs
                       if not _in_use(b)), key=lambda item: -item[0])
        total = sum(item[0] for item in free)
        for size, _, dt, buf in free:
            if total <= self.max_free_bytes:
                break
            self._buffers[dt] = [b for b in self._buffers[dt] if b is not buf]
            total -= size

    def release(self) -> None:
        """Forget every buffer nobody holds (the memory goes back to the allocator)."""
        with self._lock:
            for dt, bs in self._buffers.items():
                self._buffers[dt] = [b for b in bs if _in_use(b)]


_POOLS: dict[torch.device, WorkspacePool] = {}


def workspace(device: torch.device | str) -> WorkspacePool:
    """The process's pool for ``device`` (created on first use)."""
    device = torch.device(device)
    pool = _POOLS.get(device)
    if pool is None:
        pool = _POOLS.setdefault(device, WorkspacePool(device))
    return pool


__all__ = ["MIN_BYTES", "WorkspacePool", "workspace"]
