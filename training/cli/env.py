"""``moefold env``: what this machine offers moefold (torch, devices, launch, optional backends)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform

import torch

# Optional GPU backends: import name -> how to install it (README, "On GPUs").
OPTIONAL_BACKENDS = {
    "transformer_engine": "pip install --no-build-isolation transformer-engine[pytorch]",
    "deep_ep": "build DeepEP V2 (with NCCL >= 2.30.4 from the nvidia-nccl wheel) or v1.2.1 from source: README, "
               "On GPUs",
    "grouped_gemm": "pip install --no-build-isolation grouped-gemm",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def backend_status(module: str) -> str:
    """'available (version)' or 'not installed (how to install)' or 'broken: <error>'."""
    if importlib.util.find_spec(module) is None:
        return f"not installed ({OPTIONAL_BACKENDS.get(module, 'pip install ' + module)})"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return f"installed but fails to import: {type(exc).__name__}: {exc}"
    return f"available ({getattr(mod, '__version__', 'version unknown')})"


def gpu_report() -> list[str]:
    """GPU list and memory through NVML, or a clean 'no NVIDIA driver' line."""
    try:
        import pynvml
    except ImportError:
        return ["pynvml: not installed (pip install nvidia-ml-py)"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [f"pynvml: no NVIDIA driver ({exc})"]
    try:
        lines = [f"pynvml: driver {pynvml.nvmlSystemGetDriverVersion()}"]
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            lines.append(f"  gpu {i}: {pynvml.nvmlDeviceGetName(handle)}, "
                         f"{mem.used / 2**30:.1f} / {mem.total / 2**30:.1f} GiB used")
        return lines
    finally:
        pynvml.nvmlShutdown()


def report() -> list[str]:
    cuda = f"available, {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "not available"
    lines = [
        f"moefold: {importlib.metadata.version('moefold')}",
        f"python: {platform.python_version()} ({platform.machine()})",
        f"torch: {torch.__version__}",
        f"cuda: {cuda}",
        f"cpu threads: {torch.get_num_threads()}",
        f"grouped_mm (torch.nn.functional.grouped_mm): {'yes' if hasattr(torch.nn.functional, 'grouped_mm') else 'no'}",
    ]
    if "WORLD_SIZE" in os.environ:
        lines.append(f"launched: rank {os.environ.get('RANK', '?')} of world size {os.environ['WORLD_SIZE']}")
    else:
        lines.append("launched: no (world size 1)")
    lines += [f"{name}: {backend_status(name)}" for name in OPTIONAL_BACKENDS]
    from moefold.training.observe.fp8_report import env_lines

    lines += env_lines()
    lines += gpu_report()
    return lines


def main(args: argparse.Namespace) -> int:
    del args
    print("\n".join(report()))
    return 0
