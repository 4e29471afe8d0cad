"""Preemption: SIGTERM (what SLURM and Kubernetes send first), Ctrl-C, SIGUSR1 and the ``--exit-*`` limits make
every rank finish its step, the run save a checkpoint (even at ``--save-interval 0``), print one line and exit
with its documented code; the resume from that checkpoint is the uninterrupted run, bit for bit. The ranks
agree on the stop step (one rank signalled: both stop after the same step, one checkpoint)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.checkpoint.files import checkpoint_dirs
from moefold.training.checkpoint.identity import read_tracker
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.load import within
from tests.training.launch.cli_runs import TINY, corpus, dead, finish, launch_dirs_of, losses, run, start, wait_for
from tests.training.trainer_common import tiny_config, tiny_data

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

STEPS = 10


@pytest.mark.slow   # three two-rank runs: `python -m pytest -q -m slow` (.ci/run) runs it
def test_sigterm_to_a_two_rank_run_saves_and_the_resume_is_bit_identical(tmp_path):
    data = ["--data-path", str(corpus(tmp_path / "data"))]
    two = [*TINY, *data, "--nproc", "2", "--expert-model-parallel-size", "2", "--train-iters", str(STEPS)]
    code, out = run([*two, "--run-dir", str(tmp_path / "whole"), "--no-save"])
    assert code == 0, out
    whole = losses(tmp_path / "whole")
    assert [s for s, _ in whole] == list(range(1, STEPS + 1))

    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    proc, lines = start([*two, "--run-dir", str(run_dir), "--save", str(save)]), []   # --save-interval 0
    pids = [int(p) for p in wait_for(proc, r"launched 2 ranks \(pids (\d+), (\d+)\)", lines).groups()]
    wait_for(proc, r"step 3/", lines)
    os.kill(proc.pid, signal.SIGTERM)
    text = finish(proc, lines)
    assert proc.returncode == 128 + signal.SIGTERM, text
    m = re.search(rf"moefold train: SIGTERM at step (\d+): saved {re.escape(str(save))}/iter_(\d+); resume with "
                  rf"--load {re.escape(str(save))}\n", text)
    assert m and int(m[1]) == int(m[2]) and 3 <= int(m[1]) < STEPS, text
    step = int(m[1])
    assert [d.name for d in checkpoint_dirs(save)] == [f"iter_{step:07d}"] and read_tracker(save) == step
    assert "Traceback" not in text, text
    assert launch_dirs_of(proc.pid) == [] and all(dead(p) for p in pids)   # no temporary directory, no orphan

    code, out = run([*two, "--run-dir", str(run_dir), "--save", str(save), "--load", str(save)])
    assert code == 0, out
    assert f"resumed from {save}/iter_{step:07d}" in out, out
    assert losses(run_dir) == whole   # every step once, the same losses bit for bit


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGUSR1])
def test_ctrl_c_or_sigusr1_at_world_1_saves_and_names_the_checkpoint(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc, lines = start([*TINY, "--data-path", str(corpus(tmp_path / "data")), "--train-iters", "100000",
                         "--run-dir", str(run_dir)]), []   # the default --save: RUN_DIR/checkpoints
    wait_for(proc, r"step 2/", lines)
    os.kill(proc.pid, sig)
    text = finish(proc, lines)
    assert proc.returncode == 128 + sig, text
    save = run_dir / "checkpoints"
    (ckpt,) = checkpoint_dirs(save)
    name = signal.Signals(sig).name
    assert f"moefold train: {name}: stopping after the current step and saving" in text, text
    assert re.search(rf"moefold train: {name} at step \d+: saved {re.escape(str(ckpt))}; resume with --load "
                     rf"{re.escape(str(save))}", text), text


def test_without_the_handler_a_signal_ends_the_launcher_and_its_ranks_at_once(tmp_path):
    proc, lines = start([*TINY, "--data-path", str(corpus(tmp_path / "data")), "--train-iters", "100000",
                         "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--no-exit-signal-handler"]), []
    pids = [int(p) for p in wait_for(proc, r"launched 2 ranks \(pids (\d+), (\d+)\)", lines).groups()]
    wait_for(proc, r"step 2/", lines)
    os.kill(proc.pid, signal.SIGTERM)
    finish(proc, lines, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not checkpoint_dirs(tmp_path / "run" / "checkpoints")
    limit = within(20)
    while not all(dead(p) for p in pids) and limit.left() > 0:
        time.sleep(0.1)
    assert all(dead(p) for p in pids) and launch_dirs_of(proc.pid) == []


@pytest.mark.usefixtures("one_thread")
def test_exit_interval_and_exit_duration_stop_with_a_checkpoint(tmp_path):
    for limit, reason, step in (({"exit_interval": 2}, "--exit-interval 2", 2),
                                ({"exit_duration_in_mins": 1e-9}, "--exit-duration-in-mins 1e-09", 1)):
        save = tmp_path / reason.split()[0].strip("-")
        trainer = Trainer(tiny_config(steps=5, save=str(save), **limit), ParallelDims.single(), log=lambda _m: None)
        summary = trainer.fit(tiny_data())
        assert summary.stop is not None and summary.stop.reason == reason and summary.stop.exit_code == 0
        assert summary.steps == step and summary.checkpoint == save / f"iter_{step:07d}"


class _Flag:
    received = 0


def _one_rank_signalled(save: str) -> tuple[int, str | None]:
    """Rank 1 alone is told to stop during step 2: both ranks stop after the same step and save together."""
    import torch.distributed as dist

    pc = ParallelConfig(ep=2)
    trainer = Trainer(tiny_config(pc, steps=6, recipe="qwen3_moe_tiny", save=save), ParallelDims.build(pc),
                      log=lambda _m: None)
    flag = _Flag()
    trainer.stop_request = flag
    if dist.get_rank() == 1:
        trainer.loss_hook = lambda step, micro, loss: (setattr(flag, "received", 15) if step == 1 else None) or loss
    summary = trainer.fit(tiny_data())
    return summary.steps, summary.stop.reason if summary.stop else None


def test_the_ranks_agree_on_the_stop_step(tmp_path):
    save = str(tmp_path / "ckpt")
    results = run_distributed(_one_rank_signalled, 2, save, timeout=240)
    assert results == [(2, "SIGTERM"), (2, "SIGTERM")]
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000002"]
