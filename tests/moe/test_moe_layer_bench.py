"""benchmarks/moe_layer.py runs end to end at tiny sizes (eager rows, one allocator; compiling is tested in
tests/execution/test_compile.py). In a child process: the Megatron-Core peer sets up a gloo world and points
Megatron's CUDA-only helpers at the CPU, which must not leak into other tests."""

import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import moe_layer

ROOT = Path(__file__).resolve().parents[2]


def test_moe_layer_benchmark_prints_the_machine_and_every_row():
    argv = ["--tokens", "64", "--hidden", "32", "--configs", "4,2,32;32,8,16", "--rounds", "1", "--dtypes", "fp32,bf16",
            "--allocators", "default", "--profile", "3", "--row-layout", "measured,packed"]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), *argv], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.startswith("# machine: ") and "cpu capability" in out and "allocator" in out
    assert next(line for line in out.splitlines() if line.startswith("dtype")).split()[-4:] == [
        "megatron/moefold", "titan", "ms", "titan/moefold"], out
    megatron_col, titan_col = -3, -1   # a row's words: ... megatron ms, megatron/moefold, titan ms, titan/moefold
    rows = [line for line in out.splitlines() if line.startswith("fp32")]
    # the two layouts side by side: one row each per config
    assert [r.split()[4] for r in rows] == ["eager/measured", "eager/packed"] * 2, out
    megatron, titan = moe_layer.megatron_available(), moe_layer.titan_available()
    assert (megatron is None) == all(r.split()[megatron_col] != "-" for r in rows), out   # the peer's column
    assert all(r.split()[titan_col] == "-" for r in rows), out   # TorchTitan's experts compute in bf16: no fp32 row
    assert f"titan: {titan or 'torchtitan 0.3'}" in out   # a peer that cannot run says why
    bf16 = [line for line in out.splitlines() if line.startswith("bf16")]
    bf16_rows = [r for r in bf16 if "skipped" not in r]   # skipped, with the reason, without bf16 matmul units
    assert len(bf16) == 1 if not bf16_rows else [r.split()[4] for r in bf16_rows] == ["eager/measured",
                                                                                        "eager/packed"] * 2, out
    assert all((titan is None) == (r.split()[titan_col] != "-") for r in bf16_rows), out
    # one profile of moefold and one of each peer that ran, per (dtype, config)
    peers = (megatron is None) * (1 + bool(bf16_rows)) + (titan is None) * bool(bf16_rows)
    assert out.count("top ops of one step") == 2 * (1 + bool(bf16_rows)) + 2 * peers, out
    # each profile ends with its GEMMs' rate, from the calls' shapes
    rates = re.findall(r"aten::mm: [0-9.]+ ms in (\d+) calls, ([0-9.]+) GFLOP/s", out)
    assert len(rates) == out.count("top ops of one step") and all(int(n) > 0 and float(r) > 0 for n, r in rates), out
    assert "expert row layouts measured" in out
