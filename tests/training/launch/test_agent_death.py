"""A torchrun agent killed with kill -9 (issue 47, row 8): its workers used to go on training, holding the save
lock; now each notices within a second that its parent is gone, says so in one line and stops, and the lock is
released (the next run takes it without a note about a previous holder)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from moefold.training.checkpoint.lock import SaveLock
from tests.training.launch.cli_runs import TINY, corpus, dead, start, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_workers_stop_and_release_the_lock_when_their_agent_is_killed(tmp_path):
    data = corpus(tmp_path / "data")
    save = tmp_path / "ckpt"
    agent, lines = start([*TINY, "--expert-model-parallel-size", "2", "--train-iters", "100000", "--data-path",
                          str(data), "--run-dir", str(tmp_path / "run"), "--save", str(save)],
                         prefix=["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]), []
    try:
        wait_for(agent, r"step 2/", lines)
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 60
        while not all(dead(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [w for w in workers if not dead(w)]
    finally:
        for w in _children(agent.pid) if not dead(agent.pid) else []:
            os.kill(w, signal.SIGKILL)
    for w in alive:   # what the test leaves behind, however it ends
        os.kill(w, signal.SIGKILL)
    assert not alive, f"workers {alive} still running 60 s after their agent was killed"
    text = "".join(lines) + agent.stdout.read()
    for rank in (0, 1):
        assert f"moefold train: rank {rank}: the torchrun agent (pid {agent.pid}) is gone; stopping this worker" \
               in text, text[-3000:]
    assert "releasing the --save lock" in text
    notes: list[str] = []
    with SaveLock.acquire(save, "next", say=notes.append):
        assert notes == []   # released, not merely dropped by the kernel: nothing to take over
