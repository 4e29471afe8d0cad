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

A rollback (``--load SAVE/iter_N --save SAVE`` while ``SAVE`` holds this run's later checkpoints) moves the
tracker to ``N`` when the run starts and the later checkpoints to ``SAVE/previous/<run id>/`` (kept, not deleted), so
a crash before the rollback's first save resumes ``iter_N``, not the abandoned branch.

Every failure is a ValueError with one line naming the directory, the run that holds it and the way out, and a
refused run leaves nothing behind: the directories its claim created (``runs/<name>/...``, ``--run-dir``,
``--save``) are removed again when they hold nothing but what the claim put there.
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

from moefold.models.safe_names import inside
from moefold.training.checkpoint.files import (
    CheckpointError,
    check_before_reading,
    checkpoint_dirs,
    is_checkpoint_dir,
    iteration_of,
    resume_candidates,
)
from moefold.training.checkpoint.identity import (
    RUN_FILE,
    RunRecord,
    checkpoint_run_id,
    keep_aside,
    new_run_id,
    read_run,
    read_tracker,
    remove_tracker,
    write_run,
    write_tracker,
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
    made: list[Path] = dataclasses.field(default_factory=list)   # the topmost directories the claim created
    rollback: list[Path] = dataclasses.field(default_factory=list)   # this run's checkpoints after resume_from

    def record(self, say: Callable[[str], None] = print) -> None:
        for directory in (self.run_dir, self.save):
            if directory is not None and getattr(read_run(directory), "run_id", None) != self.run_id:
                write_run(directory, RunRecord.new(self.run_id, self.name))
        if self.rollback and self.save is not None and self.resume_from is not None:
            iteration = iteration_of(self.resume_from)
            write_tracker(self.save, iteration)   # first: a crash from here on resumes the rollback's start
            moved = [keep_aside(d, self.run_id) for d in self.rollback]
            say(f"rolling back to {self.resume_from.name}: the tracker names iteration {iteration}; the later "
                f"{', '.join(d.name for d in self.rollback)} moved to {moved[0].parent} (kept, not deleted)")

    def abandon(self) -> None:
        self.release()
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            link = self.created.parent / LATEST
            if self.latest_before is None:
                link.unlink(missing_ok=True)
            else:
                _point(link, self.latest_before)
        for top in self.made:
            _remove_if_only_ours(top)

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


def _missing_top(path: str | os.PathLike | None) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (what creating ``path`` creates first)."""
    if path is None:
        return None
    p, top = Path(path).absolute(), None
    while not p.exists() and p != p.parent:
        p, top = p.parent, p
    return top


def _remove_if_only_ours(top: Path) -> None:
    """Remove directory ``top`` (created by a claim) bottom-up if it holds only empty directories, the lock file
    and a ``latest`` link: what a refused claim left; anything else written there stays."""
    if not top.is_dir() or top.is_symlink():
        return
    for d, dirs, files in os.walk(top, topdown=False):
        for f in files + dirs:   # a link to a directory is listed with the directories
            if f == LOCK_FILE or (f == LATEST and Path(d, f).is_symlink()):
                Path(d, f).unlink(missing_ok=True)
        try:
            os.rmdir(d)
        except OSError:
            return   # not empty: something else is there


def _same(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def resume_checkpoint(load: str | os.PathLike) -> Path | None:
    """The checkpoint a resume of ``load`` will take, as far as the files say before their shards' checksums
    (``check_before_reading``: sizes, and the crc32 of the small files, checked before any is parsed): ``load``
    itself when it is one (ValueError when it is damaged), else the newest intact one of ``resume_candidates``
    (ValueError when they refuse: a tracker naming a missing checkpoint with only newer ones there)."""
    load = Path(load)
    try:
        if is_checkpoint_dir(load):
            problems = check_before_reading(load)
            if problems:
                raise CheckpointError(f"checkpoint {load} is damaged: {'; '.join(problems[:3])}; pass its parent "
                                      "directory to resume from the newest intact checkpoint instead")
            return load
        candidates = resume_candidates(load, log=lambda _m: None)
    except CheckpointError as exc:
        raise ValueError(f"--load {load}: {exc}") from None
    for d in candidates:
        if not check_before_reading(d):
            return d
    return None


def read_checkpoint_meta(ckpt: Path) -> tuple[str | None, RunConfig | None]:
    """(run id, the RunConfig) that ``ckpt``'s meta.json records; ValueError (one line naming the file and the
    field) when a field has the wrong type: a meta.json that parsed but does not describe a run."""
    where = ckpt / "meta.json"
    try:
        meta: Any = read_meta(ckpt)
        if not isinstance(meta, dict):
            raise TypeError(f"it holds a {type(meta).__name__}, not an object")
        run_id = checkpoint_run_id(ckpt)
        config = RunConfig.from_dict(meta["config"]) if meta.get("config") else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise ValueError(f"{where} does not describe a run ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                         "pass --load of another checkpoint, or move this one away") from None
    return run_id, config


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
    (run_dir / PREVIOUS).mkdir(exist_ok=True)
    dest = inside(run_dir / PREVIOUS, owner.run_id if owner else f"unknown-{time.strftime('%Y%m%d-%H%M%S')}",
                  "run_id", run_dir / RUN_FILE)
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


def _rolled_back(save: Path, resume_from: Path | None, run_id: str) -> list[Path]:
    """This run's checkpoints in ``save`` later than ``resume_from``, when that is one of ``save``'s own (a
    rollback: ``--load SAVE/iter_N``); else nothing."""
    if resume_from is None or iteration_of(resume_from) is None or not _same(resume_from.parent, save):
        return []
    return [d for d in checkpoint_dirs(save) if iteration_of(d) > iteration_of(resume_from)
            and checkpoint_run_id(d) in (run_id, None)]


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
        run_id, resumed = read_checkpoint_meta(resume_from)
    elif t.load and (owner := read_run(t.load)) is not None:
        run_id = owner.run_id   # --save D --load D of a run that had not saved yet: still that run
    run_id = run_id or new_run_id()
    previous = resumed.train.run_dir if resumed is not None else None
    created = latest_before = None
    made = [m for m in (_missing_top(t.run_dir), _missing_top(t.save), _missing_top(Path(runs_root) / run_name(
        config))) if m is not None]
    if t.run_dir is not None:
        run_dir = Path(t.run_dir)
    elif previous and Path(previous).is_dir() and getattr(read_run(previous), "run_id", run_id) == run_id:
        run_dir = Path(previous)   # a resume goes on in the run's own directory
    else:
        run_dir, latest_before = _new_run_dir(Path(runs_root), run_name(config))
        created = run_dir
    claim = Claim(run_id, run_name(config), run_dir, None, resume_from, None, created, latest_before, made)
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
        if t.load and claim.resume_from is not None and _same(t.load, claim.resume_from):   # named explicitly
            claim.rollback = _rolled_back(save, claim.resume_from, run_id)
    config = dataclasses.replace(config, train=dataclasses.replace(t, run_dir=str(run_dir),
                                                                   save=str(save) if save else None, run_id=run_id))
    return config, claim


__all__ = ["Claim", "claim_run", "resume_checkpoint", "run_name", "RUNS_ROOT", "LATEST", "RUN_FILE"]
