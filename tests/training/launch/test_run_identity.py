"""One writer per directory, and a resume takes its own run's checkpoint: two concurrent runs with one ``--save``
(the second fails before any rank starts, naming the first), a lock left by a killed run (taken over with a
note), a fresh run into a directory holding another run's checkpoints or metrics (refused, naming them; the
``--override-*`` flags), the stale-run resume (a restarted run follows its tracker, never the older run's later
checkpoints), and fresh runs in their own ``runs/<recipe>/<timestamp>`` directories, ``latest`` pointing at the
newest, none touching another's files."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from moefold.training.checkpoint.files import checkpoint_dirs
from moefold.training.checkpoint.identity import checkpoint_run_id, read_run, read_tracker
from moefold.training.checkpoint.lock import LOCK_FILE, SaveLock, SaveLockError
from moefold.training.cli import main as cli_main
from tests.load import scaled
from tests.training.launch.cli_runs import ENV, TINY, corpus, finish, losses, start, wait_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return ["--data-path", str(corpus(tmp_path_factory.mktemp("data") / "tiny"))]


def _train(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["train", *TINY, *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_second_run_into_the_same_save_fails_before_its_ranks_start(tmp_path, data, capsys):
    save = tmp_path / "ckpt"
    first, lines = start([*TINY, *data, "--train-iters", "100000", "--run-dir", str(tmp_path / "a"), "--save",
                          str(save)]), []
    try:
        wait_for(first, r"step 2/", lines)
        t0 = time.monotonic()
        code, out = _train(capsys, *data, "--train-iters", "5", "--run-dir", str(tmp_path / "b"), "--save", str(save),
                           "--load", str(save))
        took = time.monotonic() - t0
        assert code == 2, out
        assert re.search(rf"moefold train: error: --save {re.escape(str(save))} is in use by pid {first.pid} on host "
                         rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d, run \S+; wait "
                         "for it to end, or choose another --save", out), out
        # before any rank: no model built, no rank started (and an answer in seconds, not a training run's time)
        assert "model:" not in out and "launched" not in out and took < scaled(60)
        assert first.poll() is None   # the first run goes on, undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        text = finish(first, lines)
    assert first.returncode == 128 + signal.SIGTERM and "saved" in text, text
    # the first run's checkpoint, and no other: the second touched nothing
    (ckpt,) = checkpoint_dirs(save)
    assert checkpoint_run_id(ckpt) == read_run(tmp_path / "a").run_id == read_run(save).run_id


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tmp_path):
    save = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom moefold.training.checkpoint.lock import "
                               "SaveLock\nSaveLock.acquire(sys.argv[1], 'old-run')\nprint('held', flush=True)\n"
                               "time.sleep(600)", str(save)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SaveLockError, match=rf"--save {re.escape(str(save))} is in use by pid {holder.pid} "
                                                r"on host .* run old-run"):
            SaveLock.acquire(save, "new-run", say=pytest.fail)
    finally:
        holder.kill()   # kill -9: no release; the kernel drops the fcntl lock, the record stays
        holder.wait()
    assert json.loads((save / LOCK_FILE).read_text())["pid"] == holder.pid
    notes: list[str] = []
    with SaveLock.acquire(save, "new-run", say=notes.append):
        assert notes == [f"note: took over the lock of --save {save} from pid {holder.pid} on host "
                         f"{socket.gethostname()} since {notes[0].split(' since ')[1].split(',')[0]}, run old-run "
                         "(no longer running)"], notes
        assert json.loads((save / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (save / LOCK_FILE).read_text() == ""   # a clean release leaves nothing to take over
    with SaveLock.acquire(save, "third", say=pytest.fail):
        pass


def test_a_fresh_run_into_another_runs_save_is_refused_and_a_resume_follows_its_own_tracker(tmp_path, data,
                                                                                             capsys):
    save = tmp_path / "ckpt"
    code, out = _train(capsys, *data, "--train-iters", "4", "--save-interval", "2", "--run-dir", str(tmp_path / "old"),
                       "--save", str(save))
    assert code == 0, out
    old = read_run(save).run_id
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000002", "iter_0000004"]
    # a new run (no --load) into it: refused before any rank starts, naming the other run's checkpoints
    new = ["--train-iters", "2", "--run-dir", str(tmp_path / "new"), "--save", str(save)]
    code, out = _train(capsys, *data, *new)
    assert code == 2 and out.count("\n") == 1, out
    assert f"moefold train: error: --save {save} holds checkpoints of run {old} (qwen3_moe_tiny, started " in out
    assert "iter_0000002, iter_0000004; continue that run with --load" in out and "--override-save" in out, out
    # with --override-save it writes beside them; its restart (--save D --load D) resumes its own iter_2, not the
    # older run's later iter_4
    code, out = _train(capsys, *data, *new, "--override-save")
    assert code == 0 and f"--override-save: {save} holds iter_0000002, iter_0000004 of run {old}" in out, out
    mine = read_run(save).run_id
    assert mine != old and read_tracker(save) == 2 and checkpoint_run_id(save / "iter_0000002") == mine
    assert checkpoint_run_id(save / "iter_0000004") == old   # the other run's checkpoint stays, untouched
    kept = save / "previous" / old / "iter_0000002"   # and its iter_2, which this run's iter_2 replaced, is kept
    assert checkpoint_run_id(kept) == old and (kept / "manifest.json").is_file(), out
    assert f"another run's iter_0000002 moved to {kept}" in out, out
    code, out = _train(capsys, *data, "--train-iters", "3", "--run-dir", str(tmp_path / "new"), "--save", str(save),
                       "--load", str(save))
    assert code == 0, out
    assert f"ignoring {save / 'iter_0000004'}: it belongs to run {old}" in out, out
    assert f"resumed from {save / 'iter_0000002'} at iteration 2 (consumed_samples 8, run {mine})" in out, out
    assert checkpoint_run_id(save / "iter_0000003") == mine and checkpoint_run_id(save / "iter_0000004") == old


def test_fresh_runs_get_their_own_directories_and_never_touch_another_runs_files(tmp_path, data, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        code, out = _train(capsys, *data, "--train-iters", "2")
        assert code == 0, out
        time.sleep(0.01)
    runs = sorted(p for p in (tmp_path / "runs" / "qwen3_moe_tiny").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and os.readlink(tmp_path / "runs" / "qwen3_moe_tiny" / "latest") == runs[1].name
    ids = {read_run(r).run_id for r in runs}
    assert len(ids) == 2
    for r in runs:   # each run's metrics (2 steps), event file and checkpoint, intact and its own
        assert [s for s, _ in losses(r)] == [1, 2]
        assert list((r / "tensorboard").glob("events.out.tfevents.*"))
        (ckpt,) = checkpoint_dirs(r / "checkpoints")
        assert checkpoint_run_id(ckpt) == read_run(r).run_id
    # writing into another run's directory: refused, or with the flag its files moved aside (not deleted)
    code, out = _train(capsys, *data, "--train-iters", "2", "--run-dir", str(runs[0]), "--no-save")
    assert code == 2 and f"--run-dir {runs[0]} holds the metrics of run {read_run(runs[0]).run_id}" in out, out
    before = read_run(runs[0]).run_id
    code, out = _train(capsys, *data, "--train-iters", "1", "--run-dir", str(runs[0]), "--no-save",
                       "--override-run-dir")
    assert code == 0, out
    moved = runs[0] / "previous" / before
    assert [s for s, _ in losses(moved)] == [1, 2] and read_run(moved).run_id == before
    assert not (moved / LOCK_FILE).exists()   # the lock stays where the next run looks for it
    assert [s for s, _ in losses(runs[0])] == [1] and read_run(runs[0]).run_id != before
    # a resume goes on in its own run's directory and says which checkpoint of which run it took
    code, out = _train(capsys, *data, "--train-iters", "3", "--load", "runs/qwen3_moe_tiny/latest/checkpoints")
    assert code == 0, out
    assert f"(consumed_samples 8, run {read_run(runs[1]).run_id})" in out, out
    assert [s for s, _ in losses(runs[1])] == [1, 2, 3]
    assert len([p for p in (tmp_path / "runs" / "qwen3_moe_tiny").iterdir() if not p.is_symlink()]) == 2
