"""Gradient accumulation in fp32 and bucketed, backward-overlapped reduction over the right groups.

Every trainable parameter belongs to one *reduction kind*:

- ``expert``  (``param.moefold_expert``): summed over ``edp`` (the other expert replicas);
- ``sp``      (``parallel.sharding.is_sequence_parallel``): replicated over tp but with a partial
              gradient under sequence parallelism, summed over ``tp x cp x dp``;
- ``dense``   (everything else): summed over ``dp x cp``.

The gradient of the *step* is then the sum over those ranks divided by ``dp`` (the trainer averages
micro-batch losses over dp ranks and micro-batches; the model's losses are shares that sum over
tp x cp, see ``moe.balance_losses``), so any layout yields the world-1 gradient.

Each kind keeps one flat fp32 buffer (``param.main_grad`` is a view into it), padded to a multiple
of the group size so ZeRO-1 can cut it into equal shards (``training.optimizer``). A post-accumulate
hook adds each fresh ``param.grad`` into ``main_grad`` (fp32 accumulation also for bf16 models) and
frees it. On the step's last micro-batch a bucket (a contiguous range of the buffer, filled in
backward order) launches its async all-reduce as soon as all its parameters have reported, so
communication overlaps the rest of the backward; ``finish()`` waits for every bucket and scales.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group, group_size
from moefold.parallel.sharding import is_sequence_parallel

KINDS = ("dense", "sp", "expert")


def reduction_kind(param: Tensor) -> str:
    """Which group reduces ``param``'s gradient: "expert", "sp" or "dense"."""
    if getattr(param, "moefold_expert", False):
        return "expert"
    if is_sequence_parallel(param):
        return "sp"
    return "dense"


def kind_group(kind: str, dims: ParallelDims) -> Group:
    """The process group that sums gradients of ``kind``."""
    if kind == "expert":
        return dims.edp_group
    if kind == "sp":
        return dims.tp_cp_dp_group
    if kind == "dense":
        return dims.dp_cp_group
    raise ValueError(f"unknown reduction kind {kind!r}; valid: {KINDS}")


@dataclass
class _Bucket:
    start: int
    end: int
    num_params: int
    pending: int = 0
    work: object | None = None


@dataclass
class FlatGroup:
    """The parameters of one reduction kind laid out in one flat fp32 buffer.

    ``offsets[i]`` is where ``params[i]`` starts; ``numel`` the padded length (a multiple of the group
    size); ``grad`` the buffer (fp32 [numel]).
    """

    kind: str
    group: Group
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    grad: Tensor
    buckets: list[_Bucket] = field(default_factory=list)
    bucket_of: list[int] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return group_size(self.group)


class GradSync:
    """Owns the fp32 gradient buffers of ``named_params`` and reduces them (see the module docstring).

    Usage per optimizer step::

        sync.start_step(num_micro)   # zero the buffers; each bucket expects num_micro reports per parameter
        for m in range(num_micro):
            loss_m.backward()        # (or a pipeline schedule's backwards, in any order)
        sync.finish()                # main_grad now holds the step's gradient on every rank of the group

    A bucket launches its all-reduce when its parameters have reported ``num_micro`` times in total
    each (the last backward that touches them), whatever the micro-batch order.

    Collective: ``finish()`` (and the hooks on the last micro-batch) all-reduce over each kind's group.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], dims: ParallelDims,
                 bucket_numel: int = 2**22, overlap: bool = True) -> None:
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
        self.dims, self.overlap = dims, overlap
        self.scale = 1.0 / dims.dp
        by_kind: dict[str, list[tuple[str, nn.Parameter]]] = {k: [] for k in KINDS}
        for name, p in named_params:
            if p.requires_grad:
                by_kind[reduction_kind(p)].append((name, p))
        self.groups: list[FlatGroup] = []
        for kind in KINDS:
            # reversed registration order ~ the order in which backward produces the gradients
            items = list(reversed(by_kind[kind]))
            if items:
                self.groups.append(self._layout(kind, items, bucket_numel))
        self._armed = False
        self._handles = []
        for g in self.groups:
            for i, p in enumerate(g.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(g, i)))

    def _layout(self, kind: str, items: list[tuple[str, nn.Parameter]], bucket_numel: int) -> FlatGroup:
        group = kind_group(kind, self.dims)
        n = group_size(group)
        offsets, total = [], 0
        for _, p in items:
            offsets.append(total)
            total += p.numel()
        padded = -(-max(total, 1) // n) * n
        device = items[0][1].device
        grad = torch.zeros(padded, dtype=torch.float32, device=device)
        g = FlatGroup(kind=kind, group=group, names=[nm for nm, _ in items], params=[p for _, p in items],
                      offsets=offsets, numel=padded, grad=grad)
        start, count = 0, 0
        for i, (_, p) in enumerate(items):
            p.main_grad = grad[offsets[i]:offsets[i] + p.numel()].view(p.shape)
            g.bucket_of.append(len(g.buckets))
            count += 1
            end = offsets[i] + p.numel()
            if end - start >= bucket_numel or i == len(items) - 1:
                g.buckets.append(_Bucket(start, padded if i == len(items) - 1 else end, count))
                start, count = end, 0
        return g

    def _make_hook(self, g: FlatGroup, i: int):
        def hook(p: Tensor) -> None:
            p.main_grad.add_(p.grad.view(p.main_grad.shape))
            p.grad = None
            if self._armed:
                b = g.buckets[g.bucket_of[i]]
                b.pending -= 1
                if b.pending == 0:
                    self._launch(g, b)
        return hook

    def _launch(self, g: FlatGroup, b: _Bucket) -> None:
        if b.work is not None:
            return
        if g.group_size > 1:
            b.work = dist.all_reduce(g.grad[b.start:b.end], group=g.group, async_op=True)
        else:
            b.work = True

    def start_step(self, num_micro: int) -> None:
        """Clear the gradient buffers and arm the buckets for a step of ``num_micro`` backwards."""
        for g in self.groups:
            g.grad.zero_()
            for p in g.params:
                p.grad = None
            for b in g.buckets:
                b.pending, b.work = b.num_params * num_micro, None
        self._armed = self.overlap

    def finish(self) -> None:
        """Reduce every bucket not yet launched (unused parameters never report), wait, scale by 1/dp."""
        for g in self.groups:
            for b in g.buckets:
                if b.work is None:
                    self._launch(g, b)
        for g in self.groups:
            for b in g.buckets:
                if b.work is not True and b.work is not None:
                    b.work.wait()
                b.work = None
            if self.scale != 1.0:
                g.grad.mul_(self.scale)
        self._armed = False

    @property
    def launched_early(self) -> int:
        """Buckets whose reduction started during backward in the current step (before ``finish``)."""
        return sum(b.work is not None for g in self.groups for b in g.buckets)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
