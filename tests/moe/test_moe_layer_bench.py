"""benchmarks/moe_layer.py runs end to end at tiny sizes (eager rows, one allocator; compiling is tested in
tests/execution/test_compile.py). In a child process: the Megatron-Core peer sets up a gloo world and points
Megatron's CUDA-only helpers at the CPU, which must not leak into other tests."""

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import moe_layer

ROOT = Path(__file__).resolve().parents[2]


def test_moe_layer_benchmark_prints_the_machine_and_every_row():
    argv = ["--tokens", "64", "--hidden", "32", "--configs", "4,2,32;32,8,16", "--rounds", "1", "--dtypes", "fp32",
            "--allocators", "default", "--profile", "3", "--row-layout", "measured,packed"]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), *argv], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.startswith("# machine: ") and "cpu capability" in out and "allocator" in out
    rows = [line for line in out.splitlines() if line.startswith("fp32")]
    # the two layouts side by side: one row each per config
    assert [r.split()[4] for r in rows] == ["eager/measured", "eager/packed"] * 2, out
    assert out.count("top ops of one step") == 2 and "expert row layouts measured" in out
    megatron = moe_layer.megatron_available()
    assert (megatron is None) == all(r.split()[-1] != "-" for r in rows), out   # the peer's column when installed
