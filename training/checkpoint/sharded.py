"""Reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP): save at one layout, load at another.

Layout of a save directory (``training.checkpoint.files``: manifest, fallback, keep-last)::

    SAVE/iter_0000100/            a complete checkpoint (renamed into place after everything is written)
        .metadata, __*.distcp     DCP: model, optimizer (per parameter), expert biases
        meta.json                 iteration, consumed_samples, optimizer step, layout, the RunConfig
        rng/rank00000.pt          this rank's torch RNG state (restored only at the same layout)
        manifest.json             every other file's size and crc32, written last: loads verify it
    SAVE/.tmp-iter_0000200/       being written (or left by a crash): ignored on load

Every sharded tensor is described as a ``DTensor`` over this pipeline stage's sub-mesh of
``dims.dense_mesh`` (dp, cp, tp) or ``dims.expert_mesh`` (edp, ep, etp), built from the parameter's
``moefold_shards``; unsharded tensors are plain (replicated: DCP keeps one copy). Optimizer state is
saved by each rank for the part it owns only, as boxes of each parameter's full tensor
(``training.optim.state_shards.ShardPieces``, ``DistributedAdamW.checkpoint_state``), so DCP can
reshard all of it and no rank gathers a state it does not own.
Keys: ``model.<param or buffer name>``, ``optim.<param name>.{exp_avg,exp_avg_sq}`` and, for
parameters with a separate fp32 master copy (bf16 models), ``optim.<param name>.master``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_ranks
from moefold.parallel.sharding import full_shape, shards_of
from moefold.training.checkpoint.files import (
    META,
    PREFIX,
    TMP_PREFIX,
    CheckpointError,
    CheckpointSaveError,
    complete_checkpoints,
    disk_full,
    find_checkpoint,
    fmt_bytes,
    free_bytes,
    fsync_dir,
    gather,
    prune,
    remove_leftovers,
    retire,
    write_atomic,
    write_manifest,
)
from moefold.training.errors import one_line
from moefold.training.optim.state_shards import ShardLoadPlanner, ShardPieces, ShardSavePlanner

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "complete_checkpoints", "read_meta",
           "check_compatible", "build_state", "CheckpointError", "CheckpointSaveError", "PREFIX", "TMP_PREFIX", "META"]


def _barrier(dims: ParallelDims) -> None:
    if dims.world_size > 1:
        dist.barrier()


def _no_dist(dims: ParallelDims) -> bool:
    return dims.world_size == 1 and not dist.is_initialized()


class _Placer:
    """Wraps a tensor shaped like ``param`` as a DTensor over the stage sub-mesh its shards live on."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims
        self.meshes = []
        if dims.dense_mesh is not None:
            for mesh, names in ((dims.dense_mesh, ("dp", "cp", "tp")), (dims.expert_mesh, ("edp", "ep", "etp"))):
                sub = mesh[names]
                ranks = {tuple(group_ranks(sub[n].get_group())): i for i, n in enumerate(names)}
                self.meshes.append((sub, ranks))

    def __call__(self, t: Tensor, param: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shards = shards_of(param)
        if not shards or isinstance(t, DTensor):   # an FSDP2 shard: the optimizer's pieces describe it instead
            return t

        for sub, ranks in self.meshes:
            where = [ranks.get(tuple(group_ranks(s.group))) for s in shards]
            if all(w is not None for w in where):
                placements = [Replicate()] * sub.ndim
                for s, w in zip(shards, where):
                    placements[w] = Shard(s.dim)
                shape = torch.Size(full_shape(param))
                return DTensor.from_local(t, sub, placements, run_check=False, shape=shape,
                                          stride=torch.empty(shape, device="meta").stride())
        raise ValueError(f"a parameter of shape {tuple(param.shape)} is sharded over groups that are not dimensions "
                         f"of the dense (dp, cp, tp) or expert (edp, ep, etp) mesh: {shards}")


def build_state(model: nn.Module, dims: ParallelDims, optim_state: dict[str, ShardPieces] | None,
                ) -> dict[str, Tensor | ShardPieces]:
    """The DCP state dict: the model's own tensors (wrapped, not copied: a ``dcp.load`` writes into the
    model in place, a ``dcp.save`` copies one tensor at a time) and ``optim_state``'s pieces (views)."""
    place = _Placer(dims)
    params = dict(model.named_parameters())
    state: dict[str, Tensor | ShardPieces] = {f"model.{name}": place(t.detach(), params.get(name, t))
                                              for name, t in model.state_dict().items()}
    state.update(optim_state or {})
    return state


def _state_bytes(state: dict[str, Any], dims: ParallelDims) -> int:
    """About how many bytes ``state`` takes in a checkpoint: every tensor at its full size, once per pipeline
    stage (the ranks of one stage hold the same keys). Collective."""
    from torch.distributed.tensor import DTensor

    def full_bytes(v: Any) -> int:
        if isinstance(v, ShardPieces):   # a piece of an optimizer state: the full tensor's size, once
            return math.prod(v.global_size) * (v.boxes[0][2].element_size() if v.boxes else 4)
        return v.numel() * v.element_size() if isinstance(v, (Tensor, DTensor)) else 0

    stage = sum(full_bytes(v) for v in state.values())
    return int(sum(gather(dims, stage)) * dims.pp // dims.world_size)


def _save_rng(path: Path) -> None:
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, path)


class _NoRoom(OSError):
    """The free space, checked before writing, is less than the checkpoint needs."""


class _Save:
    """One save's phases. Each phase runs on every rank, and the ranks agree on its outcome (one gather of
    the errors) before the next starts; a failure anywhere removes the temporary directory and raises
    ``CheckpointSaveError`` on every rank, saying in words what went wrong (a full disk by name)."""

    def __init__(self, root: Path, final: Path, dims: ParallelDims, need: int) -> None:
        self.root, self.final, self.dims, self.need = root, final, dims, need
        self.tmp = root / f"{TMP_PREFIX}{final.name}"

    def phase(self, fn: Callable[[], Any] | None) -> None:
        error = None
        if fn is not None:
            try:
                fn()
            except (Exception, CheckpointException) as exc:  # any failure of a save: reported, cleaned up, agreed on
                error = self.describe(exc)
        self.agree(error)

    def agree(self, error: str | None) -> None:
        errors = [e for e in gather(self.dims, error) if e]
        if not errors:
            return
        if self.dims.rank == 0:
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

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.root)
        free = free_bytes(self.root)
        if free < self.need:
            raise _NoRoom(f"not enough free space: {fmt_bytes(free)} free on {self.root}, the checkpoint needs "
                          f"about {fmt_bytes(self.need)}")
        (self.tmp / "rng").mkdir(parents=True)


def save_checkpoint(root: str | os.PathLike, iteration: int, model: nn.Module, dims: ParallelDims,
                    optim_state: dict[str, ShardPieces] | None, meta: dict[str, Any],
                    keep_last: int = 2, log: Callable[[str], None] = print) -> Path:
    """Write ``root/iter_<iteration>`` atomically: a temporary directory, its manifest last, then the rename;
    then retire all but the newest ``keep_last``. Collective. A failure (a full disk, an unwritable
    directory) removes the temporary directory and raises ``CheckpointSaveError`` on every rank, leaving
    the model and optimizer untouched."""
    root = Path(root)
    final = root / f"{PREFIX}{iteration:07d}"
    state = build_state(model, dims, optim_state)
    save = _Save(root, final, dims, _state_bytes(state, dims))
    rank0 = dims.rank == 0
    save.phase(save.prepare if rank0 else None)

    def write() -> None:
        with warnings.catch_warnings():  # world 1 without a process group is intended, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(save.tmp), planner=ShardSavePlanner(), no_dist=_no_dist(dims))
        _save_rng(save.tmp / "rng" / f"rank{dims.rank:05d}.pt")

    save.phase(write)
    save.phase((lambda: write_atomic(save.tmp / META, json.dumps(
        dict(meta, iteration=iteration, world_size=dims.world_size, layout=dims.describe()), indent=1,
        sort_keys=True))) if rank0 else None)
    size, error = write_manifest(save.tmp, dims)
    save.agree(error)

    def publish() -> None:
        if final.exists():   # an older run's checkpoint of this iteration: out of the name space first
            retire(final)
        os.replace(save.tmp, final)
        fsync_dir(root)

    save.phase(publish if rank0 else None)
    if rank0:
        try:
            retired = [d.name for d in prune(root, iteration, keep_last)]
        except OSError as exc:   # the new checkpoint is in place; an old one that stays is no reason to stop
            retired = [f"(keep-last failed: {exc})"]
        log(f"saved checkpoint {final} ({fmt_bytes(size)})" + (f"; removed {', '.join(retired)}" if retired else ""))
    return final


def read_meta(ckpt: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(ckpt) / META).read_text())


def check_compatible(ckpt: str | os.PathLike, state: dict[str, Tensor], optional_prefix: str = "optim.") -> set[str]:
    """Raise ValueError naming the first tensor whose full shape differs from the checkpoint's (or that the
    checkpoint lacks, unless its key starts with ``optional_prefix``); return the optional keys it lacks."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    missing = set()
    for key, t in state.items():
        if key not in md:
            if key.startswith(optional_prefix):
                missing.add(key)
                continue
            raise ValueError(f"checkpoint {ckpt} has no tensor {key!r} (shape {tuple(t.shape)}): it was saved "
                             "from a different model")
        saved = tuple(getattr(md[key], "size", ()))
        if saved != tuple(t.shape):
            raise ValueError(f"checkpoint {ckpt}: tensor {key!r} has shape {saved} but this model expects "
                             f"{tuple(t.shape)}: the checkpoint is of a different model")
    return missing


def load_checkpoint(ckpt: str | os.PathLike, model: nn.Module, dims: ParallelDims,
                    optim_state: dict[str, ShardPieces] | None, log: Callable[[str], None] = print,
                    ) -> dict[str, Any]:
    """Load ``ckpt`` into ``model`` and ``optim_state`` (in place) at this layout; returns its meta.
    RNG states are restored only when the world size and layout match. Collective."""
    meta = read_meta(ckpt)
    state = build_state(model, dims, optim_state)
    missing = check_compatible(ckpt, state)
    if missing:
        raise ValueError(f"checkpoint {ckpt} has no optimizer state for {sorted(missing)[:3]}...")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), planner=ShardLoadPlanner(), no_dist=_no_dist(dims))
    rng = Path(ckpt) / "rng" / f"rank{dims.rank:05d}.pt"
    if meta.get("layout") == dims.describe() and rng.is_file():
        saved = torch.load(rng, weights_only=False)
        torch.set_rng_state(saved["torch"])
        if saved.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])
    elif dims.rank == 0:
        log(f"checkpoint layout {meta.get('layout')} differs from {dims.describe()}: RNG states not restored")
    _barrier(dims)
    return meta
