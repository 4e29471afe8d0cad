"""Issue 47's fault table, a test per row that failed: a rollback then a crash, a tracker naming a missing
checkpoint, keep-last 1 on a nearly full disk, a flipped byte in ``.metadata``, run ids and DCP shard names from
files used as paths, a wrong-typed ``meta.json`` field and a payload in a ``.distcp`` (one line, exit 2, before
any rank starts), and a refused run leaving no directories behind (issue 48, item 7).

One real run (world 1, 4 steps, a checkpoint each) is made once; every test damages a copy of it."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from moefold.models.dcp_metadata import read_dcp_metadata
from moefold.training.checkpoint import save as checkpoint_module
from moefold.training.checkpoint.files import (
    CheckpointSaveError,
    checkpoint_dirs,
    complete_checkpoints,
    find_checkpoint,
    write_manifest,
)
from moefold.training.checkpoint.identity import RUN_FILE, TRACKER, checkpoint_run_id, read_run, read_tracker
from moefold.training.checkpoint.lock import LOCK_FILE
from moefold.training.cli import main as cli_main
from moefold.training.cli.train import config_from_args, train_parser
from moefold.training.launch.claim import claim_run
from tests.training.launch.cli_runs import TINY, corpus
from tests.training.trainer_common import run, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return ["--data-path", str(corpus(tmp_path_factory.mktemp("data") / "tiny"))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data) -> Path:
    """A run's directory: run.json, iter_1..iter_4 (each of that run), the tracker naming 4."""
    root = tmp_path_factory.mktemp("run")
    code = cli_main(["train", *TINY, *data, "--train-iters", "4", "--save-interval", "1", "--keep-last", "4",
                     "--run-dir", str(root / "run"), "--save", str(root / "save"), "--no-progress"])
    assert code == 0 and read_tracker(root / "save") == 4
    return root


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True, symlinks=True)
    return tmp_path / "run", tmp_path / "save"


def _remanifest(ckpt: Path) -> None:
    """Recompute the manifest (a crafted checkpoint that looks intact)."""
    write_manifest(ckpt, None)


def _train(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["train", *TINY, "--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _one_error_line(out: str) -> str:
    errors = [line for line in out.splitlines() if line.startswith("moefold train: error:")]
    assert len(errors) == 1 and "Traceback" not in out and "model:" not in out, out   # before any rank started
    return errors[0]


def _resume_refused(capsys, data: list[str], run_dir: Path, save: Path) -> str:
    """``--load SAVE --save SAVE`` refused before any rank: its one error line."""
    code, out = _train(capsys, *data, "--train-iters", "5", "--run-dir", str(run_dir), "--save", str(save),
                       "--load", str(save))
    assert code == 2, out
    return _one_error_line(out)


# ------------------------------------------------------------------------------------------ row 1: rollback
def test_a_rollback_then_a_crash_resumes_the_rollback_not_the_abandoned_branch(saved, tmp_path, data):
    run_dir, save = _copy(saved, tmp_path)
    rid = read_run(save).run_id
    args = train_parser().parse_args([*TINY, *data, "--train-iters", "6", "--run-dir", str(run_dir), "--save",
                                      str(save), "--load", str(save / "iter_0000002")])
    said: list[str] = []
    _, claim = claim_run(config_from_args(args), default_save=False, say=said.append)
    claim.record(say=said.append)   # the run starts ... and crashes before its first save
    claim.release()
    assert read_tracker(save) == 2
    kept = save / "previous" / rid
    assert sorted(p.name for p in kept.iterdir()) == ["iter_0000003", "iter_0000004"]   # kept aside, not deleted
    assert all(checkpoint_run_id(p) == rid and (p / "manifest.json").is_file() for p in kept.iterdir())
    assert said[-1].startswith("rolling back to iter_0000002: the tracker names iteration 2; the later "
                               f"iter_0000003, iter_0000004 moved to {kept}"), said
    # the restart (--load D --save D) resumes the rollback's start, not iter_4 of the abandoned branch
    assert find_checkpoint(save, log=lambda _m: None) == save / "iter_0000002"


# ------------------------------------------------------------------------------------------ row 2: trackers
def test_a_tracker_naming_a_missing_checkpoint_never_starts_from_scratch(saved, tmp_path, data, capsys):
    run_dir, save = _copy(saved, tmp_path)
    shutil.rmtree(save / "iter_0000001")
    (save / TRACKER).write_text("1\n")   # names a checkpoint that is gone; iter_2..4 of the run are intact
    code, out = _train(capsys, *data, "--train-iters", "6", "--run-dir", str(run_dir), "--save", str(save),
                       "--load", str(save))
    assert code == 2, out
    line = _one_error_line(out)
    assert f"{save / TRACKER} names iteration 1, but {save / 'iter_0000001'} is missing and the run's checkpoints " \
           "(iter_0000004, iter_0000003, iter_0000002) are all newer; refusing to start from scratch" in line, line
    assert f"--load {save / 'iter_0000004'}" in line
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000002", "iter_0000003", "iter_0000004"]
    # a tracker naming a missing checkpoint with older ones there: the resume falls back, saying why
    (save / TRACKER).write_text("3\n")
    shutil.rmtree(save / "iter_0000003")
    said: list[str] = []
    assert find_checkpoint(save, log=said.append) == save / "iter_0000002"
    assert f"{save / TRACKER} names iteration 3, but {save / 'iter_0000003'} is missing: falling back" in "\n".join(
        said)


def test_keep_last_1_on_a_nearly_full_disk_never_deletes_the_only_checkpoint(monkeypatch, tmp_path):
    save = tmp_path / "save"
    run(tiny_config(steps=1, save=str(tmp_path / "probe")))
    one = sum(f.stat().st_size for f in (tmp_path / "probe" / "iter_0000001").rglob("*") if f.is_file())

    def free(_path) -> int:   # a disk of 1.5 checkpoints: its capacity less what the save directory holds
        used = sum(f.stat().st_size for f in save.rglob("*") if f.is_file()) if save.exists() else 0
        return int(1.5 * one) - used

    complete_while_writing: list[list[str]] = []
    write_rng = checkpoint_module._save_rng

    def save_rng(path: Path) -> None:   # called while a checkpoint is being written: what could a crash resume?
        complete_while_writing.append([d.name for d in complete_checkpoints(save)])
        write_rng(path)

    monkeypatch.setattr(checkpoint_module, "free_bytes", free)
    monkeypatch.setattr(checkpoint_module, "_save_rng", save_rng)
    messages: list[str] = []
    try:
        run(tiny_config(steps=2, save=str(save), save_interval=1, keep_last=1), log=messages.append)
    except CheckpointSaveError as exc:   # the final save (step 2) fails: the run says so and ends
        messages.append(str(exc))
    assert complete_while_writing[0] == []   # the first save: nothing to lose
    assert all(complete_while_writing[1:]), complete_while_writing   # a kill -9 at any point leaves one to resume
    assert [d.name for d in complete_checkpoints(save)] == ["iter_0000001"]
    assert any("saving checkpoint iter_0000002 failed: not enough free space" in m for m in messages), messages


# ------------------------------------------------------------------------------------------ row 3: .metadata
def test_a_flipped_byte_in_the_newest_metadata_falls_back(saved, tmp_path, data, capsys):
    run_dir, save = _copy(saved, tmp_path)
    meta = save / "iter_0000004" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[raw.index(b"TensorStorageMetadata")] ^= 0x01   # a class name the unpickler would refuse
    meta.write_bytes(bytes(raw))
    code, out = _train(capsys, *data, "--train-iters", "5", "--run-dir", str(run_dir), "--save", str(save),
                       "--load", str(save))
    assert code == 0, out
    assert "iter_0000004 is damaged: .metadata fails its crc32 check" in out, out
    assert f"resumed from {save / 'iter_0000003'} at iteration 3" in out, out


# ------------------------------------------------------------------------------------------ row 4: names
@pytest.mark.parametrize("where", ["run.json", "meta.json"])
@pytest.mark.parametrize("rid", ["../../../X", "/tmp/elsewhere"])
def test_a_run_id_from_a_file_never_becomes_a_path(saved, tmp_path, data, capsys, where, rid):
    run_dir, save = _copy(saved, tmp_path / "copy")
    if where == "run.json":   # the run directory's owner: --override-run-dir would move its files to previous/<id>
        record = json.loads((run_dir / RUN_FILE).read_text())
        (run_dir / RUN_FILE).write_text(json.dumps(dict(record, run_id=rid)))
        args = ["--run-dir", str(run_dir), "--override-run-dir", "--no-save"]
        culprit = run_dir / RUN_FILE
    else:   # a checkpoint's run: --override-save would move it to previous/<id>
        ckpt = save / "iter_0000002"
        record = json.loads((ckpt / "meta.json").read_text())
        (ckpt / "meta.json").write_text(json.dumps(dict(record, run_id=rid)))
        _remanifest(ckpt)
        args = ["--run-dir", str(tmp_path / "new"), "--save", str(save), "--override-save"]
        culprit = ckpt / "meta.json"
    def files() -> list[str]:   # (the lock file an existing directory gets is emptied, and no news)
        return sorted(str(p) for p in tmp_path.rglob("*") if p.name != LOCK_FILE)

    before = files()
    code, out = _train(capsys, *data, "--train-iters", "2", *args)
    assert code == 2, out
    assert f"{culprit}: run_id {rid!r} is not a plain name" in _one_error_line(out)
    assert files() == before   # nothing moved, nothing created
    assert not Path("/tmp/elsewhere").exists()


def test_a_shard_path_in_dcp_metadata_outside_the_checkpoint_is_refused(saved, tmp_path, data, capsys):
    run_dir, save = _copy(saved, tmp_path)
    ckpt = save / "iter_0000004"
    shutil.copy(ckpt / "__0_0.distcp", tmp_path / "outside.distcp")   # what it would read
    md = read_dcp_metadata(ckpt / ".metadata")
    for info in md.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _remanifest(ckpt)
    line = _resume_refused(capsys, data, run_dir, save)
    assert f"{ckpt / '.metadata'}: shard file '../../outside.distcp' is not a plain name" in line


# ------------------------------------------------------------------------------------------ row 7: one line
def test_a_wrong_typed_meta_json_field_is_one_line_before_any_rank(saved, tmp_path, data, capsys):
    run_dir, save = _copy(saved, tmp_path)
    ckpt = save / "iter_0000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["train"] = ["not", "a", "mapping"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _remanifest(ckpt)
    assert f"{ckpt / 'meta.json'} does not describe a run" in _resume_refused(capsys, data, run_dir, save)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PAYLOAD_RAN",))


def test_a_payload_in_a_distcp_is_one_line_before_any_rank(saved, tmp_path, data, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir, save = _copy(saved, tmp_path)
    ckpt = save / "iter_0000004"
    record = io.BytesIO()
    torch.save(_Payload(), record)
    shard = ckpt / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(record.getvalue())
    md = read_dcp_metadata(ckpt / ".metadata")
    first = next(iter(md.storage_data))
    md.storage_data[first].offset, md.storage_data[first].length = offset, len(record.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _remanifest(ckpt)
    line = _resume_refused(capsys, data, run_dir, save)
    assert f"{shard} (the record at byte {offset}) asks to load posix.system" in line, line
    assert not (tmp_path / "PAYLOAD_RAN").exists()


# ------------------------------------------------------------------------------------------ issue 48, item 7
def test_a_run_refused_at_pre_flight_leaves_no_directories(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = ["--data-path", str(tmp_path / "no-such-corpus")]
    code, out = _train(capsys, *missing, "--train-iters", "2")
    assert code == 2 and "no-such-corpus" in _one_error_line(out)
    code, out = _train(capsys, *missing, "--train-iters", "2", "--run-dir", str(tmp_path / "a" / "r"), "--save",
                       str(tmp_path / "b" / "ckpt"))
    assert code == 2 and "no-such-corpus" in _one_error_line(out)
    assert list(tmp_path.iterdir()) == []   # no runs/<name>/, no run directory, no checkpoints/
