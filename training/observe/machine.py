"""What a benchmark ran on: the one description every benchmark prints, and when bf16 figures mean nothing.

    from moefold.training.observe.machine import describe_machine, bf16_skip_reason
    print(describe_machine())            # "# machine: AMD EPYC (x86_64), torch cpu capability AVX512, ..."
    reason = bf16_skip_reason()          # None where bf16 matmuls have hardware, else why not

A CPU benchmark's figures depend on what the CPU can do: torch's kernel dispatch level
(``torch.backends.cpu.get_cpu_capability()``: DEFAULT / AVX2 / AVX512 / ...), whether bf16 matmuls
have hardware (x86: AMX tiles ``amx_bf16`` or the AVX-512 ``avx512_bf16`` dot-product instructions;
Arm: the ``bf16`` feature), how many threads torch uses, and the allocator (glibc's ``MALLOC_*``
tunables or a preloaded jemalloc/tcmalloc change how often large tensors are page-faulted in).
Without bf16 units a bf16 matmul is emulated through fp32 conversions and runs at a fraction of
fp32 speed, so bf16 rows from such a machine measure the emulation, not moefold: benchmarks skip
them and say why (``bf16_skip_reason``), backed by a measured probe (``bf16_matmul_speedup``).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field

import torch

from moefold.moe.cpu.rows_gemm import describe_auto_layout

CPU_FLAGS_BF16 = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512 BF16, Arm FEAT_BF16


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(CPU model name, feature flags) from /proc/cpuinfo; ('unknown', {}) where there is none."""
    model, flags = platform.processor() or "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model in ("unknown", "", platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


@dataclass(frozen=True)
class MachineInfo:
    """The machine as a benchmark sees it (see the module docstring for what each field means)."""

    cpu_model: str
    arch: str
    cpu_capability: str
    flags: frozenset[str] = field(repr=False)
    cpus: int
    threads: int
    allocator: dict[str, str]
    torch_version: str
    gpu: str | None
    load_average: float | None

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def bf16_units(self) -> bool:
        """The CPU has bf16 matmul instructions (AMX, AVX-512 BF16, or Arm BF16)."""
        return any(f in self.flags for f in CPU_FLAGS_BF16)

    def describe(self) -> str:
        bf16 = ", ".join(f for f in ("amx_bf16", "avx512_bf16") if f in self.flags) or (
            "bf16" if "bf16" in self.flags else "none")
        alloc = " ".join(f"{k}={v}" for k, v in sorted(self.allocator.items())) or "glibc defaults"
        load = "" if self.load_average is None else f", load average {self.load_average:.1f}"
        gpu = f", gpu {self.gpu}" if self.gpu else ""
        return (f"{self.cpu_model} ({self.arch}), torch {self.torch_version} cpu capability {self.cpu_capability}, "
                f"bf16 matmul units: {bf16} (AMX {'yes' if self.amx else 'no'}), {self.cpus} cpus, "
                f"{self.threads} torch threads, allocator: {alloc}{gpu}{load}")


def machine_info() -> MachineInfo:
    model, flags = _cpuinfo()
    allocator = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return MachineInfo(cpu_model=model, arch=platform.machine(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                       flags=flags, cpus=os.cpu_count() or 1, threads=torch.get_num_threads(), allocator=allocator,
                       torch_version=torch.__version__, gpu=gpu, load_average=load)


def describe_machine() -> str:
    """One comment line naming the machine (benchmarks and ``moefold train`` on a CPU print it first), with the
    experts' CPU row layout that ``auto`` takes on it (a rule of the CPU's kind: ``moe.cpu.rows_gemm``)."""
    return f"# machine: {machine_info().describe()}; {describe_auto_layout()}"


def bf16_matmul_speedup(n: int = 512, iters: int = 5) -> float:
    """Measured bf16 / fp32 matmul throughput on this CPU (n x n x n, best of ``iters``): ~2-16 with
    bf16 units, well under 1 where bf16 is emulated."""
    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(n, n, device="cpu").to(dtype), torch.randn(n, n, device="cpu").to(dtype)
        a @ b
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def bf16_skip_reason(device: torch.device | str = "cpu", info: MachineInfo | None = None) -> str | None:
    """Why bf16 compute figures would be meaningless here, or None when they are not.

    CUDA devices: None. CPU: the flags decide (AMX / AVX-512 BF16 / Arm BF16); the probe's figure
    is quoted in the reason so that the skip can be checked against a measurement.
    """
    if torch.device(device).type != "cpu":
        return None
    info = info or machine_info()
    if info.bf16_units:
        return None
    return (f"no bf16 matmul units on this CPU ({info.cpu_model}, cpu capability {info.cpu_capability}; no amx_bf16 "
            f"/ avx512_bf16 / bf16 flag): a bf16 matmul runs at {bf16_matmul_speedup():.2f}x fp32 here, emulated")


def bf16_slower_notice(info: MachineInfo | None = None) -> str | None:
    """For ``--bf16`` on the CPU: one line saying fp32 is faster here, with the measured bf16 / fp32 matmul ratio,
    when the CPU has no bf16 matmul units and the probe confirms it (ratio < 1); None otherwise."""
    info = info or machine_info()
    if info.bf16_units:
        return None
    ratio = bf16_matmul_speedup()
    if ratio >= 1:
        return None
    return (f"--bf16 on {info.cpu_model}, which has no bf16 matmul units (no amx_bf16 / avx512_bf16 / bf16 flag): "
            f"a bf16 matmul runs at {ratio:.2f}x the speed of fp32 here (measured, 512^3); fp32 (without --bf16) is "
            f"faster on this CPU")


__all__ = ["MachineInfo", "bf16_matmul_speedup", "bf16_skip_reason", "bf16_slower_notice", "describe_machine",
           "machine_info"]
