"""``moefold train`` under torchrun (``python -m torch.distributed.run``), on 127.0.0.1 with gloo, as docs/training.md's
multi-node command runs it: ``--standalone``, two agents with a c10d rendezvous (``--nnodes 2 --nproc-per-node
2``) whose losses equal ``--nproc 4`` at the same layout, a SIGTERM to the agent (what a scheduler sends) that
the workers answer with a checkpoint, and ``--max-restarts 1`` restarting the group after a rank is killed, the
restarted group resuming from the last checkpoint (``--save D --load D``) to the uninterrupted run's losses."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from moefold.training.checkpoint.identity import read_tracker
from tests.load import within
from tests.training.launch.cli_runs import TINY, corpus, finish, free_port, losses, run, start, wait_for

# two torchrun agents of 2 workers each, three times: `python -m pytest -q -m slow` (.ci/run) runs them
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"), pytest.mark.slow]

TORCHRUN = "torch.distributed.run"
STEPS = 8
LAYOUT = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--train-iters", str(STEPS)]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


@pytest.fixture(scope="module")
def nproc4(tmp_path_factory) -> tuple[Path, list[tuple[int, float]]]:
    root = tmp_path_factory.mktemp("torchrun")
    data = corpus(root / "data")
    code, out = run([*TINY, *LAYOUT, "--data-path", str(data), "--nproc", "4", "--run-dir", str(root / "nproc4"),
                     "--no-save"])
    assert code == 0, out
    return data, losses(root / "nproc4")


def _agents(args: list[str], extra: list[str] = ()) -> list:
    port, run_id = free_port(), f"moefold-test-{os.getpid()}-{time.monotonic_ns()}"
    prefix = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", run_id, *extra]
    return [start(args, prefix=[*prefix, "-m"]) for _ in range(2)]


def test_two_torchrun_agents_train_as_nproc_4(nproc4, tmp_path):
    data, whole = nproc4
    agents = _agents([*TINY, *LAYOUT, "--data-path", str(data), "--run-dir", str(tmp_path / "run"), "--no-save"])
    outs = [finish(a, [], timeout=400) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert "world=4 dense tp2/cp1/dp2/pp1 experts etp1/ep2/edp2/pp1" in "".join(outs)
    assert losses(tmp_path / "run") == whole   # bit for bit: the same ranks, groups and collectives


def test_max_restarts_resumes_the_killed_group_from_its_last_checkpoint(nproc4, tmp_path):
    data, whole = nproc4
    save = tmp_path / "ckpt"
    agents = _agents([*TINY, *LAYOUT, "--data-path", str(data), "--run-dir", str(tmp_path / "run"), "--save",
                      str(save), "--load", str(save), "--save-interval", "3"], ["--max-restarts", "1"])
    limit = within(300)
    while read_tracker(save) is None and limit.left() > 0 and all(a.poll() is None for a in agents):
        time.sleep(0.2)
    assert read_tracker(save) == 3, [finish(a, [], timeout=60) for a in agents]
    victim = _children(agents[1].pid)[0]   # a worker of the second agent
    os.kill(victim, signal.SIGKILL)
    outs = [finish(a, [], timeout=400) for a in agents]
    text = "".join(outs)
    assert [a.returncode for a in agents] == [0, 0], text
    assert re.search(rf"resumed from {re.escape(str(save))}/iter_00000(03|06)", text), text
    assert losses(tmp_path / "run") == whole, text   # the restarted group ends where the uninterrupted run did


def test_standalone_sigterm_to_the_agent_saves_and_the_resume_is_bit_identical(nproc4, tmp_path):
    data, _ = nproc4
    two = [*TINY, "--expert-model-parallel-size", "2", "--train-iters", str(STEPS), "--data-path", str(data)]
    code, out = run([*two, "--nproc", "2", "--run-dir", str(tmp_path / "whole"), "--no-save"])
    assert code == 0, out
    standalone = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m"]
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    agent, lines = start([*two, "--run-dir", str(run_dir), "--save", str(save)], prefix=standalone), []
    wait_for(agent, r"step 2/", lines)
    os.kill(agent.pid, signal.SIGTERM)   # torchrun passes it to its workers and gives them --shutdown-timeout
    text = finish(agent, lines)
    m = re.search(rf"moefold train: SIGTERM at step (\d+): saved {re.escape(str(save))}/iter_\d+; resume with "
                  rf"--load {re.escape(str(save))}", text)
    assert m and read_tracker(save) == int(m[1]), text
    code, out = run([*two, "--run-dir", str(run_dir), "--save", str(save), "--load", str(save)], prefix=standalone)
    assert code == 0, out
    assert losses(run_dir) == losses(tmp_path / "whole"), out
