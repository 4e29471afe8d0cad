"""The GPU check's rehearsal on the CPU, so that an API change that breaks a GPU test or a GPU benchmark fails
here, not in the few minutes of a GPU machine.

One run of ``bash scripts/gpu_check.sh --quick`` (tests/gpu in rehearsal: each test function once, on the CPU,
with the TE/DeepEP stand-ins; the sync, training and MoE-layer benchmarks at tiny sizes with ``--device cpu``),
offline as on the GPU machine: the package index is unreachable (a closed local port) and a carried wheel is
installed from ``--wheels``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _wheel(folder: Path, name: str = "moefold_rehearsal_probe") -> Path:
    """A minimal pure-Python wheel (one module with a __version__), as ``pip download`` would bring one."""
    dist = f"{name}-0.1.dist-info"
    files = {f"{name}.py": "__version__ = '0.1'\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: moefold-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_gpu_check_rehearsal_runs_every_step_on_cpu(tmp_path):
    _wheel(tmp_path / "whl")
    out = tmp_path / "out" / "report.md"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TIMEOUT": "400"}
    env.pop("MOEFOLD_GPU_REHEARSAL", None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--out", str(out), "--budget", "300",
                           "--wheels", str(tmp_path / "whl"), "--index-url", "http://127.0.0.1:9/simple/"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    report = out.read_text() if out.exists() else "(no report)"
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{report}"
    for row in ("| environment | passed |", "| install | passed |", "| host syncs | passed |",
                "| proxy training | passed |", "| MoE layer bf16 vs dense | passed |", "| tests | passed |"):
        assert row in report, f"{row} missing:\n{report}"
    # offline: the index probe fails fast and says so; the carried wheel is installed and imports in the steps
    assert "unreachable" in report and "no network" in report, report
    assert "import moefold_rehearsal_probe: ok 0.1" in report, report
    # every benchmark row ran or said why not; the tests ran (none failed, none errored)
    assert "| E8 k2 F32 H64 T64 | grouped_mm | " in report and "| E8 k2 F32 H64 T64 | te | skipped: " in report
    assert "| training step (qwen3_moe_tiny bf16, 4 micro-batches) | n/a (CPU) | " in report
    assert " passed" in report.split("## tests: passed", 1)[1] and "FAILED" not in report and "ERROR" not in report
