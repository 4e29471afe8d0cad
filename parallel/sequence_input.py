"""The sequence-parallel input of column-parallel GEMMs, kept for backward as this rank's shard.

Under sequence parallelism a column-parallel layer all-gathers the sequence (``[S/tp, ...] -> [S, ...]``) before
its GEMM, and the GEMM keeps its input for the weight gradient. Kept as autograd keeps it, that is the gathered
``[S, ...]``: tp times the shard. Megatron-Core's ``ColumnParallelLinear`` (``tensor_parallel/layers.py``,
``LinearWithGradAccumulationAndAsyncCommunication``) saves the local shard and all-gathers it again in backward,
overlapped with the input-gradient GEMM; Transformer Engine's ``Linear`` does the same
(``backward_input_needs_gather``: it saves its quantised local shard and gathers it, in FP8, in backward).

``SequenceParallelInput`` does it for any GEMM run inside it, whatever its autograd function (torch's linear, the
FP8 and block-scaled GEMMs, split backward, gradient-accumulation fusion)::

    with SequenceParallelInput(x_shard, tp_group) as x_full:     # forward: one all-gather
        q, k, v = (proj.forward_local(x_full) for proj in projections)

While it is open, a ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor autograd saves:

- a view of the gathered tensor is kept as the shard (the region's input, kept anyway by whoever produced it)
  and rebuilt in backward by one all-gather per unpack (the same bytes: the gather is a copy);
- a tensor a GEMM registered with ``keep_rows_as_shard`` (an FP8 GEMM's quantised copy of the gathered input:
  one row per gathered row, each row computed from that row and scales kept separately) is kept as this rank's
  rows and all-gathered (as bytes) in backward;
- anything else goes to the hooks that were in force when the region opened (activation offload, a
  non-reentrant checkpoint), which also receive the shards above: offload moves the shard, recompute replays it.

A group of size 1 (or no grad) makes the region the plain gather (the input itself). Crosses ranks: one
all-gather in forward; in backward one per kept tensor (the shard, or the FP8 rows), made when the first GEMM
that kept it unpacks it and held until the last has (q, k and v share one, as Megatron's fused ``linear_qkv``
gathers once), in the same order on every rank (autograd's).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from moefold.parallel.comm import _all_gather, all_gather_sequence
from moefold.parallel.groups import Group, group_rank, group_size

_ACTIVE: contextvars.ContextVar[tuple[SequenceParallelInput, ...]] = contextvars.ContextVar(
    "moefold_sequence_parallel_input", default=())


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _gather_rows(t: Tensor, group: Group) -> Tensor:
    """All-gather ``t`` along dim 0 as bytes (float8 and other 1-byte types travel as uint8)."""
    if t.dtype.itemsize == 1 and t.dtype != torch.uint8:
        return _all_gather(t.view(torch.uint8), group, 0).view(t.dtype)
    return _all_gather(t, group, 0)


class SequenceParallelInput:
    """``with SequenceParallelInput(x [S/tp, ...], group, dim) as x_full [S, ...]``: the sequence all-gather
    (``parallel.comm.all_gather_sequence``: backward reduce-scatters), whose saved copies are kept as shards."""

    def __init__(self, x: Tensor, group: Group, dim: int = 0) -> None:
        self.x: Tensor | None
        self.x, self.group, self.dim = x, group, dim % max(x.dim(), 1)
        self.full: Tensor | None = None
        self._rows: list[Tensor] = []
        self._own_rows: dict[tuple, Tensor] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._token: contextvars.Token | None = None
        self._outer: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None = None
        # backward: one all-gather per kept tensor, shared by the GEMMs that kept it (q, k, v; gate, up) as a fused
        # projection's one gather is: key -> [packs, unpacks so far, the gathered tensor while some are to come]
        self._gathers: dict[object, list] = {}

    def __enter__(self) -> Tensor:
        self.full = all_gather_sequence(self.x, self.group, self.dim)
        if (group_size(self.group) > 1 and torch.is_grad_enabled() and self.dim == 0
                and not torch.compiler.is_compiling()):   # (a compiled graph keeps what its partitioner chooses)
            self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
            self._token = _ACTIVE.set((*_ACTIVE.get(), self))
        return self.full

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            _ACTIVE.reset(self._token)
            self._hooks.__exit__(*exc)
        # the hooks stay referenced by what they packed: they keep the group only (the shard is in each pack)
        self._hooks, self._rows, self._own_rows, self.full, self.x = None, [], {}, None, None

    # -- what a GEMM inside may declare ------------------------------------------------------------------------
    def holds(self, t: Tensor) -> bool:
        """``t`` is (a view of) the gathered input, or a tensor registered by ``keep_rows_as_shard``."""
        return self.full is not None and (_storage_ptr(t) == _storage_ptr(self.full) or self._registered(t))

    def _registered(self, t: Tensor) -> bool:
        return any(t.data_ptr() == r.data_ptr() and t.shape == r.shape and t.dtype == r.dtype for r in self._rows)

    # -- the hooks ---------------------------------------------------------------------------------------------
    def _outer_pack(self, t: Tensor) -> Any:
        return t if self._outer is None else self._outer[0](t)

    def _outer_unpack(self, packed: Any) -> Tensor:
        return packed if self._outer is None else self._outer[1](packed)

    def _counted(self, key: object) -> object:
        self._gathers.setdefault(key, [0, 0, None])[0] += 1
        return key

    def _pack(self, t: Tensor) -> tuple[Any, ...]:
        full = self.full
        if full is not None and t.device == full.device and _storage_ptr(t) == _storage_ptr(full):
            return ("view", self._outer_pack(self.x), self._counted("view"), tuple(t.shape), t.stride(),
                    t.storage_offset())
        if full is not None and self._registered(t):
            # one copy of this rank's rows for every GEMM keeping the same tensor; each pack goes to the outer hooks
            # on its own (a checkpoint's holder is unpacked once)
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            if key not in self._own_rows:
                self._own_rows[key] = t.chunk(group_size(self.group), 0)[group_rank(self.group)].clone()
            return ("rows", self._outer_pack(self._own_rows[key]), self._counted(key))
        return ("other", self._outer_pack(t))

    def _gathered(self, key: object, inner: Tensor, gather: Callable[[Tensor], Tensor]) -> Tensor:
        """The all-gather of ``inner`` for the kept tensor ``key``: made at its first unpack, held until its last
        (then a new backward, with a retained graph, gathers again)."""
        entry = self._gathers[key]
        out = entry[2] if entry[2] is not None else gather(inner)
        entry[1] += 1
        entry[2] = None if entry[1] == entry[0] else out
        if entry[1] == entry[0]:
            entry[1] = 0
        return out

    def _unpack(self, packed: tuple[Any, ...]) -> Tensor:
        kind, inner = packed[0], self._outer_unpack(packed[1])
        if kind == "view":
            size, stride, offset = packed[3:]
            full = self._gathered("view", inner, lambda t: _all_gather(t.contiguous(), self.group, 0))
            return full.as_strided(size, stride, offset)
        if kind == "rows":
            return self._gathered(packed[2], inner, lambda t: _gather_rows(t, self.group))
        return inner


def keep_rows_as_shard(t: Tensor, source: Tensor) -> None:
    """Declare that row i of ``t [M, ...]`` (contiguous) belongs to row i of ``source [M, ...]``; when ``source``
    is the gathered input of the innermost open ``SequenceParallelInput``, autograd keeps ``t`` as this rank's
    rows and all-gathers it in backward. Elsewhere, nothing."""
    active = _ACTIVE.get()
    if not active:
        return
    region = active[-1]
    if region.holds(source) and t.is_contiguous() and t.dim() >= 1 and t.shape[0] == source.shape[0]:
        region._rows.append(t)


__all__ = ["SequenceParallelInput", "keep_rows_as_shard"]
