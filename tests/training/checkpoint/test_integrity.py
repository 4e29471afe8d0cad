"""Checkpoints verify themselves: each class of damage falls back to the previous checkpoint with a message, a
crash during keep-last leaves nothing loadable, a failing save (full disk) says so, removes its temporary
directory and leaves the training state intact."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from moefold.parallel.dims import ParallelDims
from moefold.training.checkpoint import save as checkpoint_module
from moefold.training.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    CheckpointSaveError,
    checkpoint_dirs,
    find_checkpoint,
)
from moefold.training.trainer import Trainer
from tests.training.trainer_common import run, tiny_config, tiny_data

pytestmark = pytest.mark.usefixtures("one_thread")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shard(ckpt: Path) -> Path:
    (shard,) = ckpt.glob("*.distcp")
    return shard


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _half_deleted(ckpt: Path) -> None:
    """What a kill -9 during the old keep-last ``rmtree`` left: .metadata and meta.json, no shard."""
    for p in [*ckpt.glob("*.distcp"), ckpt / MANIFEST]:
        p.unlink()
    shutil.rmtree(ckpt / "rng")


DAMAGE = {  # name -> (how, what the message must say)
    "truncated shard": (lambda c: _truncate(_shard(c)), r"__0_0\.distcp has \d+ bytes, the manifest says \d+"),
    "deleted shard": (lambda c: _shard(c).unlink(), r"__0_0\.distcp is missing"),
    "truncated .metadata": (lambda c: _truncate(c / ".metadata"), r"\.metadata has \d+ bytes"),
    "truncated meta.json": (lambda c: _truncate(c / "meta.json"), r"meta\.json has \d+ bytes"),
    "empty rng file": (lambda c: (c / "rng" / "rank00000.pt").write_bytes(b""), r"rng/rank00000\.pt has 0 bytes"),
    "flipped byte in shard": (lambda c: _flip_a_byte(_shard(c)), r"__0_0\.distcp fails its crc32 check"),
    "truncated manifest": (lambda c: _truncate(c / MANIFEST), r"manifest\.json is unreadable"),
    ".metadata and meta.json but no shard": (_half_deleted, r"no manifest\.json"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[float]]:
    """Checkpoints of steps 1, 2, 3 and the uninterrupted 5-step losses."""
    save = tmp_path_factory.mktemp("ckpt") / "save"
    ref, _, _ = run(tiny_config())
    first, _, _ = run(tiny_config(save=str(save), save_interval=1, keep_last=3), stop_at=3)
    assert first == ref[:3] and [d.name for d in checkpoint_dirs(save)] == [f"iter_000000{i}" for i in (1, 2, 3)]
    return save, ref


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_damage_falls_back_to_the_previous_checkpoint(saved, tmp_path, damage):
    src, ref = saved
    save = tmp_path / "save"
    shutil.copytree(src, save)
    how, message = DAMAGE[damage]
    how(save / "iter_0000003")
    messages: list[str] = []
    if damage == "truncated shard":   # and the resumed run is the uninterrupted one, bit for bit
        rest, _, _ = run(tiny_config(), load=str(save), log=messages.append)
        assert rest == ref[2:]
    else:
        trainer = Trainer(tiny_config(), ParallelDims.single(), log=messages.append)
        assert trainer.load(str(save)) and (trainer.iteration, trainer.consumed_samples) == (2, 2 * 4)
    text = "\n".join(messages)
    assert "iter_0000003 is damaged" in text and re.search(message, text), text
    assert "falling back to" in text and "iter_0000002" in text and "resumed from" in text, text
    # named explicitly, a damaged checkpoint is an error, not a silent substitute
    with pytest.raises(CheckpointError, match=f"iter_0000003 is damaged: .*{message}"):
        find_checkpoint(save / "iter_0000003", log=lambda _m: None)


def test_only_damaged_checkpoints_refuse_to_start_from_scratch(saved, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(saved[0], save)
    for ckpt in checkpoint_dirs(save):
        _truncate(_shard(ckpt))
    with pytest.raises(CheckpointError, match=r"no intact checkpoint under .*iter_0000003, iter_0000002, iter_0000001"
                                              r".*refusing to start from scratch"):
        Trainer(tiny_config(), ParallelDims.single(), log=lambda _m: None).load(str(save))


def test_crash_during_keep_last_leaves_nothing_loadable(saved, tmp_path):
    """keep-last renames a doomed directory out of the iter_ name space before deleting it: a crash midway leaves
    a .del- directory, which loading ignores and the next save removes; the newer checkpoint is used."""
    save = tmp_path / "save"
    shutil.copytree(saved[0], save)
    doomed = save / ".del-iter_0000004"
    shutil.copytree(save / "iter_0000003", doomed)
    _half_deleted(doomed)
    trainer = Trainer(tiny_config(save=str(save), keep_last=2), ParallelDims.single(), log=lambda _m: None)
    assert trainer.load(str(save)) and trainer.iteration == 3
    trainer.fit(tiny_data(), stop_at=4)
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004"]


def test_keep_last_never_keeps_a_damaged_checkpoint_over_an_intact_one(saved, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(saved[0], save)
    _truncate(_shard(save / "iter_0000002"))
    trainer = Trainer(tiny_config(save=str(save), keep_last=3), ParallelDims.single(), log=lambda _m: None)
    assert trainer.load(str(save)) and trainer.iteration == 3
    trainer.fit(tiny_data(), stop_at=4)   # keeps 4 and the two newest intact older ones: 3 and 1
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000001", "iter_0000003", "iter_0000004"]


def test_resuming_before_a_damaged_checkpoint_rewrites_it(saved, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(saved[0], save)
    _truncate(_shard(save / "iter_0000002"))
    trainer = Trainer(tiny_config(save=str(save), keep_last=1), ParallelDims.single(), log=lambda _m: None)
    assert trainer.load(str(save / "iter_0000001")) and trainer.iteration == 1
    trainer.fit(tiny_data(), stop_at=2)   # replaces the damaged iter_2; the newer iter_3 is not this run's to delete
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000003"]
    assert find_checkpoint(save / "iter_0000002", log=lambda _m: None)


def _disk_full_during(monkeypatch, failing_steps: set[int]) -> list[int]:
    """At the listed iterations DCP's file writer writes part of a tensor and then fails with ENOSPC (which DCP
    reports as its CheckpointException, a BaseException)."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    real_save, real_write, calls = checkpoint_module.dcp.save, dcp_files._write_item, []

    def save(state, checkpoint_id, **kwargs):
        calls.append(int(Path(checkpoint_id).name.rsplit("_", 1)[1]))
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    def write_item(transforms, stream, *args, **kwargs):
        if calls[-1] in failing_steps:
            stream.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", save)
    monkeypatch.setattr(dcp_files, "_write_item", write_item)
    return calls


def test_a_full_disk_during_a_save_is_named_cleaned_up_and_training_continues(monkeypatch, tmp_path):
    ref, ref_params, _ = run(tiny_config(steps=3))
    save = tmp_path / "save"
    calls = _disk_full_during(monkeypatch, {2})
    messages: list[str] = []
    losses, params, _ = run(tiny_config(steps=3, save=str(save), save_interval=1, keep_last=5), log=messages.append)
    assert calls == [1, 2, 3] and losses == ref
    assert all(torch.equal(params[k], v) for k, v in ref_params.items())
    text = "\n".join(messages)
    assert ("saving checkpoint iter_0000002 failed: the disk is full (OSError: [Errno 28] No space left on device (in "
            "torch.distributed.checkpoint on rank 0)") in text, text
    assert f"no partial checkpoint is left in {save}; training continues, the next save tries again" in text, text
    # no .tmp- left behind
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000001", "iter_0000003"]
    # the last save must succeed: a run whose final checkpoint fails ends with the error
    _disk_full_during(monkeypatch, {3})
    with pytest.raises(CheckpointSaveError, match=r"iter_0000003 failed: the disk is full .* needs about [\d.]+ MiB"):
        run(tiny_config(steps=3, save=str(tmp_path / "other")))
    assert list((tmp_path / "other").iterdir()) == []


def test_a_save_checks_the_free_space_before_writing(monkeypatch, tmp_path):
    monkeypatch.setattr(checkpoint_module, "free_bytes", lambda _p: 4096)
    with pytest.raises(CheckpointSaveError, match=r"not enough free space: 4\.0 KiB free on .*, the checkpoint needs "
                                                  r"about [\d.]+ MiB"):
        run(tiny_config(steps=1, save=str(tmp_path / "save")))
    assert list((tmp_path / "save").iterdir()) == []


def test_a_disk_sized_for_keep_last_checkpoints_keeps_saving(monkeypatch, tmp_path):
    """A disk with room for keep-last checkpoints and a half: the checkpoint keep-last would drop after a save is
    retired before it, when the space is short (it used to fail every save after the keep-last-th)."""
    ref, _, _ = run(tiny_config(steps=5))
    save = tmp_path / "save"
    run(tiny_config(steps=1, save=str(tmp_path / "probe")))
    one = sum(f.stat().st_size for f in (tmp_path / "probe" / "iter_0000001").rglob("*") if f.is_file())

    def free(_path) -> int:   # a 2.5-checkpoint disk: its capacity less what the save directory holds
        used = sum(f.stat().st_size for f in save.rglob("*") if f.is_file()) if save.exists() else 0
        return int(2.5 * one) - used

    monkeypatch.setattr(checkpoint_module, "free_bytes", free)
    messages: list[str] = []
    losses, _, _ = run(tiny_config(steps=5, save=str(save), save_interval=1, keep_last=2), log=messages.append)
    assert losses == ref
    assert [m for m in messages if "failed" in m] == [], messages
    assert [d.name for d in checkpoint_dirs(save)] == ["iter_0000004", "iter_0000005"]
    assert any(m.startswith(f"saved checkpoint {save / 'iter_0000003'}") and m.endswith("removed iter_0000001")
               for m in messages), messages


def test_manifest_lists_every_file(saved):
    ckpt = saved[0] / "iter_0000003"
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(files) == on_disk and {".metadata", "meta.json", "rng/rank00000.pt"} <= set(files)
    assert all(e["size"] == (ckpt / n).stat().st_size for n, e in files.items())
