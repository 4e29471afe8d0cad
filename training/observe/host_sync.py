"""Count the operations that make the host wait for a CUDA device, on any device (CPU included).

    with HostSyncCounter() as syncs:
        y, info = moe_layer(x)
        (y.sum() + info.aux_loss).backward()
    print(syncs.total, syncs.report())

A CUDA kernel launch returns at once; the host waits for the device (a *host synchronisation*)
only when it needs a value the device computes: a scalar read (``.item()``, ``int(t)``,
``if t:``), a device->host copy (``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``), a
blocking host->device copy of Python data (``torch.tensor(data, device=x.device)``,
``x.new_tensor(data)``: PyTorch synchronises the stream after such a copy), or an operator whose
output *size* depends on the data (``nonzero``, ``masked_select``, ``unique``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``) or whose CUDA implementation reads a
value back itself (``bincount`` reads min/max, ``histc`` with ``min == max`` reads the range,
``torch._grouped_mm`` outside bf16 falls back to a loop that copies the offsets to the host:
its CUTLASS kernel is bf16-only, on sm90/sm100 GPUs; older GPUs fall back in bf16 too, which
this model of a Hopper-class GPU does not count).

``HostSyncCounter`` is a ``TorchDispatchMode`` that counts those aten operators, plus wrappers
of the Python-level reads (``tolist``/``cpu``/``numpy``/``to``/``tensor``/``new_tensor``) that
never reach the dispatcher for CPU tensors. On CPU it counts what *would* synchronise if every
tensor lived on the GPU, which is how the CPU tests prove a sync budget; on CUDA it counts the
real thing (cross-check with ``torch.cuda.set_sync_debug_mode("warn")``, which the GPU check does).
Inside the counter's block CPU tensors take the GPU's code paths (``moe.cpu.shortcuts``): host work a
CPU-only shortcut does, free on a CPU and never done on a GPU, is neither run nor counted.

Rules for the CPU count (documented so that the numbers mean something):

- every tensor stands for a device tensor, so a read of it counts;
- a move counts when it names the host: ``.cpu()``, ``.numpy()``, ``.tolist()``, ``.to("cpu")``;
  ``.to(x.device)`` (same device) does not;
- a tensor built from Python data counts when it is placed on the compute device:
  ``x.new_tensor(data)`` and ``torch.tensor(data, device=d)`` with ``d`` not the string "cpu";
  ``torch.tensor(data)`` / ``device="cpu"`` build host tensors and do not count;
- collectives (``torch.distributed``) do not count: they wait for their peers, not for the host.

Operators running inside libraries' own C++ (DeepEP's dispatch waits on the host for its
received counts; the GEMM libraries take host split sizes) are outside torch's dispatcher and
not counted; ``paused()`` excludes code on purpose (a test's stand-in for such a library).

The Python-level wrappers patch ``torch.Tensor`` methods while the counter is active, so use
one counter at a time, from one thread (a test, a benchmark). Autograd's backward on CPU runs
on the calling thread, so backward passes are counted too; CUDA backward runs on autograd's
device threads, where only the Python-level reads are seen: on CUDA use the sync debug mode.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.moe.cpu.shortcuts import gpu_code_paths

aten = torch.ops.aten

# operators that synchronise on CUDA whatever their arguments
_ALWAYS = {
    aten._local_scalar_dense.default: "scalar read (.item()/int()/bool())",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount (reads min/max on the host)",
    aten.equal.default: "equal",
    aten.is_nonzero.default: "is_nonzero",
}
_ALWAYS_PACKETS = ("_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive")
_BOOL = (torch.bool, torch.uint8)


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _BOOL for i in (indices or ()))


def _names_host(device: Any) -> bool:
    """The device argument names the host literally (a string, or an explicit CPU device)."""
    return device == "cpu" or (isinstance(device, str) and device.startswith("cpu"))


def _to_target(args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
    return None


def _is_cpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


class HostSyncCounter(TorchDispatchMode):
    """Counts host synchronisations (see the module docstring); ``total``, ``counts``, ``report()``.

    ``counts`` maps a reason to its number; ``sites`` maps a reason to the innermost moefold
    source line that caused it (the first one seen), to find and fix an unexpected sync;
    ``per_site`` counts every sync by that source line (``"training/trainer.py:284"``), so a test can
    pin the budget of one file (the trainer's one copy per step) apart from the layers' own.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: dict[str, str] = {}
        self.per_site: collections.Counter[str] = collections.Counter()
        self._paused = 0
        self._saved: dict[tuple[Any, str], Any] = {}

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, reason: str) -> None:
        if self._paused:
            return
        self.counts[reason] += 1
        site = _caller_site()
        self.per_site[site] += 1
        self.sites.setdefault(reason, site)

    def report(self) -> str:
        """One line per reason: count, reason, where it first happened."""
        if not self.counts:
            return "no host synchronisation"
        return "\n".join(f"{n:4d}  {reason}  ({self.sites.get(reason, '?')})"
                         for reason, n in self.counts.most_common())

    def reset(self) -> None:
        self.counts.clear()
        self.sites.clear()
        self.per_site.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count inside this block (e.g. a stand-in for a library's own C++)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- aten operators ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _ALWAYS.get(func)
        if reason is None:
            reason = self._classify(func, args, kwargs)
        if reason is not None:
            self._count(reason)
        return func(*args, **kwargs)

    @staticmethod
    def _classify(func, args: tuple, kwargs: dict) -> str | None:
        packet = func.overloadpacket.__name__
        if packet in _ALWAYS_PACKETS:
            return packet
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
        if func is aten.index.Tensor and _has_bool_index(args[1] if len(args) > 1 else None):
            return "boolean-mask indexing"
        if packet in ("index_put", "index_put_", "_index_put_impl_") and _has_bool_index(
                args[1] if len(args) > 1 else kwargs.get("indices")):
            return "index_put with a boolean mask"
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return "grouped_mm outside bf16 (torch's fallback reads the offsets on the host)"
        if func is aten.histc.default:
            lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
            hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
            if lo == hi:
                return "histc without a range (reads min/max on the host)"
        if packet in ("_to_copy", "copy_"):  # real cross-device copies (CUDA runs)
            src = args[1] if packet == "copy_" else args[0]
            dst_device = args[0].device if packet == "copy_" else (kwargs.get("device") or args[0].device)
            src_device = src.device if isinstance(src, torch.Tensor) else None
            if src_device is not None and dst_device is not None:
                dst_type = torch.device(dst_device).type
                if src_device.type != "cpu" and dst_type == "cpu":
                    return "device->host copy"
                if src_device.type == "cpu" and dst_type != "cpu" and not kwargs.get("non_blocking", False):
                    return "blocking host->device copy"
        return None

    # -- Python-level reads of CPU tensors (they never reach the dispatcher) ------------------
    def __enter__(self):
        counter = self
        T = torch.Tensor

        def wrap(owner: Any, name: str, reason_of):
            original = getattr(owner, name)
            self._saved[(owner, name)] = (name in vars(owner), original)

            def wrapper(*args, **kwargs):
                reason = reason_of(args, kwargs)
                if reason is not None:
                    counter._count(reason)
                return original(*args, **kwargs)

            wrapper.__wrapped__ = original
            setattr(owner, name, wrapper)

        wrap(T, "tolist", lambda a, k: "device->host copy (.tolist())" if _is_cpu(a[0]) else None)
        wrap(T, "cpu", lambda a, k: "device->host copy (.cpu())" if _is_cpu(a[0]) else None)
        wrap(T, "numpy", lambda a, k: "device->host copy (.numpy())" if _is_cpu(a[0]) else None)
        wrap(T, "to", lambda a, k: "device->host copy (.to('cpu'))"
             if _is_cpu(a[0]) and _names_host(_to_target(a, k)) else None)
        wrap(T, "new_tensor", lambda a, k: "host->device copy of Python data (new_tensor)"
             if _is_cpu(a[0]) else None)
        wrap(torch, "tensor", lambda a, k: "host->device copy of Python data (torch.tensor(device=...))"
             if k.get("device") is not None and not _names_host(k["device"])
             and torch.device(k["device"]).type == "cpu" else None)
        # the block runs the GPU's code paths: a CPU-only shortcut's host read is no GPU sync (moe.cpu.shortcuts)
        self._gpu_paths = gpu_code_paths()
        self._gpu_paths.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        self._gpu_paths.__exit__(None, None, None)
        for (owner, name), (own, original) in self._saved.items():
            if own:
                setattr(owner, name, original)
            else:  # an inherited method: drop the shadowing wrapper
                delattr(owner, name)
        self._saved.clear()


def _caller_site() -> str:
    """The innermost stack frame in moefold's own code (not this module, not a test's stand-in)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/host_sync.py" in path or "/torch/" in path:
            continue
        return f"{path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


__all__ = ["HostSyncCounter"]
