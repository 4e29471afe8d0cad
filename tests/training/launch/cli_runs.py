"""``moefold train`` (and torchrun) as subprocesses, as a cluster runs them: a tiny two-rank recipe, its data, a
start that waits for a given line, and the losses of a run directory's metrics."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from moefold.training.observe.metrics import read_metrics
from tests.load import communicate, within
from tests.training.trainer_common import tiny_corpus

# a tiny Qwen3-MoE at ep2, one step a fraction of a second even on a busy 2-core machine
TINY = ["--recipe", "qwen3_moe_tiny", "--num-layers", "2", "--vocab-size", "256", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu", "--no-balance-report",
        "--log-interval", "1", "--lr-warmup-iters", "2"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def corpus(path: Path) -> Path:
    """``tiny_corpus`` at ``path`` (once)."""
    if not Path(f"{path}.idx").is_file():
        tiny_corpus(path)
    return path


def start(args: list[str], module: str = "moefold.training.cli", prefix: list[str] = ()) -> subprocess.Popen:
    """``python [prefix] -m module train args`` with stdout and stderr merged (line buffered)."""
    cmd = [sys.executable, "-m", *prefix, module, *(["train"] if module == "moefold.training.cli" else []), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, bufsize=1)


def wait_for(proc: subprocess.Popen, pattern: str, lines: list[str], timeout: float = 240) -> re.Match:
    """Read ``proc``'s output into ``lines`` until a line matches ``pattern`` (within ``timeout`` s on an idle
    machine, stretched by the load: tests/load.py)."""
    limit = within(timeout)
    while limit.left() > 0:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"ended ({proc.wait()}) before {pattern!r}:\n{''.join(lines[-30:])}")
        lines.append(line)
        if m := re.search(pattern, line):
            return m
    proc.kill()
    pytest.fail(f"no {pattern!r} within {limit}:\n{''.join(lines[-30:])}")


def finish(proc: subprocess.Popen, lines: list[str], timeout: float = 300) -> str:
    out, _ = communicate(proc, timeout)
    lines.append(out)
    return "".join(lines)


def run(args: list[str], timeout: float = 300, **kwargs) -> tuple[int, str]:
    proc = start(args, **kwargs)
    out, _ = communicate(proc, timeout)
    return proc.returncode, out


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, lm loss) of every step record of ``run_dir``'s metrics (one per step after resumes)."""
    return [(r["step"], r["loss_lm"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_dirs_of(pid: int) -> list[Path]:
    """The ``moefold-launch-*`` directories whose launcher was ``pid``."""
    out = []
    for d in Path(tempfile.gettempdir()).glob("moefold-launch-*"):
        try:
            if int((d / "launcher.pid").read_text()) == pid:
                out.append(d)
        except (OSError, ValueError):
            pass
    return out


def dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")
