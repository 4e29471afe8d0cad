"""Gradient accumulation into flat main-grad buffers and bucketed, backward-overlapped reduce-scatter.

The buffers and who owns which shard: ``training.optim.buffers``. The gradient of the *step* is the sum over
each kind's group divided by ``dp`` (``gradient_average``): the trainer averages micro-batch losses over
dp ranks and micro-batches, and the model's losses are shares that sum over tp x cp (see
``moe.balance_losses``), so any layout yields the world-1 gradient.

Accumulation with gradient-accumulation fusion (``fusion=True``, the trainer's default: Megatron's
``--gradient-accumulation-fusion``, see ``dense.grad_accumulation``): every parameter gets a main-grad slot.
GEMMs that fuse write their weight gradient straight into it (the step's first write is a plain product, later
ones accumulate) and hand autograd a placeholder; every other gradient reaches ``param.grad`` through autograd
(``param.grad`` is None at the start of each step, so autograd takes the fresh tensor over without a copy) and
the post-accumulate hook copies it into ``main_grad`` on its first report of the step and adds it afterwards
(same-dtype parameters are then bound, ``param.grad = main_grad``, so autograd adds later micro-batches in
place). Nothing zeroes the buffers per step: ``finish()`` (and a bucket's launch) zeroes only the parameters
that nothing wrote this step (unused ones). Without fusion: the buffers are zeroed at ``start_step``, and
``param.grad`` *is* ``main_grad`` where the dtypes agree, so autograd accumulates into it in place; a bf16
parameter with fp32 main grads has the hook add its fresh ``param.grad``. On the step's last micro-batch a
bucket launches its async reduce-scatter as soon as all its parameters have reported, so communication
overlaps the rest of the backward. ``finish()`` waits, scales this rank's chunks by ``1/dp`` and sums the
chunks of pipeline-shared parameters over their stages. Afterwards only this rank's chunk of each bucket
holds the reduced gradient (the rest of the buffer is stale): that is what the optimizer reads.
``gathered_grads()`` reassembles the reduced gradients of every parameter (tests, diagnostics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.dense.grad_accumulation import grad_slot, set_grad_slot, widen_into
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group
from moefold.training.optim.buffers import Bucket, FlatGroup, build_flat_groups

# all_gather_single / reduce_scatter_single are the newer names; the old ones warn on recent torch
all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def gradient_average(dims: ParallelDims) -> float:
    """The factor that turns the summed gradients into the step's gradient: 1 / dp."""
    return 1.0 / dims.dp


class GradSync:
    """Owns the flat buffers of ``named_params`` and reduces their gradients (see the module docstring).

    Usage per optimizer step::

        sync.start_step(num_micro)   # each bucket expects num_micro reports per parameter (zeroes without fusion)
        for m in range(num_micro):
            loss_m.backward()        # (or a pipeline schedule's backwards, in any order)
        sync.finish()                # this rank's chunk of each bucket holds the step's gradient

    Collective: the reduce-scatters over each kind's group (from the hooks of the last micro-batch and in
    ``finish()``), the all-reduce of pipeline-shared chunks over their ``copies_groups``, ``gathered_grads()``.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], dims: ParallelDims, *,
                 bucket_numel: int = 2**22, overlap: bool = True, grad_dtype: torch.dtype = torch.float32,
                 copies_groups: Mapping[str, Group] | None = None, reports: Mapping[str, int] | None = None,
                 fusion: bool = True, whole: Callable[[str, nn.Parameter], bool] | None = None) -> None:
        """``reports``: {name: gradient reports per micro-batch} of the parameters whose gradient is accumulated more
        than once per micro-batch (used by two pipeline chunks of this rank, each backpropagated on its own: the
        embedding on the V placement's rank 0 with MTP or a tied head); every other parameter reports once.
        ``copies_groups``: {module name: the pipeline group summing the copies of that module} (the trainer's
        ``pipeline.shared_weight_groups``). ``fusion``: gradient-accumulation fusion (module docstring); False zeroes
        the buffers every step. ``whole(name, param)``: the parameters one rank owns entirely (Muon's matrices,
        ``training.optim.buffers._layout_whole``)."""
        self.dims, self.overlap, self.grad_dtype, self.fusion = dims, overlap, grad_dtype, fusion
        self.reports = dict(reports or {})
        self.average = gradient_average(dims)
        self.groups: list[FlatGroup] = build_flat_groups(named_params, dims, bucket_numel=bucket_numel,
                                                         grad_dtype=grad_dtype, copies_groups=copies_groups,
                                                         whole=whole)
        self._armed = False
        self._handles = []
        for g in self.groups:
            for i, p in enumerate(g.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(g, i)))
                set_grad_slot(p, p.main_grad if fusion else None)
        self._bind_grads()

    def _bind_grads(self) -> None:
        """Unfused: ``param.grad = param.main_grad`` where the dtypes agree (autograd accumulates in place).
        Fused: ``param.grad = None`` (the step's first gradient is taken over, then copied) and fresh slots."""
        for g in self.groups:
            for p in g.params:
                if self.fusion:
                    p.grad = None
                    slot = grad_slot(p)
                    slot.written = slot.fused = False
                else:
                    p.grad = p.main_grad if p.dtype == self.grad_dtype else None

    def _make_hook(self, g: FlatGroup, i: int):
        bucket = g.buckets[g.bucket_of[i]]

        def hook(p: Tensor) -> None:
            slot = grad_slot(p) if self.fusion else None
            if slot is not None:
                if slot.fused:   # a fused GEMM wrote main_grad itself: p.grad is its placeholder
                    slot.fused = False
                    p.grad = None
                elif p.grad is not p.main_grad:   # autograd's fresh gradient (else: already added in place)
                    widen_into(p.main_grad, p.grad, slot.written)
                    slot.written = True
                    p.grad = p.main_grad if p.dtype == self.grad_dtype else None
            elif p.grad is not p.main_grad:   # a separate gradient (other dtype, or .grad was reset)
                widen_into(p.main_grad, p.grad, True)
                p.grad = p.main_grad if p.dtype == self.grad_dtype else None
            if self._armed:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch(g, bucket)
        return hook

    def _zero_unwritten(self, g: FlatGroup, b: Bucket) -> None:
        """Fused: zero the parameters of ``b`` that nothing wrote this step (the buffer holds last step's)."""
        if self.fusion:
            for i in b.params:
                slot = grad_slot(g.params[i])
                if not slot.written:
                    slot.main_grad.zero_()
                    slot.written = True

    def _launch(self, g: FlatGroup, b: Bucket) -> None:
        if b.grad_work is not None:
            return
        self._zero_unwritten(g, b)
        if g.size > 1:
            lo, hi = g.owned(b)
            # in place: rank r's chunk of the bucket receives the sum of every rank's chunk r
            b.grad_work = reduce_scatter_into(g.grad_data[lo:hi], g.grad_data[b.start:b.end], group=g.group,
                                              async_op=True)
        else:
            b.grad_work = True

    def start_step(self, num_micro: int) -> None:
        """Arm the buckets for a step of ``num_micro`` backwards (unfused: zero the gradient buffers first)."""
        for g in self.groups:
            if not self.fusion:
                g.grad_data.zero_()
            for b in g.buckets:
                b.pending = sum(self.reports.get(g.names[i], 1) for i in b.params) * num_micro
                b.grad_work = None
        self._bind_grads()
        self._armed = self.overlap

    def finish(self) -> None:
        """Reduce every bucket not yet launched (unused parameters never report), wait, scale this rank's
        chunks by 1/dp and sum pipeline-shared chunks over their stages."""
        for g in self.groups:
            for b in g.buckets:
                if b.grad_work is None:
                    self._launch(g, b)
        for g in self.groups:
            for b in g.buckets:
                if b.grad_work is not True:
                    b.grad_work.wait()
                b.grad_work = None
                lo, hi = g.owned(b)
                if self.average != 1.0:
                    g.grad_data[lo:hi].mul_(self.average)
                if g.copies_group is not None:
                    dist.all_reduce(g.grad_data[lo:hi], group=g.copies_group)
        self._armed = False

    @property
    def launched_early(self) -> int:
        """Buckets whose reduction started during backward in the current step (before ``finish``)."""
        return sum(b.grad_work is not None for g in self.groups for b in g.buckets)

    def param_bytes(self) -> int:
        """Bytes of this rank's flat parameter buffers."""
        return sum(g.param_data.nbytes for g in self.groups)

    def grad_bytes(self) -> int:
        """Bytes of this rank's flat main-gradient buffers."""
        return sum(g.grad_data.nbytes for g in self.groups)

    def owned_grads(self) -> list[Tensor]:
        """This rank's chunk of every bucket's gradient (views)."""
        return [g.grad_data[slice(*g.owned(b))] for g in self.groups for b in g.buckets]

    @torch.no_grad()
    def gathered_grads(self) -> dict[str, Tensor]:
        """{name: the reduced gradient in the parameter's local shape} after ``finish()``: every rank's chunks
        all-gathered over each group (copies). Collective over every group."""
        out = {}
        for g in self.groups:
            for b in g.buckets:
                full = g.grad_data[b.start:b.end].clone()
                if g.size > 1:
                    lo, hi = g.owned(b)
                    all_gather_into(full, g.grad_data[lo:hi].contiguous(), group=g.group)
                for i in b.params:
                    p, off = g.params[i], g.offsets[i] - b.start
                    out[g.names[i]] = full[off:off + p.numel()].view(p.shape).clone()
        return out

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for g in self.groups:
            for p in g.params:
                set_grad_slot(p, None)
