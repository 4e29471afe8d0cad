"""Reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP): save at one layout, load at another.

Layout of a save directory (``training.checkpoint.files``: manifest, fallback, keep-last; writing it:
``training.checkpoint.save``, synchronous or ``--async-save``)::

    SAVE/iter_0000100/            a complete checkpoint (renamed into place after everything is written)
        .metadata, __*.distcp     DCP: model, optimizer (per parameter), expert biases
        meta.json                 iteration, consumed_samples, optimizer step, layout, the RunConfig, run id
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
from moefold.training.checkpoint.files import META, find_checkpoint, gather
from moefold.training.checkpoint.safe_load import SafeFileSystemReader, load_tensors, read_dcp_metadata
from moefold.training.optim.state_shards import ShardLoadPlanner, ShardPieces

__all__ = ["load_checkpoint", "find_checkpoint", "read_meta", "check_compatible", "build_state", "saved_keys",
           "load_pieces", "saved_checkpoint_bytes", "checkpoint_bytes", "state_bytes"]


def _barrier(dims: ParallelDims) -> None:
    if dims.world_size > 1:
        dist.barrier()


def no_dist(dims: ParallelDims) -> bool:
    """World 1 without a process group: DCP runs without collectives."""
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


# torch.save framing of one DCP item (zip records, pickled header, 64-byte alignment), measured <= 1577 bytes for
# every dtype and rank of shape, and what one item adds to .metadata (its chunk, storage info, properties)
ITEM_OVERHEAD_BYTES = 1600
METADATA_ITEM_BYTES = 400
RNG_FILE_BYTES = 6700      # rng/rankNNNNN.pt: the CPU generator state (+ CUDA's, a few bytes per device)
META_FILE_BYTES = 16384    # meta.json (the RunConfig) and manifest.json, with room


def state_bytes(state: dict[str, Any]) -> tuple[int, int]:
    """(tensor bytes, DCP items) this rank contributes to a checkpoint of ``state``: each tensor, DTensor shard
    and optimizer box. Replicated tensors are counted by every rank that holds them (DCP writes one copy: see
    ``checkpoint_bytes``)."""
    from torch.distributed.tensor import DTensor

    nbytes = items = 0
    for v in state.values():
        if isinstance(v, ShardPieces):
            nbytes += sum(t.numel() * t.element_size() for _, _, t in v.boxes)
            items += len(v.boxes)
        elif isinstance(v, DTensor):
            local = v.to_local()
            nbytes, items = nbytes + local.numel() * local.element_size(), items + 1
        elif isinstance(v, Tensor):
            nbytes, items = nbytes + v.numel() * v.element_size(), items + 1
    return nbytes, items


def checkpoint_bytes(tensor_bytes: int, items: int, world_size: int) -> int:
    """The bytes a checkpoint takes on disk: ``tensor_bytes`` of data in ``items`` DCP items, plus each item's
    framing and metadata, the RNG files of ``world_size`` ranks, meta.json and the manifest."""
    return (tensor_bytes + items * (ITEM_OVERHEAD_BYTES + METADATA_ITEM_BYTES) + world_size * RNG_FILE_BYTES
            + META_FILE_BYTES)


def saved_checkpoint_bytes(state: dict[str, Any], dims: ParallelDims) -> int:
    """About the bytes a save of ``state`` at ``dims`` writes (never less): the data of every rank, replicated
    tensors once per pipeline stage (the ranks of one stage hold the same keys; DCP keeps one copy). Collective."""
    from torch.distributed.tensor import DTensor

    def full(v: Any) -> int:   # the whole tensor's bytes, once
        if isinstance(v, ShardPieces):
            return math.prod(v.global_size) * (v.boxes[0][2].element_size() if v.boxes else 4)
        return v.numel() * v.element_size() if isinstance(v, (Tensor, DTensor)) else 0

    _, items = state_bytes(state)
    data, total_items = zip(*gather(dims, (sum(full(v) for v in state.values()), items)))
    return checkpoint_bytes(int(sum(data) * dims.pp // dims.world_size), sum(total_items), dims.world_size)


def read_meta(ckpt: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(ckpt) / META).read_text())


def saved_keys(ckpt: str | os.PathLike) -> set[str]:
    """The tensor keys of a DCP checkpoint directory (reads its metadata only, through the safe reader)."""
    return set(read_dcp_metadata(Path(ckpt) / ".metadata").state_dict_metadata)


def load_pieces(ckpt: str | os.PathLike, pieces: dict[str, ShardPieces], no_dist: bool) -> None:
    """Fill ``pieces`` (keys of ``ckpt``) in place from the checkpoint. Collective unless ``no_dist``."""
    with warnings.catch_warnings():   # world 1 without a process group is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(dict(pieces), storage_reader=SafeFileSystemReader(str(ckpt)), planner=ShardLoadPlanner(),
                 no_dist=no_dist)


def check_compatible(ckpt: str | os.PathLike, state: dict[str, Tensor], optional_prefix: str = "optim.") -> set[str]:
    """Raise ValueError naming the first tensor whose full shape differs from the checkpoint's (or that the
    checkpoint lacks, unless its key starts with ``optional_prefix``); return the optional keys it lacks."""
    md = read_dcp_metadata(Path(ckpt) / ".metadata").state_dict_metadata
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
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=ShardLoadPlanner(),
                 no_dist=no_dist(dims))
    rng = Path(ckpt) / "rng" / f"rank{dims.rank:05d}.pt"
    if meta.get("layout") == dims.describe() and rng.is_file():
        saved = load_tensors(rng)
        torch.set_rng_state(saved["torch"])
        if saved.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])
    elif dims.rank == 0:
        log(f"checkpoint layout {meta.get('layout')} differs from {dims.describe()}: RNG states not restored")
    _barrier(dims)
    return meta
