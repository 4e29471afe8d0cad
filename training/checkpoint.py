"""Reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP): save at one layout, load at another.

Layout of a save directory::

    SAVE/iter_0000100/            a complete checkpoint (renamed into place after everything is written)
        .metadata, __*.distcp     DCP: model, optimizer (per parameter), expert biases
        meta.json                 iteration, consumed_samples, optimizer step, layout, the RunConfig
        rng/rank00000.pt          this rank's torch RNG state (restored only at the same layout)
    SAVE/.tmp-iter_0000200/       being written (or left by a crash): ignored on load

Every sharded tensor is described as a ``DTensor`` over this pipeline stage's sub-mesh of
``dims.dense_mesh`` (dp, cp, tp) or ``dims.expert_mesh`` (edp, ep, etp), built from the parameter's
``moefold_shards``; unsharded tensors are plain (replicated: DCP keeps one copy). Optimizer state is
saved by each rank for the part it owns only, as boxes of each parameter's full tensor
(``training.shard_checkpoint.ShardPieces``, ``DistributedAdamW.checkpoint_state``), so DCP can
reshard all of it and no rank gathers a state it does not own.
Keys: ``model.<param or buffer name>``, ``optim.<param name>.{exp_avg,exp_avg_sq}`` and, for
parameters with a separate fp32 master copy (bf16 models), ``optim.<param name>.master``.
"""

from __future__ import annotations

import json
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

from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_ranks
from moefold.parallel.sharding import full_shape, shards_of
from moefold.training.shard_checkpoint import ShardLoadPlanner, ShardPieces, ShardSavePlanner

PREFIX = "iter_"
TMP_PREFIX = ".tmp-"
META = "meta.json"


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
        shards = shards_of(param)
        if not shards:
            return t
        from torch.distributed.tensor import DTensor, Replicate, Shard

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


def save_checkpoint(root: str | os.PathLike, iteration: int, model: nn.Module, dims: ParallelDims,
                    optim_state: dict[str, ShardPieces] | None, meta: dict[str, Any],
                    keep_last: int = 2, log: Callable[[str], None] = print) -> Path:
    """Write ``root/iter_<iteration>`` atomically (temporary directory, then rename). Collective."""
    root = Path(root)
    final = root / f"{PREFIX}{iteration:07d}"
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if dims.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier(dims)
    state = build_state(model, dims, optim_state)
    with warnings.catch_warnings():  # world 1 without a process group is intended, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp), planner=ShardSavePlanner(), no_dist=_no_dist(dims))
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / "rng" / f"rank{dims.rank:05d}.pt")
    _barrier(dims)
    if dims.rank == 0:
        (tmp / META).write_text(json.dumps(dict(meta, iteration=iteration, world_size=dims.world_size,
                                                layout=dims.describe()), indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log(f"saved checkpoint {final}")
    _barrier(dims)
    return final


def complete_checkpoints(root: str | os.PathLike, log: Callable[[str], None] | None = None) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first; incomplete ones are reported via ``log``."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if d.name.startswith(TMP_PREFIX):
            if log:
                log(f"ignoring half-written checkpoint {d} (a save that did not finish)")
        elif d.name.startswith(PREFIX) and d.is_dir():
            if (d / META).is_file() and (d / ".metadata").is_file():
                out.append(d)
            elif log:
                log(f"ignoring incomplete checkpoint {d} (no {META} or .metadata)")
    return sorted(out, key=lambda d: int(d.name[len(PREFIX):]))


def find_checkpoint(path: str | os.PathLike, log: Callable[[str], None] = print) -> Path | None:
    """``path`` itself when it is a complete checkpoint, else the latest complete one under it (None if none)."""
    path = Path(path)
    if (path / META).is_file() and (path / ".metadata").is_file():
        return path
    found = complete_checkpoints(path, log)
    return found[-1] if found else None


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
