"""The machine description every benchmark prints, and the bf16 skip decision."""

import dataclasses

import torch

from moefold.training.observe import machine


def test_describe_names_capability_bf16_units_threads_and_allocator(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4294967296")
    info = machine.machine_info()
    text = info.describe()
    assert torch.backends.cpu.get_cpu_capability() in text
    assert f"{torch.get_num_threads()} torch threads" in text and "bf16 matmul units" in text
    assert "MALLOC_TRIM_THRESHOLD_=4294967296" in text
    assert machine.describe_machine().startswith("# machine: ")


def test_bf16_skip_follows_the_cpu_flags():
    info = machine.machine_info()
    amx = dataclasses.replace(info, flags=frozenset({"avx2", "amx_bf16", "amx_tile"}))
    avx512 = dataclasses.replace(info, flags=frozenset({"avx512f", "avx512_bf16"}))
    avx2 = dataclasses.replace(info, flags=frozenset({"avx2", "fma"}), cpu_capability="AVX2")
    assert amx.amx and amx.bf16_units and machine.bf16_skip_reason(info=amx) is None
    assert not avx512.amx and avx512.bf16_units and machine.bf16_skip_reason(info=avx512) is None
    reason = machine.bf16_skip_reason(info=avx2)
    assert reason is not None and "no bf16 matmul units" in reason and "AVX2" in reason and "x fp32" in reason
    assert machine.bf16_skip_reason("cuda", info=avx2) is None  # GPUs have bf16 tensor cores


def test_probe_measures_a_ratio():
    assert machine.bf16_matmul_speedup(n=64, iters=2) > 0


def test_bf16_slower_notice_only_without_bf16_units_and_with_the_measured_ratio(monkeypatch):
    info = machine.machine_info()
    avx2 = dataclasses.replace(info, flags=frozenset({"avx2", "fma"}), cpu_model="Some CPU")
    amx = dataclasses.replace(info, flags=frozenset({"amx_bf16"}))
    calls = []
    monkeypatch.setattr(machine, "bf16_matmul_speedup", lambda: calls.append(1) or 0.31)
    notice = machine.bf16_slower_notice(avx2)
    assert notice is not None and "Some CPU" in notice and "0.31x" in notice and "fp32" in notice
    assert machine.bf16_slower_notice(amx) is None and len(calls) == 1   # no probe where the flags decide
    monkeypatch.setattr(machine, "bf16_matmul_speedup", lambda: 1.4)    # the probe disagrees with the flags
    assert machine.bf16_slower_notice(avx2) is None
