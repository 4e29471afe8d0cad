"""Hardware numbers for the metrics line: peak FLOP/s (table or measured), MFU, memory in use.

Peak FLOP/s: NVIDIA/AMD accelerators with a known name use the vendor's dense (no sparsity)
bf16/fp16 tensor-core figure from ``GPU_PEAK_BF16_TFLOPS``; anything else (CPUs, unknown GPUs, fp32)
uses ``measure_matmul_peak``: the best rate of a square matmul in a short timed loop, measured once
per process and (device, dtype).
"""

from __future__ import annotations

import functools
import os
import resource
import time

import torch

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


def peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak FLOP/s of one device for ``dtype`` matmuls: the table for known GPUs in bf16/fp16, else measured."""
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        known = table_peak_flops(torch.cuda.get_device_name(dev))
        if known is not None:
            return known
    # CPU bf16 matmul is often emulated and slower than fp32; the trainer's CPU runs are fp32 anyway.
    measure_dtype = dtype if dev.type == "cuda" else torch.float32
    return measure_matmul_peak(str(dev), measure_dtype, n=4096 if dev.type == "cuda" else 1024)


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
