"""Writing a checkpoint: synchronously (``save_checkpoint``), or in the background while training goes on
(``AsyncCheckpointer``, ``--async-save``). Both write the same directory the same way::

    prepare      rank 0: remove leftovers of crashed saves; check the free space against the checkpoint's
                 size and, when it is short, first retire what keep-last would retire after this save, but
                 never the newest complete checkpoint (at --keep-last 1 it goes only after this one is complete)
    write        every rank: its RNG state, rank 0 meta.json; DCP writes the tensors into SAVE/.tmp-iter_N
    manifest     every file's size and crc32 (each rank checksums a share), written last
    publish      rank 0: rename .tmp-iter_N to iter_N, then the tracker (latest_checkpointed_iteration.txt)
    keep-last    rank 0: retire this run's older checkpoints beyond keep_last

Each phase runs on every rank and the ranks agree on its outcome (one gather of the errors) before the next,
so a failure anywhere removes the temporary directory and raises ``CheckpointSaveError`` on every rank, in
words (a full disk by name), with the model and optimizer untouched. A crash at any point leaves the
previous checkpoint and the tracker naming it: nothing is renamed into the ``iter_`` name space before
its manifest exists.

Asynchronously, ``torch.distributed.checkpoint.async_save`` first copies ("stages", ``HostStager``) this rank's
state into host memory (pinned on CUDA; the buffers are kept and reused by the next save), which is all the
training waits for; a background thread then writes the files, and the same thread, on a gloo process group
of its own (so its collectives never interleave with the training's), writes the manifest, renames,
updates the tracker and prunes when the write completes. One save is in flight at a time: the next save,
the final save and a stop (signal, ``--exit-*``) wait for it first (``wait()``), and a failure of it is
raised there.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from moefold.parallel.dims import ParallelDims
from moefold.training.checkpoint.atomic import fsync_dir, write_atomic
from moefold.training.checkpoint.files import (
    META,
    PREFIX,
    TMP_PREFIX,
    CheckpointSaveError,
    disk_full,
    doomed_by_keep_last,
    fmt_bytes,
    free_bytes,
    gather,
    prune,
    remove_leftovers,
    retire,
    write_manifest,
)
from moefold.training.checkpoint.identity import set_aside, write_tracker
from moefold.training.checkpoint.sharded import build_state, no_dist, saved_checkpoint_bytes
from moefold.training.errors import one_line
from moefold.training.optim.state_shards import ShardPieces, ShardSavePlanner


class _NoRoom(OSError):
    """The free space, checked before writing, is less than the checkpoint needs."""


def _save_rng(path: Path) -> None:
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, path)


class _Save:
    """One save's phases (module docstring). ``group``: the process group its agreements use (None: the
    default group; the async saver's background thread has its own)."""

    def __init__(self, root: Path, iteration: int, dims: ParallelDims, need: int, meta: dict[str, Any],
                 keep_last: int, group: Any = None) -> None:
        self.root, self.iteration, self.dims, self.need, self.group = root, iteration, dims, need, group
        self.final = root / f"{PREFIX}{iteration:07d}"
        self.tmp = root / f"{TMP_PREFIX}{self.final.name}"
        self.meta, self.keep_last, self.run_id = meta, keep_last, meta.get("run_id")
        self.rank0 = dims.rank == 0
        self.pruned: list[str] = []
        self.set_aside: Path | None = None   # another run's checkpoint of this iteration, moved (publish)

    def phase(self, fn: Callable[[], Any] | None) -> None:
        error = None
        if fn is not None:
            try:
                fn()
            except (Exception, CheckpointException) as exc:  # any failure of a save: reported, cleaned up, agreed on
                error = self.describe(exc)
        self.agree(error)

    def agree(self, error: str | None) -> None:
        errors = [e for e in gather(self.dims, error, self.group) if e]
        if not errors:
            return
        if self.rank0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        raise CheckpointSaveError(f"saving checkpoint {self.final.name} failed: {errors[0]}; no partial checkpoint "
                                  f"is left in {self.root}")

    def describe(self, exc: BaseException) -> str:
        first = one_line(exc)
        if isinstance(exc, _NoRoom):
            return first
        if disk_full(exc, self.root):
            return (f"the disk is full ({first}; {fmt_bytes(free_bytes(self.root))} free on {self.root}, the "
                    f"checkpoint needs about {fmt_bytes(self.need)})")
        return first

    # ------------------------------------------------------------------------------------------ phases
    def prepare(self) -> None:
        """Rank 0: leftovers out, room checked (making it from keep-last's doomed checkpoints first if short)."""
        self.root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.root)
        free = free_bytes(self.root)
        if free < self.need:
            # never the newest complete checkpoint: until this one is complete it is all a crash could resume from
            doomed = doomed_by_keep_last(self.root, self.iteration, max(self.keep_last, 2), self.run_id)
            for d in doomed:
                retire(d)
            self.pruned = [d.name for d in doomed]
            free = free_bytes(self.root)
        if free < self.need:
            made = f" (after removing {', '.join(self.pruned)}, which keep-last would remove)" if self.pruned else ""
            raise _NoRoom(f"not enough free space: {fmt_bytes(free)} free on {self.root}{made}, the checkpoint "
                          f"needs about {fmt_bytes(self.need)}")
        (self.tmp / "rng").mkdir(parents=True)

    def write_small(self) -> None:
        """Every rank its RNG state; rank 0 meta.json."""
        _save_rng(self.tmp / "rng" / f"rank{self.dims.rank:05d}.pt")
        if self.rank0:
            write_atomic(self.tmp / META, json.dumps(dict(self.meta, iteration=self.iteration,
                                                          world_size=self.dims.world_size,
                                                          layout=self.dims.describe()), indent=1, sort_keys=True))

    def publish(self) -> None:
        if self.final.exists():   # out of the name space first: another run's is kept, this run's own replaced
            self.set_aside = set_aside(self.final, self.run_id)
            if self.set_aside is None:
                retire(self.final)
        os.replace(self.tmp, self.final)
        fsync_dir(self.root)
        write_tracker(self.root, self.iteration)

    def finish(self, log: Callable[[str], None]) -> Path:
        """Manifest, rename, tracker, keep-last: the phases after the tensors are written. Collective."""
        size, error = write_manifest(self.tmp, self.dims, self.group)
        self.agree(error)
        self.phase(self.publish if self.rank0 else None)
        if self.rank0:
            try:
                retired = self.pruned + [d.name for d in prune(self.root, self.iteration, self.keep_last,
                                                               self.run_id)]
            except OSError as exc:   # the new checkpoint is in place; an old one that stays is no reason to stop
                retired = [f"(keep-last failed: {exc})"]
            log(f"saved checkpoint {self.final} ({fmt_bytes(size)})"
                + (f"; removed {', '.join(retired)}" if retired else "")
                + (f"; another run's {self.final.name} moved to {self.set_aside}" if self.set_aside else ""))
        return self.final


def save_checkpoint(root: str | os.PathLike, iteration: int, model: nn.Module, dims: ParallelDims,
                    optim_state: dict[str, ShardPieces] | None, meta: dict[str, Any],
                    keep_last: int = 2, log: Callable[[str], None] = print) -> Path:
    """Write ``root/iter_<iteration>`` atomically (module docstring) and wait for it. Collective. A failure
    (a full disk, an unwritable directory) removes the temporary directory and raises ``CheckpointSaveError``
    on every rank, leaving the model and optimizer untouched."""
    state = build_state(model, dims, optim_state)
    save = _Save(Path(root), iteration, dims, saved_checkpoint_bytes(state, dims), meta, keep_last)
    save.phase(save.prepare if save.rank0 else None)

    def write() -> None:
        with warnings.catch_warnings():   # world 1 without a process group is intended, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(save.tmp), planner=ShardSavePlanner(), no_dist=no_dist(dims))
        save.write_small()

    save.phase(write)
    return save.finish(log)


class HostStager(AsyncStager):
    """``async_save``'s stager for moefold's state: every tensor, DTensor shard and optimizer box copied into a
    host buffer of its own (pinned with CUDA), allocated by the first save and reused by the next ones, so the
    write reads a copy that later steps cannot change. (DCP's ``DefaultStager`` deep-copies through tensor
    storages, which the DTensor wrappers of sharded parameters do not have: "invalid python storage".)"""

    _synchronize_after_execute = False   # the copies are done when stage() returns

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory, self.buffers = pin_memory, {}

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        buf.copy_(t.detach())
        return buf

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        out: dict[str, Any] = {}
        for k, v in state_dict.items():
            if isinstance(v, ShardPieces):
                out[k] = ShardPieces(v.global_size, [(o, n, self._copy((k, i), t)) for i, (o, n, t) in
                                                     enumerate(v.boxes)])
            elif isinstance(v, DTensor):
                out[k] = DTensor.from_local(self._copy((k,), v.to_local()), v.device_mesh, v.placements,
                                            run_check=False, shape=v.shape, stride=v.stride())
            elif isinstance(v, torch.Tensor):
                out[k] = self._copy((k,), v)
            else:
                out[k] = v
        return out

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.buffers = {}


class AsyncCheckpointer:
    """``--async-save``: one background save in flight at a time (module docstring). Collective: every rank
    creates it at the same point (it builds a process group) and calls ``save`` / ``wait`` in the same order."""

    def __init__(self, dims: ParallelDims, log: Callable[[str], None] = print) -> None:
        self.dims, self.log = dims, log
        if no_dist(dims):   # world 1 without a group is intended; DCP warns about it from the writing thread
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # async_save needs a CPU backend; a group of its own keeps the background collectives apart
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.stager = HostStager(pin_memory=torch.cuda.is_available())
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Path | None, BaseException | None] = (None, None)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def save(self, root: str | os.PathLike, iteration: int, model: nn.Module,
             optim_state: dict[str, ShardPieces] | None, meta: dict[str, Any], keep_last: int = 2) -> None:
        """Stage this rank's state and start writing ``root/iter_<iteration>``; returns once the state is in host
        memory. A failure of the previous background save is logged (training went on past it, as after a failed
        synchronous interval save); one of this save's preparation raises ``CheckpointSaveError``."""
        try:
            self.wait()
        except CheckpointSaveError as exc:
            self.log(f"{exc}; training continues, the next save tries again")
        dims = self.dims
        state = build_state(model, dims, optim_state)
        save = _Save(Path(root), iteration, dims, saved_checkpoint_bytes(state, dims), meta, keep_last)
        save.phase(save.prepare if save.rank0 else None)
        future: list[Any] = []

        def stage() -> None:
            save.write_small()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                future.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(save.tmp)),
                                             planner=ShardSavePlanner(), process_group=self.group,
                                             async_stager=self.stager, no_dist=no_dist(dims)))

        save.phase(stage)
        save.group = self.group   # from here on the background thread agrees with the other ranks' threads
        self._thread = threading.Thread(target=self._finish, args=(save, future[0]), daemon=True,
                                        name=f"moefold-save-{iteration}")
        self._thread.start()

    def _finish(self, save: _Save, future: Any) -> None:
        try:
            error = None
            try:
                future.result()
            except (Exception, CheckpointException) as exc:
                error = save.describe(exc)
            save.agree(error)
            self._outcome = (save.finish(self.log), None)
        except BaseException as exc:   # handed to the main thread by wait()
            self._outcome = (None, exc)

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any); its checkpoint, or raise its failure."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        path, exc = self._outcome
        self._outcome = (None, None)
        if exc is not None:
            raise exc
        return path

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffers."""
        try:
            self.wait()
        finally:
            self.stager.close()
