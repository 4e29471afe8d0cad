"""Which run this is, where it writes, and that nothing else writes there: decided once, before any rank starts.

A fresh run (no ``--load``) gets a new run id and, unless ``--run-dir`` names one, its own run directory
``runs/<recipe>/<YYYYmmdd-HHMMSS>`` with ``runs/<recipe>/latest`` pointing at it. A resume continues the run it
loads: the checkpoint's run id and, unless ``--run-dir`` names another, that run's directory (so its metrics
go on where they were). ``--save`` defaults to ``RUN_DIR/checkpoints``.

A run never writes over another run: a ``--run-dir`` that holds another run's ``run.json`` or metrics needs
``--load`` of that run (a resume) or ``--override-run-dir`` (the other run's files are moved to
``RUN_DIR/previous/<its run id>/``, not deleted); a ``--save`` that holds another run's checkpoints needs
``--load`` of them or ``--override-save`` (they stay, but this run's tracker, resumes and keep-last never take
or delete them; one of an iteration this run saves is moved to ``SAVE/previous/<its run id>/``). Then the
save directory's lock is taken (``training.checkpoint.lock``: a second run into the same ``--save`` fails here,
naming the first), and ``run.json`` is written to the run and save directories (``training.checkpoint.identity``).

Every failure is a ValueError with one line naming the directory, the run that holds it and the way out.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moefold.training.checkpoint.files import checkpoint_dirs, is_checkpoint_dir, resume_candidates
from moefold.training.checkpoint.identity import (
    RUN_FILE,
    RunRecord,
    checkpoint_run_id,
    new_run_id,
    read_run,
    read_tracker,
    remove_tracker,
    write_run,
)
from moefold.training.checkpoint.lock import LOCK_FILE, SaveLock, SaveLockError
from moefold.training.checkpoint.sharded import read_meta
from moefold.training.config import RunConfig
from moefold.training.launch.preflight import refuse_megatron_load, writable_dir

RUNS_ROOT = "runs"
LATEST = "latest"
PREVIOUS = "previous"
METRICS = "metrics.jsonl"


@dataclass
class Claim:
    """The outcome: the run's id, its directories, the checkpoint a resume will start from (as the ranks will
    find it, before their checksums) and the held lock (``release()`` / ``with``). ``record()`` writes the run's
    ``run.json`` once the pre-flight checks passed; ``abandon()`` undoes a claim whose run does not start (a new
    run directory is removed again, ``latest`` points where it pointed)."""

    run_id: str
    name: str
    run_dir: Path
    save: Path | None
    resume_from: Path | None
    lock: SaveLock | None
    created: Path | None = None          # the run directory this claim made
    latest_before: str | None = None     # where runs/<name>/latest pointed before

    def record(self) -> None:
        for directory in (self.run_dir, self.save):
            if directory is not None and getattr(read_run(directory), "run_id", None) != self.run_id:
                write_run(directory, RunRecord.new(self.run_id, self.name))

    def abandon(self) -> None:
        self.release()
        if self.created is None:
            return
        shutil.rmtree(self.created, ignore_errors=True)
        link = self.created.parent / LATEST
        if self.latest_before is None:
            link.unlink(missing_ok=True)
        else:
            _point(link, self.latest_before)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def run_name(config: RunConfig) -> str:
    """What ``runs/<name>/`` is called: the recipe, else the model's name."""
    return config.recipe or config.model.name


def _same(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def resume_checkpoint(load: str | os.PathLike) -> Path | None:
    """The checkpoint a resume of ``load`` will take, as far as the files say before checksums: ``load`` itself
    when it is one, else the newest of ``resume_candidates`` whose manifest and meta.json are there."""
    load = Path(load)
    if is_checkpoint_dir(load):
        return load
    for d in resume_candidates(load, log=lambda _m: None):
        try:
            read_meta(d)
        except (OSError, ValueError):
            continue
        if (d / "manifest.json").is_file():
            return d
    return None


def _holder(directory: Path) -> str:
    owner = read_run(directory)
    return owner.describe() if owner else "an earlier run (written before run ids)"


def _point(link: Path, target: str) -> None:
    """Make symlink ``link`` point at ``target`` (relative), atomically."""
    tmp = link.with_name(f".{link.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


def _new_run_dir(root: Path, name: str) -> tuple[Path, str | None]:
    """``root/name/<timestamp>`` created here (a suffix when another run started in the same second), with
    ``root/name/latest`` pointing at it; and where ``latest`` pointed before (None: nowhere)."""
    parent = root / name
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--run-dir {parent}/...: cannot be created: {exc.strerror or exc}") from None
    link = parent / LATEST
    before = os.readlink(link) if link.is_symlink() else None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        d = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        _point(link, d.name)
        return d, before
    raise ValueError(f"{parent}: could not create a new run directory (1000 runs started at {stamp}?)")


def _check_run_dir(run_dir: Path, run_id: str, resumed: RunConfig | None, override: bool,
                   say: Callable[[str], None]) -> None:
    owner = read_run(run_dir)
    legacy = owner is None and (run_dir / METRICS).is_file()
    if owner is not None and owner.run_id == run_id:
        return
    if owner is None and not legacy:
        return
    if legacy and resumed is not None and _same(resumed.train.run_dir, run_dir):
        return   # the run this resume continues wrote it, before run ids
    if not override:
        raise ValueError(f"--run-dir {run_dir} holds the metrics of {_holder(run_dir)}; continue that run with "
                         "--load of its checkpoints, choose another --run-dir (without one, each run gets its own), "
                         "or pass --override-run-dir to move its files aside")
    dest = run_dir / PREVIOUS / (owner.run_id if owner else f"unknown-{time.strftime('%Y%m%d-%H%M%S')}")
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for entry in run_dir.iterdir():
        if entry.name in (PREVIOUS, "checkpoints", LOCK_FILE) or entry.name.startswith("."):   # the lock is ours
            continue
        shutil.move(str(entry), str(dest / entry.name))
        moved.append(entry.name)
    say(f"--override-run-dir: moved {_holder(dest) if owner else 'the earlier run'}'s {', '.join(moved) or 'files'} "
        f"to {dest}")


def _check_save(save: Path, run_id: str, resuming_here: bool, override: bool, say: Callable[[str], None]) -> None:
    if resuming_here:
        return
    foreign = [d for d in checkpoint_dirs(save) if checkpoint_run_id(d) != run_id]
    if not foreign:
        return
    names = ", ".join(d.name for d in foreign[-3:]) + (f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else "")
    if not override:
        raise ValueError(f"--save {save} holds checkpoints of {_holder(save)}: {names}; continue that run with "
                         f"--load {save}, choose another --save, or pass --override-save (its checkpoints stay, "
                         "but this run never resumes from them nor deletes them)")
    if read_tracker(save) is not None:
        remove_tracker(save)
    say(f"--override-save: {save} holds {names} of {_holder(save)}; this run writes its own checkpoints beside them "
        f"(one of an iteration it saves is moved to {save}/previous/)")


def claim_run(config: RunConfig, *, default_save: bool, override_save: bool = False,
              override_run_dir: bool = False, runs_root: str | os.PathLike = RUNS_ROOT,
              say: Callable[[str], None] = print) -> tuple[RunConfig, Claim]:
    """Decide the run id, run directory and save directory of ``config`` (``config.train.run_dir`` None: the
    default; ``default_save``: ``--save`` not given and not ``--no-save``), refuse to write over another run and
    take the save directory's lock (module docstring). Returns the config with ``run_dir``, ``save`` and
    ``run_id`` set, and the ``Claim`` holding the lock (``record()`` it when the run starts). ValueError (one
    line) when it cannot; nothing is left behind then."""
    t = config.train
    refuse_megatron_load(t.load)   # before its .metadata is taken for a moefold checkpoint's
    resume_from = resume_checkpoint(t.load) if t.load and Path(t.load).exists() else None
    resumed: RunConfig | None = None
    run_id = None
    if resume_from is not None:
        meta: dict[str, Any] = read_meta(resume_from)
        run_id = meta.get("run_id")
        if meta.get("config"):
            resumed = RunConfig.from_dict(meta["config"])
    elif t.load and (owner := read_run(t.load)) is not None:
        run_id = owner.run_id   # --save D --load D of a run that had not saved yet: still that run
    run_id = run_id or new_run_id()
    previous = resumed.train.run_dir if resumed is not None else None
    created = latest_before = None
    if t.run_dir is not None:
        run_dir = Path(t.run_dir)
    elif previous and Path(previous).is_dir() and getattr(read_run(previous), "run_id", run_id) == run_id:
        run_dir = Path(previous)   # a resume goes on in the run's own directory
    else:
        run_dir, latest_before = _new_run_dir(Path(runs_root), run_name(config))
        created = run_dir
    claim = Claim(run_id, run_name(config), run_dir, None, resume_from, None, created, latest_before)
    try:
        return _claim(config, claim, default_save, override_save, override_run_dir, resumed, say)
    except BaseException:
        claim.abandon()
        raise


def _claim(config: RunConfig, claim: Claim, default_save: bool, override_save: bool, override_run_dir: bool,
           resumed: RunConfig | None, say: Callable[[str], None]) -> tuple[RunConfig, Claim]:
    t, run_dir, run_id = config.train, claim.run_dir, claim.run_id
    writable_dir(str(run_dir), "--run-dir")
    save = Path(t.save) if t.save else (run_dir / "checkpoints" if default_save else None)
    if save is not None:
        writable_dir(str(save), "--save")
    try:   # first the lock: what follows looks at (and may move) what another live run would be writing
        claim.lock = SaveLock.acquire(save if save is not None else run_dir, run_id, say=say)
    except SaveLockError as exc:
        raise ValueError(str(exc) if save is not None else str(exc).replace("--save", "--run-dir")) from None
    claim.save = save
    _check_run_dir(run_dir, run_id, resumed, override_run_dir, say)
    if save is not None:
        resuming_here = bool(t.load) and (_same(t.load, save) or _same(Path(t.load).parent, save))
        _check_save(save, run_id, resuming_here, override_save, say)
    config = dataclasses.replace(config, train=dataclasses.replace(t, run_dir=str(run_dir),
                                                                   save=str(save) if save else None, run_id=run_id))
    return config, claim


__all__ = ["Claim", "claim_run", "resume_checkpoint", "run_name", "RUNS_ROOT", "LATEST", "RUN_FILE"]
