"""Hardware numbers for the metrics line: peak FLOP/s (table or measured), MFU, memory in use.

Peak FLOP/s, so that MFU is comparable across runs: NVIDIA/AMD accelerators with a known name use the
vendor's dense (no sparsity) bf16/fp16 tensor-core figure from ``GPU_PEAK_BF16_TFLOPS``; anything else
(CPUs, unknown GPUs, fp32) uses ``measure_matmul_peak`` (the best rate of a square matmul in a timed loop)
ONCE per machine: the figure is cached in ``$XDG_CACHE_HOME/moefold/peak_flops.json`` (default
``~/.cache/moefold``) under a key naming the device kind, dtype, torch's CPU capability and thread count, and
every later run on that machine divides by the same number, whatever the load then. ``device_peak`` returns
the figure with its source (the table row, or the cache entry with when and under what load it was measured),
which the run record of metrics.jsonl names. Delete the file (or its entry) to measure again; edit an entry's
``flops_per_s`` to divide by a data-sheet figure instead.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PEAK_CACHE_FILE = "peak_flops.json"

# Dense bf16/fp16 tensor-core peak per device, TFLOP/s, from the vendors' data sheets. Matched in
# order against the device name, so the more specific names come first.
GPU_PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def table_peak_flops(device_name: str) -> float | None:
    """FLOP/s for a known accelerator name (bf16/fp16 dense), else None."""
    for key, tflops in GPU_PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


@functools.cache  # one measurement per process and (device, dtype): hardware does not change
def measure_matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                        seconds: float = 0.3) -> float:
    """Best FLOP/s of an ``n x n @ n x n`` matmul on ``device`` over a ``seconds`` loop (2 n^3 FLOPs each)."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.matmul(a, b)  # warm-up: kernel selection, thread pool start
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / dt)
        if time.perf_counter() > deadline:
            return best


@dataclass(frozen=True)
class PeakFlops:
    """One device's peak FLOP/s and where the figure comes from (named in metrics.jsonl's run record)."""

    flops_per_s: float
    source: str   # "table: NVIDIA H100 (bf16 dense)" or "measured: <key>, <date>, load <x> (cached in <file>)"


def peak_cache_path() -> Path:
    """``$XDG_CACHE_HOME/moefold/peak_flops.json`` (default ``~/.cache/moefold/peak_flops.json``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moefold" / PEAK_CACHE_FILE


def _device_kind(dev: torch.device) -> str:
    """What the measured peak depends on: the device's name; on the CPU also torch's kernel level and threads."""
    if dev.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(dev)}"
    from moefold.training.observe.machine import machine_info

    info = machine_info()
    return f"{dev.type} {info.cpu_model}, capability {info.cpu_capability}, {info.threads} threads"


def _read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}   # absent or damaged: measure again (and rewrite it)
    return entries if isinstance(entries, dict) else {}


def cached_peak(key: str, measure, path: Path | None = None) -> PeakFlops:
    """The peak cached under ``key`` in ``path`` (default ``peak_cache_path()``), or ``measure()`` once, stored
    there atomically (a temporary file renamed over the cache, so concurrent runs never read half a file)."""
    path = path or peak_cache_path()
    entry = _read_cache(path).get(key)
    usable = isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float))
    if not (usable and entry["flops_per_s"] > 0):
        try:
            load = round(os.getloadavg()[0], 2)
        except OSError:
            load = None
        entry = {"flops_per_s": float(measure()), "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "load": load}
        entries = {**_read_cache(path), key: entry}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError as exc:   # a read-only home: this run's MFU uses the figure, the next one measures again
            return PeakFlops(entry["flops_per_s"], f"measured: {key}, load {load} (not cached: {exc})")
    when = f", {entry['measured']}" if entry.get("measured") else ""
    load = f", load {entry['load']}" if entry.get("load") is not None else ""
    return PeakFlops(float(entry["flops_per_s"]), f"measured: {key}{when}{load} (cached in {path})")


def device_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> PeakFlops:
    """Peak FLOP/s of one device for ``dtype`` matmuls and its source: the table for known GPUs in bf16/fp16,
    else measured once per machine and cached (``cached_peak``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(dev)
        known = table_peak_flops(name)
        if known is not None:
            return PeakFlops(known, f"table: {name} ({str(dtype).removeprefix('torch.')} dense, data sheet)")
    # CPU bf16 matmul is often emulated and slower than fp32; the trainer's CPU runs are fp32 anyway.
    measure_dtype = dtype if dev.type == "cuda" else torch.float32
    key = f"{_device_kind(dev)}, {str(measure_dtype).removeprefix('torch.')}"
    n = 4096 if dev.type == "cuda" else 1024
    return cached_peak(key, lambda: measure_matmul_peak(str(dev), measure_dtype, n=n, seconds=1.0))


def peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> float:
    """``device_peak(device, dtype).flops_per_s``."""
    return device_peak(device, dtype).flops_per_s


def achieved_flops(tokens_per_s: float, flops_per_token: float) -> float:
    """Model FLOP/s actually done: tokens/s x FLOPs per token (forward + backward)."""
    return tokens_per_s * flops_per_token


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over peak FLOP/s.

    Give all three for the same set of devices (e.g. global tokens/s with ``peak x world size``).
    """
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s={peak_flops_per_s} must be positive")
    return achieved_flops(tokens_per_s, flops_per_token) / peak_flops_per_s


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), else its peak from getrusage."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def nvml_device_memory(index: int) -> tuple[int, int] | None:
    """(used, total) bytes of GPU ``index`` as NVML sees it (all processes), or None without pynvml/driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return int(info.used), int(info.total)
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def memory_stats(device: torch.device | str = "cpu") -> dict[str, float]:
    """GiB figures for the metrics line, peaks over the interval since the previous call
    (``training.observe.memory.interval_peak``). CUDA: ``max_allocated_gib`` (torch's peak allocation) and
    ``device_used_gib``/``device_total_gib`` (NVML); CPU: ``peak_rss_gib`` (the process's peak resident
    set); always ``rss_gib`` (host process now)."""
    from moefold.training.observe.memory import interval_peak

    dev = torch.device(device)
    out: dict[str, float] = {"rss_gib": rss_bytes() / 2**30}
    peak, _method = interval_peak(dev)
    if dev.type == "cuda":
        out["max_allocated_gib"] = peak / 2**30
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        # NVML numbers devices physically; CUDA_VISIBLE_DEVICES renumbers them for torch.
        to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)
        nv = nvml_device_memory(to_nvml(index) if to_nvml is not None else index)
        if nv is not None:
            out["device_used_gib"], out["device_total_gib"] = nv[0] / 2**30, nv[1] / 2**30
    else:
        out["peak_rss_gib"] = peak / 2**30
    return out
