"""Optimizer offload (Megatron's ``--optimizer-cpu-offload --optimizer-offload-fraction F``): the master weights and
Adam moments of a fraction of this rank's shard live in host memory and are updated on the CPU.

Which part: whole buckets of the distributed optimizer (``training.optim.buffers``), in the groups' order and, in
each group, in bucket order (the order backward fills them: the last layers first), until ``F`` of this rank's
owned elements are offloaded. Every rank of a group owns equally large chunks of the same buckets, so the ranks
agree on the buckets and issue the parameter all-gathers in the same order. The first buckets are the ones the
next forward needs last, which leaves the CPU update the most time.

One step (``HostOptimizer``):

- main thread: the offloaded chunks' reduced gradients are copied to (pinned) host buffers on a side stream after
  an event from the compute stream; the compute stream waits for the copy's event before it reuses the gradient
  buffer (no host wait); the update is handed to a worker thread; the device's own AdamW runs meanwhile;
- worker thread: waits for the copy, clips, widens bf16 gradients/moments like ``DistributedAdamW``, runs
  ``torch.optim.AdamW`` on the CPU (the fused CPU kernel), narrows the moments back and copies the new masters into
  the parameters on another side stream;
- the parameter all-gather of an offloaded bucket (or, in a group of one rank, just the parameters' readiness) is
  deferred (``training.optim.param_sync``): the forward pre-hook of the first module that reads the bucket waits
  for the worker and that copy, then gathers. So the next step's forward starts on the device while the CPU still
  updates the parameters of its later layers; ``DistributedAdamW.finish_param_sync`` waits for all of it.

The update is the one the device would do: the same ``torch.optim.AdamW`` arithmetic on the same values (on the
CPU the same fused kernel, bit for bit; a CUDA device's fused kernel may round differently in the last bit).
Checkpoints are unchanged: an offloaded fp32 master is the parameter's value (``optim.<p>.master`` is saved only
for bf16 parameters), its moments are saved from host memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moefold.training.optim.buffers import Bucket, FlatGroup


def check_offload_fraction(fraction: float) -> float:
    """``fraction`` if it lies in [0, 1], else ValueError naming the flag."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction={fraction!r} must be a number in [0, 1]")
    return float(fraction)


def offloaded_buckets(groups: Iterable[FlatGroup], fraction: float) -> set[int]:
    """``id``s of the buckets whose optimizer state this rank keeps in host memory (module docstring)."""
    chunks = [(b, (b.end - b.start) // g.size) for g in groups for b in g.buckets]
    budget = check_offload_fraction(fraction) * sum(n for _, n in chunks)
    out, done = set(), 0
    for b, n in chunks:
        if done >= budget or n == 0:
            break
        out.add(id(b))
        done += n
    return out


def host_device(device: torch.device) -> torch.device:
    """Where offloaded states live: the host, or the meta device when the model is built for accounting only."""
    return torch.device("meta") if device.type == "meta" else torch.device("cpu")


def _side_stream(device: torch.device) -> torch.Stream | None:
    accelerator = torch.accelerator.current_accelerator()
    return torch.Stream(device=device) if accelerator is not None and device.type == accelerator.type else None


class HostOptimizer:
    """Runs the offloaded slices' updates (``updates``: ``_Update`` objects over ``HostSlice``s) on the CPU in a
    worker thread; see the module docstring. ``buckets``: the buckets they cover."""

    def __init__(self, slices: list, updates: list, buckets: list[Bucket], device: torch.device) -> None:
        self.slices, self.updates, self.buckets = slices, updates, buckets
        self.device = device
        self._d2h, self._h2d = _side_stream(device), _side_stream(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moefold-cpu-adamw") if slices else None
        self._future: Future | None = None
        self._ready: torch.Event | None = None

    @property
    def pending(self) -> bool:
        """An update was started and not yet waited for."""
        return self._future is not None

    def start(self, lr: float, clip_coef: float) -> None:
        """Copy the gradients out and start the update in the worker (returns at once)."""
        if not self.slices:
            return
        copied = None
        compute = torch.accelerator.current_stream(self.device) if self._d2h is not None else None
        if compute is not None:
            self._d2h.wait_stream(compute)
        with self._d2h if self._d2h is not None else contextlib.nullcontext():
            for s in self.slices:
                s.grad.copy_(s.device_grad, non_blocking=self._d2h is not None)
        if compute is not None:
            copied = self._d2h.record_event()
            compute.wait_event(copied)   # the next step's zeroing of the gradient buffer waits for the copy
        self._future = self._pool.submit(self._run, lr, clip_coef, copied)

    @torch.no_grad()
    def _run(self, lr: float, clip_coef: float, copied: torch.Event | None) -> None:
        if copied is not None:
            copied.synchronize()   # the worker thread waits for the gradients, not the training loop
        for update in self.updates:
            update.step(lr, clip_coef)
        with self._h2d if self._h2d is not None else contextlib.nullcontext():
            for s in self.slices:
                s.param.copy_(s.master, non_blocking=self._h2d is not None)
        self._ready = self._h2d.record_event() if self._h2d is not None else None

    def wait(self) -> None:
        """Block until the update finished; the compute stream then waits for the parameters' copy. Idempotent."""
        if self._future is None:
            return
        future, self._future = self._future, None
        future.result()   # re-raises a failure of the worker
        if self._ready is not None:
            torch.accelerator.current_stream(self.device).wait_event(self._ready)
            self._ready = None

    def close(self) -> None:
        if self._pool is not None:
            self.wait()
            self._pool.shutdown()
