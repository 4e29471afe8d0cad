"""Bucketed all-gather of updated parameters, optionally overlapped with the next forward.

After the optimizer updated this rank's chunk of each bucket of the parameter buffers
(``training.optim.buffers``), ``launch()`` all-gathers every bucket of every group larger than one rank,
in place (rank r's chunk is the input, the whole bucket the output), in forward order (the last
bucket in backward order first). Without overlap it then waits for all of them. With
``overlap=True`` (Megatron's ``--overlap-param-gather``) it returns at once: a forward pre-hook on
each module of ``model`` waits for the buckets that hold the parameters of that module's subtree
(for a tied output head, also the embedding's) just before the module runs, so the gathers of later
layers overlap the compute of earlier ones. ``wait_all()`` is the barrier for anything that reads
parameters outside a forward (the next optimizer step, checkpoints, evaluation).

Groups of size 1 (world 1, ep = world for experts, ...) take no collective and no copy. Groups of FP8 primary
weights (``--fp8-param-gather``) gather e4m3 bytes quantised from the fp32 masters and dequantise them into the
parameters when the gather is waited for (``training.optim.fp8_param_gather``).

Deferred buckets (``deferred``: the optimizer offload's, ``training.optim.offload``) have their parameters updated
by a CPU worker after the step returns: their gather (or, in a group of one rank, nothing but the wait) runs when
``wait_deferred()`` has returned, in the pre-hook of the first module that reads them, with or without overlap.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from moefold.dense.embedding import OutputHead
from moefold.training.optim.buffers import Bucket, FlatGroup
from moefold.training.optim.fp8_param_gather import FP8BucketGather, bytes_per_element
from moefold.training.optim.grad_sync import all_gather_into


class _Finish:
    """A work handle whose ``wait`` finishes an FP8 gather (waits and dequantises)."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish = finish

    def wait(self) -> None:
        self._finish()


class _AfterUpdate:
    """A deferred bucket's pending work: the update's wait, then the bucket's gather (None: a group of one)."""

    def __init__(self, wait: Callable[[], None], gather: Callable[[], object] | None) -> None:
        self._wait, self._gather = wait, gather

    def wait(self) -> None:
        self._wait()
        if self._gather is not None:
            self._gather().wait()


class ParamSync:
    """All-gathers the parameter buffers of ``groups``; see the module docstring. Collective: ``launch`` and the
    waits of deferred buckets."""

    def __init__(self, groups: list[FlatGroup], model: nn.Module | None = None, overlap: bool = False,
                 deferred: set[int] | None = None, wait_deferred: Callable[[], None] | None = None) -> None:
        self.all_groups = groups
        self.groups = [g for g in groups if g.size > 1]
        self.overlap = overlap and bool(self.groups)
        self.deferred = deferred or set()
        self._wait_deferred = wait_deferred
        self._handles = []
        # FP8 buckets: their gathers, and the fp32 master chunk each quantises (set by the optimizer)
        self._fp8 = {id(b): FP8BucketGather(g, b) for g in self.groups if g.fp8 for b in g.buckets}
        self.masters: dict[int, Tensor] = {}
        if self.overlap or self.deferred:
            if model is None:
                raise ValueError("ParamSync(overlap=True) needs the model, whose forward waits for the gathers")
            self._register_hooks(model)

    def launch(self) -> None:
        """Start the all-gather of every bucket (forward order); wait for all unless overlapping (deferred buckets
        wait in the forward either way)."""
        for g in self.all_groups:
            for b in reversed(g.buckets):
                gather = self._gather(g, b) if g.size > 1 else None
                if id(b) in self.deferred:
                    b.param_work = _AfterUpdate(self._wait_deferred, gather)
                elif gather is not None:
                    b.param_work = gather()
        if not self.overlap:
            for g in self.groups:
                for b in g.buckets:
                    if id(b) not in self.deferred:
                        self._wait(b)

    def _gather(self, g: FlatGroup, b: Bucket) -> Callable[[], object]:
        """Starts bucket ``b``'s gather and returns its work handle (FP8 buckets: quantise, gather, dequantise)."""
        lo, hi = g.owned(b)
        if id(b) in self._fp8:
            fp8 = self._fp8[id(b)]
            return lambda: _Finish(fp8.launch(self.masters.get(id(b), g.param_data[lo:hi])))
        return lambda: all_gather_into(g.param_data[b.start:b.end], g.param_data[lo:hi], group=g.group, async_op=True)

    def wait_all(self) -> None:
        for g in self.all_groups:
            for b in g.buckets:
                self._wait(b)

    @staticmethod
    def _wait(b: Bucket) -> None:
        if b.param_work is not None:
            b.param_work.wait()
            b.param_work = None

    @property
    def pending(self) -> int:
        """Buckets whose gather has been launched and not yet waited for."""
        return sum(b.param_work is not None for g in self.groups for b in g.buckets)

    def bytes_gathered(self) -> int:
        """Bytes one ``launch`` all-gathers (received by this rank: the whole of every bucket)."""
        return sum((b.end - b.start) * bytes_per_element(g) for g in self.groups for b in g.buckets)

    def _register_hooks(self, model: nn.Module) -> None:
        bucket_of = {id(p): g.buckets[g.bucket_of[i]] for g in self.all_groups for i, p in enumerate(g.params)
                     if (self.overlap and g.size > 1) or id(g.buckets[g.bucket_of[i]]) in self.deferred}
        for module in model.modules():
            if module is model:   # the root's forward reads nothing itself; its children wait for their own
                continue
            params = list(module.parameters())
            if isinstance(module, OutputHead) and module.tied_to is not None:
                params += list(module.tied_to.parameters())   # a tied head reads the embedding's weight
            buckets = list({id(b): b for p in params if (b := bucket_of.get(id(p))) is not None}.values())
            if buckets:
                self._handles.append(module.register_forward_pre_hook(self._hook(buckets)))

    def _hook(self, buckets: list[Bucket]):
        def hook(_module: nn.Module, _args: tuple) -> None:
            for b in buckets:
                if b.param_work is not None:
                    self._wait(b)
        return hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
