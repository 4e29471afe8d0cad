"""The files of a checkpoint directory: the manifest that makes a checkpoint verifiable, the choice of the
newest intact checkpoint (with a fallback past damaged ones), keep-last pruning and the save directory's
free space. Nothing here knows what tensors a checkpoint holds (``training.checkpoint.sharded`` does).

A save directory::

    SAVE/iter_0000100/        a checkpoint: its files, then manifest.json, written last before the rename
    SAVE/.tmp-iter_0000200/   being written, or left by a crash: never loaded, removed by the next save
    SAVE/.del-iter_0000050/   being deleted (keep-last, or replaced): never loaded, removed by the next save
    SAVE/run.json             the run that owns the directory; SAVE/latest_checkpointed_iteration.txt: Megatron's
                              tracker, the newest checkpoint that run completed (``training.checkpoint.identity``)
    SAVE/moefold.lock         held by the run writing here (``training.checkpoint.lock``)

``manifest.json`` lists every other file of the checkpoint (relative path -> size in bytes and crc32).
A checkpoint is intact when its manifest parses and every listed file exists with that size and crc32;
anything else (a truncated or deleted shard, a truncated ``.metadata`` or ``meta.json``, an empty RNG
file, a directory a crash left half-deleted) makes it damaged, and loading falls back to the newest
intact one, saying why. A resume takes the tracker's checkpoint of the owning run (falling back past
damaged ones to older ones of the same run), never another run's. Deletion first renames a directory out of
the ``iter_`` name space, so a crash during a deletion never leaves a directory that looks like a checkpoint.

Collective functions take ``dims`` (None or world 1: this process alone): every rank checks or checksums
a 1/world share of the files, and the results are gathered, so verifying a large checkpoint costs each
rank 1/world of its bytes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from moefold.training.checkpoint.atomic import write_atomic
from moefold.training.checkpoint.identity import TRACKER, checkpoint_run_id, read_run, read_tracker

if TYPE_CHECKING:
    from moefold.parallel.dims import ParallelDims

PREFIX = "iter_"
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
META = "meta.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
SHARD_SUFFIX = ".distcp"   # DCP's tensor files: the large ones
_CHUNK = 8 * 2**20


class CheckpointError(RuntimeError):
    """No intact checkpoint where one was asked for (the message says what is wrong with each)."""


class CheckpointSaveError(RuntimeError):
    """A save failed; its temporary directory was removed and the training state is untouched."""


def broadcast(dims: ParallelDims | None, obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (over ``group``, a process group of the whole world; default: the
    default group). Collective."""
    if dims is None or dims.world_size == 1 or not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather(dims: ParallelDims | None, obj: Any, group: Any = None) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group; ``group``: a process group of
    the whole world, default the default group). Collective."""
    if dims is None or dims.world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dims.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the file system that holds ``path`` or, if it does not exist yet, its
    nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def disk_full(exc: BaseException, path: str | os.PathLike) -> bool:
    """Whether ``exc`` (or what caused it) says the disk is full, or ``path``'s file system is now nearly
    full (torch's zip writer reports a full disk as ``unexpected pos ...``, without the errno)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [e.__cause__, e.__context__]
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback)}
        todo += [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple) and f]
    try:
        return free_bytes(path) < 2**20
    except OSError:
        return False


def crc32_file(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


# ------------------------------------------------------------------------------------------ the manifest
def write_manifest(ckpt: Path, dims: ParallelDims | None, group: Any = None) -> tuple[int, str | None]:
    """Checksum every file under ``ckpt`` (each rank a share) and write ``ckpt/manifest.json`` (rank 0).
    Returns (total bytes, None), or (0, this rank's error) if it failed here. Collective over ``group``."""
    rank = 0 if dims is None else dims.rank
    error = None
    files: list[str] = []
    try:
        files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    except OSError as exc:
        error = f"listing {ckpt}: {exc}"
    files = broadcast(dims, files, group)   # rank 0's listing names the shares; a rank that lacks a file reports it
    world = 1 if dims is None or not dist.is_initialized() else dims.world_size
    mine: dict[str, dict[str, Any]] = {}
    if error is None:
        try:
            for i, name in enumerate(files):
                if i % world == rank:
                    p = ckpt / name
                    mine[name] = {"size": p.stat().st_size, "crc32": crc32_file(p)}
        except OSError as exc:
            error = f"checksumming {ckpt}: {exc}"
    entries: dict[str, dict[str, Any]] = {}
    for part in gather(dims, mine, group):
        entries.update(part)
    if rank == 0 and error is None:
        try:
            write_atomic(ckpt / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": entries}, indent=1,
                                                     sort_keys=True))
        except OSError as exc:
            error = f"writing {ckpt / MANIFEST}: {exc}"
    return sum(e["size"] for e in entries.values()), error


def read_manifest(ckpt: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "crc32"}}; CheckpointError saying what is wrong otherwise."""
    path = ckpt / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"no {MANIFEST} (a save that did not finish, a deletion that did not finish, or a "
                              "checkpoint written before moefold wrote manifests)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{MANIFEST} is unreadable (truncated or corrupt: {exc})") from None
    base = os.path.realpath(ckpt)
    for name, entry in files.items():   # names from a file: each must lie inside the checkpoint
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts \
                or not os.path.realpath(ckpt / name).startswith(base + os.sep):
            raise CheckpointError(f"{MANIFEST} lists {name!r}, which is not a file inside the checkpoint (corrupt or "
                                  "crafted)")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("crc32"), str)):
            raise CheckpointError(f"{MANIFEST} is unreadable (corrupt entry for {name})")
    return files


def check_files(ckpt: Path, files: dict[str, dict[str, Any]], checksums: bool = True,
                share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with share ``(rank, world)`` of the files the manifest lists (empty: nothing)."""
    rank, world = share
    problems = []
    for i, (name, entry) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        p = ckpt / name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != entry["size"]:
            problems.append(f"{name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
        elif checksums and crc32_file(p) != entry["crc32"]:
            problems.append(f"{name} fails its crc32 check (corrupt)")
    return problems


def check_before_reading(ckpt: Path) -> list[str]:
    """What is wrong with checkpoint ``ckpt`` as far as the launcher can tell cheaply, before it parses or unpickles
    any of its files (empty: nothing): every listed file's size, and the crc32 of every file but the tensor shards
    (``.metadata``, ``meta.json``, the RNG files). One process, no collective; the ranks verify everything."""
    try:
        files = read_manifest(ckpt)
    except CheckpointError as exc:
        return [str(exc)]
    return check_files(ckpt, files, checksums=False) or \
        check_files(ckpt, {n: e for n, e in files.items() if not n.endswith(SHARD_SUFFIX)}, checksums=True)


def verify_checkpoint(ckpt: str | os.PathLike, dims: ParallelDims | None = None, checksums: bool = True) -> list[str]:
    """What is wrong with checkpoint ``ckpt`` (empty list: intact), the same list on every rank. Collective."""
    ckpt = Path(ckpt)
    rank, world = (0, 1) if dims is None or not dist.is_initialized() else (dims.rank, dims.world_size)
    try:
        problems = check_files(ckpt, read_manifest(ckpt), checksums, (rank, world))
    except CheckpointError as exc:
        problems = [str(exc)]
    merged: list[str] = []
    for part in gather(dims, problems):
        merged += [p for p in part if p not in merged]
    return merged


# ------------------------------------------------------------------------------------------ finding one
def iteration_of(path: Path) -> int | None:
    name = path.name
    return int(name[len(PREFIX):]) if name.startswith(PREFIX) and name[len(PREFIX):].isdigit() else None


def checkpoint_dirs(root: str | os.PathLike) -> list[Path]:
    """The ``iter_N`` directories under ``root`` (intact or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.is_dir() and iteration_of(d) is not None]
    return sorted(found, key=iteration_of)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (rather than a directory of them)."""
    return iteration_of(path) is not None or any((path / f).exists() for f in (MANIFEST, META, ".metadata"))


def complete_checkpoints(root: str | os.PathLike, log: Callable[[str], None] | None = None) -> list[Path]:
    """Checkpoints under ``root`` whose manifest lists files of the right sizes (no checksums), oldest first;
    the others are reported through ``log``."""
    out = []
    for d in checkpoint_dirs(root):
        problems = verify_checkpoint(d, None, checksums=False)
        if not problems:
            out.append(d)
        elif log:
            log(f"ignoring damaged checkpoint {d}: {'; '.join(problems[:3])}")
    return out


def resume_candidates(path: Path, log: Callable[[str], None] = print) -> list[Path]:
    """The checkpoints under save directory ``path`` a resume may take, newest first: those of the run that owns
    ``path`` (``SAVE/run.json``), no newer than the tracker's iteration (``training.checkpoint.identity``). The
    others are reported through ``log``: another run's, or newer than the tracker (a save whose tracker update
    a crash cut off, or an abandoned branch the run was resumed before). Without ``run.json`` and tracker (a
    directory written before run ids): all of them.

    A tracker naming a checkpoint that is not there is said through ``log`` (the resume falls back to older ones);
    when every checkpoint of the run is newer than it, ``CheckpointError``: the run would otherwise start from
    scratch beside them (and keep-last delete them)."""
    owner, tracked = read_run(path), read_tracker(path)
    if tracked is None and (path / TRACKER).is_file():
        log(f"{path / TRACKER} does not hold an iteration: taking the newest intact checkpoint of the run")
    out, newer = [], []
    for d in reversed(checkpoint_dirs(path)):
        rid = checkpoint_run_id(d)
        if owner is not None and rid is not None and rid != owner.run_id:
            log(f"ignoring {d}: it belongs to run {rid}, not to {path}'s run {owner.run_id}")
            continue
        if tracked is not None and iteration_of(d) > tracked:
            log(f"ignoring {d}: newer than the iteration {tracked} that {path / TRACKER} names")
            newer.append(d)
            continue
        out.append(d)
    if tracked is not None and not any(iteration_of(d) == tracked for d in out):
        missing = path / f"{PREFIX}{tracked:07d}"
        if not out and newer:
            names = ", ".join(d.name for d in newer[:3]) + (f" (+{len(newer) - 3} more)" if len(newer) > 3 else "")
            raise CheckpointError(f"{path / TRACKER} names iteration {tracked}, but {missing} is missing and the run's "
                                  f"checkpoints ({names}) are all newer; refusing to start from scratch beside them: "
                                  f"resume one with --load {newer[0]} (the newer ones are kept aside), or move them "
                                  "away to start a new run")
        if out:
            log(f"{path / TRACKER} names iteration {tracked}, but {missing} is missing: falling back to the run's "
                "older checkpoints")
    return out


def find_checkpoint(path: str | os.PathLike, dims: ParallelDims | None = None,
                    log: Callable[[str], None] = print, resume: bool = True) -> Path | None:
    """The checkpoint to resume from: ``path`` itself when it is one (CheckpointError if it is damaged), else
    the newest intact one of ``resume_candidates``; each damaged newer one is reported through ``log``. None when
    ``path`` holds no checkpoint of its run at all; CheckpointError when it holds only damaged ones (a run
    never silently starts from scratch; ``resume=False``: the caller only reads the model, and the message says
    nothing about starting a run). Collective (every rank verifies a share of the files)."""
    path = Path(path)
    # rank 0's view of the directory, so that every rank verifies the same candidates (one collective each)
    rank0 = dims is None or dims.rank == 0
    explicit, names, error = is_checkpoint_dir(path), [], None
    if rank0 and not explicit:
        try:
            names = [d.name for d in resume_candidates(path, log)]
        except (CheckpointError, ValueError) as exc:   # raised on every rank, below, not on rank 0 alone
            error = str(exc)
    explicit, names, error = broadcast(dims, (explicit, names, error))
    if error is not None:
        raise CheckpointError(error)
    if explicit:
        problems = verify_checkpoint(path, dims)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems[:3])}; pass its parent "
                                  "directory to take the newest intact checkpoint instead")
        return path
    if path.is_dir():
        for d in sorted(path.iterdir()):
            if d.name.startswith(TMP_PREFIX):
                log(f"ignoring half-written checkpoint {d} (a save that did not finish)")
    damaged = []
    for ckpt in (path / name for name in names):
        problems = verify_checkpoint(ckpt, dims)
        if not problems:
            if damaged:
                log(f"falling back to {ckpt}, the newest intact checkpoint")
            return ckpt
        log(f"checkpoint {ckpt} is damaged: {'; '.join(problems[:3])}")
        damaged.append(ckpt.name)
    if damaged:
        raise CheckpointError(f"no intact checkpoint under {path} (damaged: {', '.join(damaged)})" + (
            "; refusing to start from scratch: move them away to start a new run" if resume else ""))
    return None


# ------------------------------------------------------------------------------------------ deleting
def retire(path: Path) -> None:
    """Delete checkpoint directory ``path``: first renamed out of the ``iter_`` name space, so that a crash
    during the deletion leaves nothing that could be taken for a checkpoint."""
    doomed = path.with_name(DEL_PREFIX + path.name)
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Remove what crashed saves and deletions left (``.tmp-*``, ``.del-*``) under ``root``."""
    for d in root.iterdir():
        if d.name.startswith((TMP_PREFIX, DEL_PREFIX)):
            shutil.rmtree(d, ignore_errors=True)


def prune(root: Path, iteration: int, keep_last: int, run_id: str | None = None) -> list[Path]:
    """Keep the checkpoint of ``iteration`` and the newest ``keep_last - 1`` older ones whose files are all
    there; retire the other older ones (damaged ones first of all). Only run ``run_id``'s checkpoints are
    candidates (another run's, left in the directory, are never deleted; ``None``: every checkpoint, as before
    run ids). Newer directories (from a run this one resumed before) are left alone: this run overwrites them
    when it reaches them. Returns the retired."""
    doomed = doomed_by_keep_last(root, iteration, keep_last, run_id)
    for d in doomed:
        retire(d)
    return doomed


def doomed_by_keep_last(root: Path, iteration: int, keep_last: int, run_id: str | None = None) -> list[Path]:
    """What ``prune(root, iteration, ...)`` retires (checked now: a save calls it before writing ``iteration``
    when the disk lacks room, to free the space keep-last would free after it)."""
    older = [d for d in checkpoint_dirs(root) if iteration_of(d) < iteration
             and (run_id is None or checkpoint_run_id(d) == run_id)]
    keep = [d for d in reversed(older) if not verify_checkpoint(d, None, checksums=False)][:keep_last - 1]
    return [d for d in older if d not in keep]
