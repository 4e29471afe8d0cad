"""Fine-grained activation offloading's mechanism: what chosen regions save for backward waits in host memory.

The choice (``--offload-modules``, ``dense.activation_offload``) and which layer region each name is
(``execution.activation_offload``) are elsewhere; this is how a region offloads.
How: each module call is a *group*. ``torch.autograd.graph.saved_tensors_hooks`` replace every tensor the
region saves (parameters and tensors under ``min_tensor_numel`` elements excepted; one copy per distinct view)
by a handle; when the region's forward ends its tensors are copied to host memory and the device references
dropped. On CUDA the copies run on a side stream after an event from the compute stream, into pinned memory,
and ``record_stream`` keeps the device blocks from reuse until they finished; nothing waits on the host.
In backward a group comes back on a second side stream when the first of its tensors is asked for, and with it
every group of its layer and of the layer before (prefetch one layer ahead: at most two layers' offloaded
tensors are on the device at once); the compute stream waits for the group's event, not the host. When a
micro-batch's backward reaches a chunk's output the groups of its last two layers start coming back. On other
devices (the CPU) the same code runs with plain copies into separate host buffers, allocated under
``host_allocation()`` so that a memory tracker can count them apart from the device's tensors.

Groups belong to the *chunk* (one micro-batch through one pipeline chunk, ``begin_chunk``) whose forward made
them, so any number of micro-batches can be in flight (pipeline schedules): a handle keeps its group and chunk
alive exactly as long as autograd keeps the handle. Values and gradients are those of no offloading: the copies
are exact.

An ``OffloadRegion`` is a ``dense.regions.Region`` (``region(fn, *args)`` runs ``fn`` inside it, around its
``inner`` region, ``PLAIN`` unless composed), an ``OutputRegion`` (``open().run(fn, *args)``: the part's output
stays, only its saved tensors move).
Nothing crosses ranks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.activation_offload import MIN_OFFLOADED_TENSOR_SIZE
from moefold.dense.regions import PLAIN, Region

_HOST_ALLOCATION: ContextVar[bool] = ContextVar("moefold_offload_host_allocation", default=False)


@contextlib.contextmanager
def host_allocation() -> Iterator[None]:
    """Marks the tensors created inside as offloading's host copies (``is_host_allocation``)."""
    token = _HOST_ALLOCATION.set(True)
    try:
        yield
    finally:
        _HOST_ALLOCATION.reset(token)


def is_host_allocation() -> bool:
    """True while offloading allocates its host copies (memory trackers count those separately)."""
    return _HOST_ALLOCATION.get()


def _side_stream(device: torch.device) -> torch.Stream | None:
    """A stream of the accelerator ``device`` is on; None for the CPU (and meta): copies are synchronous there."""
    accelerator = torch.accelerator.current_accelerator()
    return torch.Stream(device=device) if accelerator is not None and device.type == accelerator.type else None


STORAGE_COPY_MIN_COVERAGE = 0.5   # views covering at least this share of their storage: the storage is copied once


@dataclass(eq=False)
class _Saved:
    """The saved tensors of one storage: ``views`` (the tensors as saved) on the device until the group commits;
    then ``host``: the whole storage (``whole``) or, when the views cover little of it, one contiguous copy of each
    view; ``reloaded`` the same on the device in backward. ``uses``: handles not yet unpacked."""

    views: list[Tensor]
    specs: list[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = field(default_factory=list)
    host: list[Tensor] = field(default_factory=list)
    whole: bool = False
    reloaded: list[Tensor] | None = None
    uses: int = 0

    def copy_out(self, pin: bool) -> None:
        first = self.views[0]
        storage = first.untyped_storage()
        covered = sum(v.numel() * v.element_size() for v in self.views)
        self.whole = covered >= STORAGE_COPY_MIN_COVERAGE * storage.nbytes()
        sources = [torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)] if self.whole else self.views
        for src in sources:
            host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            host.copy_(src, non_blocking=pin)
            self.host.append(host)

    def copy_in(self, device: torch.device, pin: bool) -> None:
        self.reloaded = []
        for host in self.host:
            dev = torch.empty(host.shape, dtype=host.dtype, device=device)
            dev.copy_(host, non_blocking=pin)
            self.reloaded.append(dev)
        self.host = []

    def view(self, index: int) -> Tensor:
        """The ``index``-th saved view, rebuilt on the reloaded copy."""
        if not self.whole:
            return self.reloaded[index]
        offset, shape, stride, dtype = self.specs[index]
        storage = self.reloaded[0].untyped_storage()
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.host)


@dataclass(eq=False)
class _Group:
    """One call of one offloaded module: its saved tensors by storage, their copies and the events ordering them."""

    name: str
    layer: int
    chunk: weakref.ref
    entries: dict[int, _Saved] = field(default_factory=dict)      # storage data_ptr -> its saved views
    skip: frozenset[int] = frozenset()      # storages of the module's parameters: never offloaded
    committed: bool = False
    reloading: bool = False
    d2h_event: torch.Event | None = None
    h2d_event: torch.Event | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


class _Chunk:
    """The groups one micro-batch's forward through one model chunk created (in forward order)."""

    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.prefetched_from: float = float("inf")   # the lowest layer whose groups were asked back

    def __repr__(self) -> str:
        return f"_Chunk({len(self.groups)} groups)"


class _Handle:
    """What autograd keeps instead of an offloaded tensor: view ``index`` of ``entry`` (strong references: the
    graph owns the group). A backward that reads it twice gets the same tensor; autograd dropping the handle drops
    the tensor."""

    __slots__ = ("chunk", "entry", "group", "index", "tensor")

    def __init__(self, entry: _Saved, index: int, group: _Group, chunk: _Chunk) -> None:
        self.entry, self.index, self.group, self.chunk = entry, index, group, chunk
        self.tensor: Tensor | None = None


class ActivationOffloader:
    """Host copies of the offloaded modules' saved tensors for one process (see the module docstring).

    ``device``: where the model computes (meta: the regions copy nothing); ``min_tensor_numel``: smaller saved
    tensors stay on the device (Megatron's ``--min-offloaded-tensor-size``). Resources (the two side streams) are per
    process and shared by every layer. ``stats``: bytes copied out per module since the offloader was made."""

    def __init__(self, device: torch.device | str, min_tensor_numel: int = MIN_OFFLOADED_TENSOR_SIZE) -> None:
        if not isinstance(min_tensor_numel, int) or min_tensor_numel < 0:
            raise ValueError(f"--min-offloaded-tensor-size={min_tensor_numel!r} must be an integer >= 0")
        self.device = torch.device(device)
        self.min_tensor_numel = min_tensor_numel
        self.pin = self.device.type == "cuda"
        self._d2h = _side_stream(self.device)
        self._h2d = _side_stream(self.device)
        self._chunk: _Chunk | None = None
        self._open: _Group | None = None
        self.stats: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ forward
    def begin_chunk(self) -> None:
        """A micro-batch's forward through a model chunk starts: its groups go together."""
        self._chunk = _Chunk()

    def end_chunk(self, output: Tensor) -> Tensor:
        """``output`` (the chunk's output) with a gradient hook that brings back its last two layers' groups."""
        chunk = self._chunk
        if chunk is not None and chunk.groups and output.requires_grad:
            last = max(g.layer for g in chunk.groups)
            output.register_hook(lambda _grad: self._prefetch(chunk, last - 1))
        return output

    def region(self, name: str, layer: int, module: nn.Module, inner: Region = PLAIN) -> OffloadRegion:
        """The region a module's forward runs its ``name`` part in (``layer``: its global layer index; ``inner``:
        a region it runs the part through, e.g. a checkpoint)."""
        return OffloadRegion(self, name, layer, module, inner)

    def _enter(self, name: str, layer: int, module: nn.Module) -> contextlib.AbstractContextManager:
        if self.device.type == "meta" or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            # a meta model (built for accounting) has no data to copy; no backward to offload for; a recompute
            # inside backward
            return contextlib.nullcontext()
        if self._open is not None:
            raise RuntimeError(f"offload region {name!r} opened inside {self._open.name!r}")
        if self._chunk is None:
            self.begin_chunk()
        chunk = self._chunk
        skip = frozenset(p.untyped_storage().data_ptr() for p in module.parameters())
        group = _Group(name, layer, weakref.ref(chunk), skip=skip)
        chunk.groups.append(group)
        self._open = group
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, group, chunk), self._unpack)

    def _pack(self, t: Tensor, group: _Group, chunk: _Chunk) -> object:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if (isinstance(t, nn.Parameter) or t.device.type != self.device.type or t.numel() < self.min_tensor_numel
                or key in group.skip or group.committed or storage.nbytes() == 0):
            return t
        entry = group.entries.get(key)
        if entry is None:
            entry = group.entries[key] = _Saved(views=[])
        spec = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        index = next((i for i, known in enumerate(entry.specs) if known == spec), None)
        if index is None:
            index = len(entry.specs)
            entry.specs.append(spec)
            entry.views.append(t)
        entry.uses += 1
        return _Handle(entry, index, group, chunk)

    def _commit(self, group: _Group) -> None:
        """The region's forward ended: copy its tensors to host memory and let the device ones go."""
        self._open = None
        group.committed = True
        if not group.entries:
            return
        compute = torch.accelerator.current_stream(self.device) if self._d2h is not None else None
        if compute is not None:
            self._d2h.wait_stream(compute)
        with host_allocation(), (self._d2h if self._d2h is not None else contextlib.nullcontext()):
            for e in group.entries.values():
                e.copy_out(self.pin)
                if self._d2h is not None:
                    e.views[0].record_stream(self._d2h)   # the block is not reused before the copy finished
                e.views = []   # their geometry is in ``specs``: the device storage is free to go
        if self._d2h is not None:
            group.d2h_event = self._d2h.record_event()
        self.stats[group.name] = self.stats.get(group.name, 0) + group.nbytes

    # ------------------------------------------------------------------------------------------ backward
    def _unpack(self, handle: object) -> Tensor:
        if isinstance(handle, Tensor):
            return handle
        if handle.tensor is not None:
            return handle.tensor
        entry, group, chunk = handle.entry, handle.group, handle.chunk
        if not group.committed:   # still in its forward: the tensor itself
            return entry.views[handle.index]
        if not group.reloading or group.layer - 1 < chunk.prefetched_from:
            self._prefetch(chunk, group.layer - 1, also=group)
        out = entry.view(handle.index)
        if group.h2d_event is not None:
            compute = torch.accelerator.current_stream(self.device)
            compute.wait_event(group.h2d_event)
            out.record_stream(compute)
        handle.tensor = out
        entry.uses -= 1
        if entry.uses == 0:   # every handle of it holds its tensor now: freed with the last of them
            entry.reloaded = None
        return out

    def _prefetch(self, chunk: _Chunk, from_layer: int, also: _Group | None = None) -> None:
        """Bring back every committed group of ``chunk`` from layer ``from_layer`` on (and ``also``)."""
        chunk.prefetched_from = min(chunk.prefetched_from, from_layer)
        for g in chunk.groups:
            if (g.layer >= from_layer or g is also) and g.committed and not g.reloading:
                self._reload(g)

    def _reload(self, group: _Group) -> None:
        group.reloading = True
        if not group.entries:
            return
        if self._h2d is not None:
            self._h2d.wait_stream(torch.accelerator.current_stream(self.device))
            if group.d2h_event is not None:
                self._h2d.wait_event(group.d2h_event)
        with self._h2d if self._h2d is not None else contextlib.nullcontext():
            for e in group.entries.values():
                e.copy_in(self.device, self.pin)
        if self._h2d is not None:
            group.h2d_event = self._h2d.record_event()


class OffloadRegion:
    """A region whose part's saved tensors are offloaded (reusable, reentrant): ``region(fn, *args)`` runs ``fn``
    inside it (through ``inner``, another region, e.g. a checkpoint), ``region.open().run(fn, *args)`` likewise for
    an output region (the output stays), and ``with region:`` around code."""

    recomputes = False

    def __init__(self, offloader: ActivationOffloader, name: str, layer: int, module: nn.Module,
                 inner: Region = PLAIN) -> None:
        self.offloader, self.name, self.layer, self.inner = offloader, name, layer, inner
        self._module = weakref.ref(module)   # the module holds its regions: no cycle
        self._stack: list[tuple[contextlib.AbstractContextManager, _Group | None]] = []

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self:
            return self.inner(fn, *args, **kwargs)

    def open(self) -> OffloadRegion:
        return self

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self:
            return fn(*args)

    def consumed(self, consumer_output: Tensor) -> None:
        return None

    def __enter__(self) -> OffloadRegion:
        hooks = self.offloader._enter(self.name, self.layer, self._module())
        group = self.offloader._open if isinstance(hooks, torch.autograd.graph.saved_tensors_hooks) else None
        hooks.__enter__()
        self._stack.append((hooks, group))
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, group = self._stack.pop()
        hooks.__exit__(*exc)
        if group is not None:
            self.offloader._commit(group)

    def __repr__(self) -> str:
        return f"OffloadRegion({self.name}, layer {self.layer})"


__all__ = ["ActivationOffloader", "OffloadRegion", "host_allocation", "is_host_allocation"]
