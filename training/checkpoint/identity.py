"""Run identity: which run a directory and a checkpoint belong to, and which checkpoint a run completed last.

A *run* is one training lineage: it starts fresh with a new run id and keeps that id through every resume
(``--load`` of its checkpoints continues it). The id is recorded in three places:

    RUN_DIR/run.json                       the run that owns this run directory (metrics, event files, reports)
    SAVE/run.json                          the run that owns this save directory (whose checkpoints a resume takes)
    SAVE/iter_N/meta.json  "run_id"        the run that wrote this checkpoint
    SAVE/latest_checkpointed_iteration.txt Megatron-LM's tracker: the iteration of the newest checkpoint the
                                           owning run completed (written after its rename, read by resumes)
    SAVE/previous/<run id>/iter_N          another run's checkpoint of an iteration this run saved (a run that
                                           writes beside another's, ``--override-save``): moved, never deleted

A resume of ``SAVE`` takes the checkpoint the tracker names, falling back to older intact ones of the same
run; checkpoints of another run (left by an earlier run in the same directory) are never taken. Directories
written before run ids existed (no ``run.json``, no tracker) resume from their newest intact checkpoint.

A run id read from a file names a directory (``previous/<run id>/``), so it must be a plain name
(``models.safe_names``): ``read_run`` and ``checkpoint_run_id`` raise ``UnsafeNameError`` (a ValueError of one line
naming the file) for ``../../x`` or an absolute path, and nothing is moved.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moefold.models.safe_names import inside, plain_name
from moefold.training.checkpoint.atomic import fsync_dir, write_atomic

RUN_FILE = "run.json"
SET_ASIDE = "previous"   # SAVE/previous/<run id>/iter_N: another run's checkpoint this run's save would replace
TRACKER = "latest_checkpointed_iteration.txt"   # Megatron-LM's name and format (the iteration, as text)


def new_run_id(stamp: str | None = None) -> str:
    """``<YYYYmmdd-HHMMSS>-<6 hex>``: sorts by start time, unique across hosts."""
    return f"{stamp or time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RunRecord:
    """What ``run.json`` says about the run that owns a directory."""

    run_id: str
    name: str                 # the recipe (or model) name
    created: float            # unix seconds of the run's first start
    host: str
    pid: int

    @classmethod
    def new(cls, run_id: str, name: str) -> RunRecord:
        return cls(run_id=run_id, name=name, created=time.time(), host=socket.gethostname(), pid=os.getpid())

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created))
        return f"run {self.run_id} ({self.name}, started {started})"


def read_run(directory: str | os.PathLike) -> RunRecord | None:
    """The ``run.json`` of ``directory`` (None when there is none or it cannot be read); ``UnsafeNameError`` when
    its run id is not a plain name."""
    path = Path(directory) / RUN_FILE
    try:
        d = json.loads(path.read_text())
        record = RunRecord(run_id=d["run_id"], name=str(d.get("name", "?")), created=float(d.get("created", 0)),
                           host=str(d.get("host", "?")), pid=int(d.get("pid", 0)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    plain_name(record.run_id, "run_id", path)
    return record


def write_run(directory: str | os.PathLike, record: RunRecord) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(directory) / RUN_FILE, json.dumps(asdict(record), indent=1, sort_keys=True))


def read_tracker(save: str | os.PathLike) -> int | None:
    """The iteration Megatron's tracker file names (None: no tracker, or one that is not a number)."""
    try:
        text = (Path(save) / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_tracker(save: str | os.PathLike, iteration: int) -> None:
    write_atomic(Path(save) / TRACKER, f"{iteration}\n")
    fsync_dir(Path(save))


def remove_tracker(save: str | os.PathLike) -> None:
    """A run that takes over ``save`` (``--override-save``) removes the tracker naming the previous run's."""
    (Path(save) / TRACKER).unlink(missing_ok=True)


def checkpoint_run_id(ckpt: str | os.PathLike) -> str | None:
    """The run id recorded in a checkpoint's ``meta.json`` (None: written before run ids, or unreadable);
    ``UnsafeNameError`` when it is not a plain name."""
    path = Path(ckpt) / "meta.json"
    try:
        rid = json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return plain_name(rid, "run_id", path) if rid else None


def set_aside(ckpt: Path, run_id: str | None) -> Path | None:
    """Before run ``run_id`` publishes its checkpoint under the name ``ckpt``: when ``ckpt`` holds another run's
    checkpoint, move it to ``SAVE/previous/<its run id>/`` (out of the ``iter_`` name space of ``SAVE``, so no
    resume takes it; a second one of the same name gets a suffix) and return where it went. None when ``ckpt`` is
    this run's own (rewritten, as after a resume from before it) or ``run_id`` is None (no run identity: the
    trainer used as a library)."""
    owner = checkpoint_run_id(ckpt)
    if run_id is None or owner == run_id:
        return None
    return keep_aside(ckpt, owner)


def keep_aside(ckpt: Path, owner: str | None) -> Path:
    """Move checkpoint ``ckpt`` to ``SAVE/previous/<owner>/`` (``owner`` None: ``unknown``), out of the ``iter_``
    name space, with a suffix when one of its name is there already; returns where it went."""
    (ckpt.parent / SET_ASIDE).mkdir(exist_ok=True)
    parent = inside(ckpt.parent / SET_ASIDE, owner or "unknown", "run_id", ckpt / "meta.json")
    parent.mkdir(parents=True, exist_ok=True)
    dest = parent / ckpt.name
    n = 1
    while dest.exists():
        dest, n = parent / f"{ckpt.name}.{n}", n + 1
    os.replace(ckpt, dest)
    fsync_dir(ckpt.parent)
    return dest


def describe_checkpoint(ckpt: str | os.PathLike) -> str:
    """``runs/r/checkpoints/iter_0000250 (iteration 250 of run 20261201-101500-3f9a2c, qwen3_moe_tiny)``: which
    checkpoint of which run a command took."""
    try:
        meta = json.loads((Path(ckpt) / "meta.json").read_text())
        config = meta.get("config") or {}
        name = config.get("recipe") or (config.get("model") or {}).get("name") or "?"
    except (OSError, ValueError, AttributeError, TypeError):
        return str(ckpt)
    run = f"run {meta['run_id']}" if meta.get("run_id") else "a run without a run id"
    return f"{ckpt} (iteration {meta.get('iteration', '?')} of {run}, {name})"
