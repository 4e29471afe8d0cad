"""``--async-save``: the checkpoint written in the background holds the state of its step although training has
moved on (equal to a synchronous save's, tensor for tensor, at world 1 and at ep2), a failing background save is
reported and training goes on, a stop (``--exit-interval``; a signal stops the same way) waits for the save in
flight before it saves its own step, and a crash in the middle of a background write leaves the previous
checkpoint and the tracker naming it: the resume is the uninterrupted run."""

from __future__ import annotations

import errno
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.checkpoint.files import checkpoint_dirs, verify_checkpoint
from moefold.training.checkpoint.identity import read_tracker
from moefold.training.checkpoint.sharded import saved_keys
from tests.distributed import run_distributed
from tests.training.launch.cli_runs import ENV, TINY, corpus, losses
from tests.training.trainer_common import run, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from moefold.training.checkpoint.safe_load import SafeFileSystemReader, read_dcp_metadata

    md = read_dcp_metadata(ckpt / ".metadata").state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), no_dist=True)
    return state


def _both(sync_save: str, async_save: str, parallel: ParallelConfig) -> list[float]:
    dims = ParallelDims.build(parallel) if parallel.ep > 1 else ParallelDims.single()
    recipe = dict(recipe="qwen3_moe_tiny") if parallel.ep > 1 else {}
    ref, _, _ = run(tiny_config(parallel, steps=5, save=sync_save, save_interval=2, keep_last=5, **recipe), dims)
    got, _, _ = run(tiny_config(parallel, steps=5, save=async_save, save_interval=2, keep_last=5, async_save=True,
                                **recipe), dims)
    assert got == ref
    return got


@pytest.mark.parametrize("world", [1, 2])
def test_a_background_save_holds_its_steps_state(tmp_path, world):
    sync_save, async_save = str(tmp_path / "sync"), str(tmp_path / "async")
    if world == 1:
        _both(sync_save, async_save, ParallelConfig())
    else:
        run_distributed(_both, 2, sync_save, async_save, ParallelConfig(ep=2), timeout=300)
    assert [d.name for d in checkpoint_dirs(async_save)] == ["iter_0000002", "iter_0000004", "iter_0000005"]
    assert read_tracker(async_save) == 5
    for name in ("iter_0000002", "iter_0000004"):
        a, s = Path(async_save) / name, Path(sync_save) / name
        assert verify_checkpoint(a) == [] and saved_keys(a) == saved_keys(s)
        ta, ts = _checkpoint_tensors(a), _checkpoint_tensors(s)
        assert all(torch.equal(ta[k], ts[k]) for k in ts), name   # step 2's state, though step 3 had begun


def test_a_failing_background_save_is_reported_and_training_continues(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    real, messages = dcp_files._write_item, []

    def write_item(transforms, stream, *args, **kwargs):
        if "iter_0000002" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_files, "_write_item", write_item)
    ref, _, _ = run(tiny_config(steps=5))
    save = tmp_path / "save"
    losses_, _, _ = run(tiny_config(steps=5, save=str(save), save_interval=2, keep_last=5, async_save=True),
                        log=messages.append)
    assert losses_ == ref
    text = "\n".join(messages)
    assert "saving checkpoint iter_0000002 failed: the disk is full (OSError: [Errno 28] No space left" in text, text
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000004", "iter_0000005"]
    assert not [p for p in save.iterdir() if p.name.startswith(".tmp-")]


CRASH = """
import os, sys
import torch.distributed.checkpoint.filesystem as f
real = f._write_item
def write_item(transforms, stream, *args, **kwargs):
    if "iter_0000004" in str(getattr(stream, "name", "")):   # the second background save: half a shard, then death
        stream.write(b"\\0" * 1000)
        stream.flush()
        os._exit(137)
    return real(transforms, stream, *args, **kwargs)
f._write_item = write_item
from moefold.training.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    data = ["--data-path", str(corpus(tmp_path / "data"))]
    args = [*TINY, *data, "--train-iters", "8", "--save-interval", "2", "--async-save"]
    whole = subprocess.run([sys.executable, "-m", "moefold.training.cli", "train", *args, "--run-dir",
                            str(tmp_path / "whole"), "--no-save"], env=ENV, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    crashed = subprocess.run([sys.executable, "-c", CRASH, *args, "--run-dir", str(run_dir), "--save", str(save)],
                             env=ENV, capture_output=True, text=True)
    assert crashed.returncode == 137, crashed.stdout + crashed.stderr
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000002"] and read_tracker(save) == 2
    assert verify_checkpoint(save / "iter_0000002") == [] and (save / ".tmp-iter_0000004").is_dir()
    resumed = subprocess.run([sys.executable, "-m", "moefold.training.cli", "train", *args, "--run-dir",
                              str(run_dir), "--save", str(save), "--load", str(save)], env=ENV, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {save / 'iter_0000002'} at iteration 2" in resumed.stdout
    assert losses(run_dir) == losses(tmp_path / "whole")
    assert not (save / ".tmp-iter_0000004").exists()   # the next save removed what the crash left


def test_a_stop_waits_for_the_background_save_then_saves_its_own_step(tmp_path, monkeypatch):
    """``--exit-interval 3`` with a background save of step 2 still writing (held back here): the stop waits for it,
    then saves step 3; the tracker names step 3 and both checkpoints are intact."""
    import time

    from moefold.training.checkpoint import save as save_module

    real_finish = save_module.AsyncCheckpointer._finish

    def slow_finish(self, save, future):   # the write of step 2 outlasts step 3
        time.sleep(1.0)
        real_finish(self, save, future)

    monkeypatch.setattr(save_module.AsyncCheckpointer, "_finish", slow_finish)
    save, messages = tmp_path / "save", []
    run(tiny_config(steps=8, save=str(save), save_interval=2, keep_last=5, async_save=True, exit_interval=3),
        log=messages.append)
    saved = [m.split()[2] for m in messages if m.startswith("saved checkpoint")]
    assert saved == [str(save / "iter_0000002"), str(save / "iter_0000003")], messages
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000002", "iter_0000003"] and read_tracker(save) == 3
    assert all(verify_checkpoint(d) == [] for d in checkpoint_dirs(save))
