"""The ``moefold train --nproc 2`` launcher when things go wrong, as a user sees it (subprocess runs): a stopped
rank ends the job naming it, killing the launcher ends its ranks, a data error inside the ranks prints one line
and keeps the tracebacks in RUN_DIR/error.log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moefold.training.data.indexed import IndexedDatasetWriter
from tests.load import communicate, scaled, within
from tests.training.launch.cli_runs import dead
from tests.training.trainer_common import tiny_data

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

TWO_RANKS = ["--recipe", "qwen3_moe_tiny", "--num-layers", "2", "--vocab-size", "256", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--nproc", "2", "--expert-model-parallel-size", "2",
             "--device", "cpu", "--no-balance-report", "--no-save", "--log-interval", "1000"]


def _corpus(path: Path, bad: bool = False) -> Path:
    """Learnable samples; ``bad``: token ids up to 299 under an .idx header that declares a vocabulary of 256 and a
    largest id of 255 (a lying header: pre-flight trusts it, the ranks find the ids when they read them)."""
    with IndexedDatasetWriter(path, 512 if bad else 256) as writer:
        rows = np.random.default_rng(0).integers(0, 300, (64, 33)) if bad else tiny_data(64)
        for row in rows:
            writer.add_document(row)
    if bad:
        idx = Path(f"{path}.idx")
        raw = bytearray(idx.read_bytes())
        raw[40:48] = (256).to_bytes(8, "little")
        raw[48:56] = (255).to_bytes(8, "little")
        idx.write_bytes(bytes(raw))
    return path


def _start(tmp_path: Path, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "moefold.training.cli", "train", *TWO_RANKS,
                             "--data-path", str(_corpus(tmp_path / "data")), "--run-dir", str(tmp_path / "run"),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _rank_pids(proc: subprocess.Popen, until: str = "model:") -> list[int]:
    """The ranks' pids from the launcher's output, once rank 0 has printed ``until`` (all ranks then run:
    the process groups are built)."""
    pids, limit = None, within(120)
    while limit.left() > 0:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the launcher ended early: {proc.wait()} {proc.stderr.read()}")
        if m := re.match(r"launched 2 ranks \(pids (\d+), (\d+)\)", line):
            pids = [int(m[1]), int(m[2])]
        if line.startswith(until) and pids:
            return pids
    pytest.fail(f"the ranks did not start within {limit}")


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    proc = _start(tmp_path, "--train-iters", "100000", "--heartbeat-timeout", "3")
    try:
        pids = _rank_pids(proc)
        time.sleep(1.0)   # a few steps
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = communicate(proc, 60)
        took = time.monotonic() - stopped
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if "moefold train:" in line]
    assert len(lines) == 1 and re.search(r"moefold train: rank 1: no heartbeat for \d+s \(--heartbeat-timeout 3\): "
                                         r"the process is stopped or stuck; its last completed step was \d+", lines[0])
    assert took < scaled(30), took   # the watchdog fires after 3 s, not at the 60 s backstop
    assert all(dead(p) for p in pids)


def test_killing_the_launcher_ends_its_ranks(tmp_path):
    proc = _start(tmp_path, "--train-iters", "100000")
    try:
        pids = _rank_pids(proc)
        assert not any(dead(p) for p in pids)
        proc.kill()   # SIGKILL: the launcher gets no chance to clean up
        proc.wait()
        limit = within(20)
        while not all(dead(p) for p in pids) and limit.left() > 0:
            time.sleep(0.1)
        assert all(dead(p) for p in pids), [p for p in pids if not dead(p)]
    finally:
        for p in pids if "pids" in locals() else []:
            if not dead(p):
                os.kill(p, signal.SIGKILL)


def test_a_data_error_in_two_ranks_prints_one_line(tmp_path):
    bad = _corpus(tmp_path / "bad", bad=True)
    proc = _start(tmp_path, "--train-iters", "4", "--data-path", str(bad))
    out, err = communicate(proc, 180)
    assert proc.returncode == 1, (out, err)
    lines = [line for line in err.splitlines() if "moefold train:" in line]
    log = tmp_path / "run" / "error.log"
    assert len(lines) == 1 and re.fullmatch(
        rf"moefold train: rank [01]: {re.escape(str(bad))}\.bin: token id 2\d\d in sample \d+ is outside the "
        rf"vocabulary of 256 that .*bad\.idx declares .*re-run `moefold prepare-data` \(full tracebacks: "
        rf"{re.escape(str(log))}\)", lines[0]), err
    assert "Traceback" not in out + err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "gpt_dataset.py" in text


def _ok(device, heartbeat=None) -> None:
    pass


def _fails(device, heartbeat=None) -> None:
    raise ValueError("broken on purpose")


def test_deepep_buffers_destroyed_when_the_run_ends_and_dropped_when_it_fails(monkeypatch):
    """The flex dispatcher's DeepEP buffers (created with explicitly_destroy=True) are destroyed when a rank's run
    returns, before its process group goes; when it raises they are dropped without DeepEP's collective destroy
    (deep_ep.cpp: a device sync and a barrier over the group, which a failed peer never joins), so nothing is left
    for the destructor at interpreter exit, where DeepEP warns it may hang Python's exception handling."""
    import moefold.dispatch.deepep as deepep
    from moefold.training.errors import JobFailed
    from moefold.training.launch import run_ranks

    events: list[str] = []

    class Buffers:
        def destroy(self) -> int:
            events.append("destroy")
            return 1

        def forget(self) -> int:
            events.append("forget")
            return 1

    monkeypatch.setattr(deepep, "BUFFERS", Buffers())
    run_ranks(_ok, 1, "cpu", say=lambda _m: None)
    assert events == ["destroy"]
    with pytest.raises(JobFailed, match="broken on purpose"):
        run_ranks(_fails, 1, "cpu", say=lambda _m: None)
    assert events == ["destroy", "forget"]
