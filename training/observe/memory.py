"""Memory you can see: what a rank holds (counted), bytes per parameter (computed), peaks (measured).

Static memory per rank (``static_bytes``) is counted from the tensors themselves: the flat parameter
and main-grad buffers of ``GradSync`` and the optimizer's slices. ``bytes_per_parameter`` is the same
arithmetic per parameter for a precision choice and a shard count, Megatron's table.

Peaks are measured (``measure_peak``), one phase at a time (e.g. one forward + backward):

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
  before the phase ("cuda_max_allocated");
- elsewhere: ``TensorMemoryTracker`` ("tensor_tracker"), a ``TorchDispatchMode`` that adds the bytes of
  every storage an operator creates, subtracts them when the storage is freed (a ``weakref.finalize`` on
  the storage) and follows in-place storage resizes (the output-discarding recompute frees and refills
  storages that way). It counts tensor bytes, not allocator caching or fragmentation, and slows the phase
  down (a Python call per operator): a measurement tool, not for every training step. The CPU workspace
  pool (``dense.workspace``) drops its free buffers first: a buffer made before the phase and reused in
  it would go unseen, one made in it counts while the pool holds it (memory the process really keeps), so
  the phase's figure no longer depends on what ran before it. The pool's free buffers count as held, not net of
  the free list: they are resident pages the process keeps (glibc would have unmapped buffers that large), so a
  user's peak includes them; a pooled buffer that lives for one call only would be paid for through the whole
  backward (``dispatch.permutation`` pools only its outputs for that reason, issue 52).

The metrics line uses the cheap per-interval peaks of ``interval_peak``: CUDA max allocated since the last
call, or on CPU the process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``;
elsewhere ``ru_maxrss``, the peak since the process started).
"""

from __future__ import annotations

import resource
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moefold.dense.workspace import workspace
from moefold.execution.offloader import is_host_allocation
from moefold.training.optim.precision import OptimizerPrecision

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ----------------------------------------------------------------------------------------- counted
def static_bytes(sync: Any, optimizer: Any) -> dict[str, int]:
    """{"params", "grads", "optimizer", "master", "exp_avg", "exp_avg_sq", "host_optimizer"}: bytes this rank
    holds on its device in ``sync``'s buffers (``GradSync``) and ``optimizer``'s state (``DistributedAdamW``),
    and in host memory for the optimizer offload (``host_optimizer``: masters, moments and gradient copies)."""
    states = optimizer.state_breakdown()
    return {"params": sync.param_bytes(), "grads": sync.grad_bytes(), "optimizer": sum(states.values()), **states,
            "host_optimizer": optimizer.host_bytes()}


def bytes_per_parameter(param_dtype: str, precision: OptimizerPrecision, shards: int) -> float:
    """Bytes one parameter costs a rank: its value, its main grad, and 1/``shards`` of its optimizer state
    (fp32 master only when the parameter is not fp32 itself, exp_avg, exp_avg_sq)."""
    value, grad, state = state_parts(param_dtype, precision)
    return value + grad + state / shards


def state_parts(param_dtype: str, precision: OptimizerPrecision) -> tuple[int, int, int]:
    """Bytes per parameter of (its value, its main grad, its whole optimizer state)."""
    state = sum(optimizer_state_parts(param_dtype, precision).values())
    return DTYPE_BYTES[param_dtype], DTYPE_BYTES[precision.main_grads_dtype], state


def optimizer_state_parts(param_dtype: str, precision: OptimizerPrecision) -> dict[str, int]:
    """{"master", "exp_avg", "exp_avg_sq"}: optimizer-state bytes per (unsharded) parameter; the fp32 master
    only when the parameter is not itself in the master dtype (``DistributedAdamW``'s slices)."""
    master = DTYPE_BYTES[precision.main_params_dtype] if param_dtype != precision.main_params_dtype else 0
    return {"master": master, "exp_avg": DTYPE_BYTES[precision.exp_avg_dtype],
            "exp_avg_sq": DTYPE_BYTES[precision.exp_avg_sq_dtype]}


def describe_static(sync: Any, optimizer: Any, param_dtype: str, precision: OptimizerPrecision) -> str:
    """The start-up line: this rank's bytes and the bytes per parameter of each reduction group."""
    b = static_bytes(sync, optimizer)
    mib = lambda n: f"{n / 2**20:.1f} MiB"
    states = ", ".join(f"{k} {mib(b[k])}" for k in ("master", "exp_avg", "exp_avg_sq") if b[k])
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    per_group = {}
    for g in sync.groups:
        dtype = names[g.param_data.dtype]
        value, grad, state = state_parts(dtype, precision)
        label = g.kind if dtype == param_dtype else f"{g.kind} ({dtype})"
        per_group[label] = f"{bytes_per_parameter(dtype, precision, g.size):g} = {value} + {grad} + {state}/{g.size}"
    host = f"; optimizer offload: {mib(b['host_optimizer'])} in host memory" if b["host_optimizer"] else ""
    return (f"memory: params {mib(b['params'])}, main grads {mib(b['grads'])}, optimizer {mib(b['optimizer'])} "
            f"({states}{host}); bytes per parameter ({param_dtype} params, {precision.main_grads_dtype} main grads, "
            f"{precision.exp_avg_dtype}/{precision.exp_avg_sq_dtype} moments; value + grad + states/shards): "
            + ", ".join(f"{k} {v}" for k, v in per_group.items()))


# ----------------------------------------------------------------------------------------- measured
class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages on ``device_type`` that operators create while active
    (storages that existed before are not counted, even when written in place); ``largest``: the largest of
    those storages. See the module docstring.

    Activation offloading's host copies (``dense.activation_offload.host_allocation``) are counted apart:
    ``offloaded`` / ``offloaded_peak`` (on the CPU they are CPU tensors too, but not the device's memory)."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, int] = {}
        self.host: set[int] = set()
        self.current = self.peak = self.largest = 0
        self.offloaded = self.offloaded_peak = 0
        self._resize = None

    def __enter__(self) -> TensorMemoryTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:   # storage.resize_ bypasses dispatch
            out = original(storage, size)
            tracker._update(storage)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        host = is_host_allocation()
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and (t.device.type == self.device_type or (host and t.device.type == "cpu")):
                storage = t.untyped_storage()
                key = id(storage)
                if key in self.live:
                    self._update(storage)
                elif key not in inputs:   # a new allocation (views and in-place results share an input's)
                    self.live[key] = 0
                    if host:
                        self.host.add(key)
                    weakref.finalize(storage, self._freed, key)
                    self._update(storage)
        return out

    def _update(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live:
            n = storage.nbytes()
            change = n - self.live[key]
            self.live[key] = n
            if key in self.host:
                self.offloaded += change
                self.offloaded_peak = max(self.offloaded_peak, self.offloaded)
                return
            self.current += change
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, n)

    def _freed(self, key: int) -> None:
        n = self.live.pop(key, 0)
        if key in self.host:
            self.host.discard(key)
            self.offloaded -= n
        else:
            self.current -= n

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass(frozen=True)
class PeakMemory:
    """bytes: the phase's peak above what was allocated when it began; method: how it was measured."""

    bytes: int
    method: str


def measure_peak(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, PeakMemory]:
    """(``fn()``, its peak memory). CUDA: allocator statistics; other devices: ``TensorMemoryTracker``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        return out, PeakMemory(torch.cuda.max_memory_allocated(dev) - base, "cuda_max_allocated")
    # the tracker sees only storages created inside: a workspace buffer made before would be reused unseen
    workspace(dev).release()
    with TensorMemoryTracker(dev.type) as tracker:
        out = fn()
    return out, PeakMemory(tracker.peak, "tensor_tracker")


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # Linux >= 4.0: reset the peak resident set size to the current one
        return True
    except OSError:
        return False


def interval_peak(device: torch.device | str = "cpu") -> tuple[int, str]:
    """(peak bytes since the previous call, method) and restart the interval. CUDA: "cuda_max_allocated";
    CPU: "rss_hwm" (resettable on Linux) or "ru_maxrss" (peak since the process started)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return peak, "cuda_max_allocated"
    hwm = _read_hwm()
    if hwm is not None and _reset_hwm():
        return hwm, "rss_hwm"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
