"""Optimizer shards in ``torch.distributed.checkpoint``: each rank writes and reads only what it owns.

A rank's optimizer state for one parameter is a flat range of the parameter's local (TP/EP-sharded)
tensor, row-major (``training.optim.buffers``: the chunk of a bucket this rank owns). ``ShardPieces``
describes it in the coordinates of the parameter's *full* tensor: a flat range of a row-major tensor
is a union of at most ``2 * ndim - 1`` boxes (a partial row, whole rows/planes, a partial row), each a
contiguous part of the range, so each box's data is a view of the state with no copy. The planners
below hand those boxes to DCP as chunks of a tensor of the full shape; DCP's own resharding matches
them against the boxes of any other layout on load (another dp, tp, ep, pp), and its save plan keeps
one copy of boxes that several ranks hold (replicas over tp, the two pipeline copies of an embedding).
No rank materialises anything larger than the boxes it owns (DCP reads a saved box whole before
narrowing it, so a read is at most one saved box at a time).

Keys are plain strings (``optim.<param>.<state>``); everything else in the state dict (the model's
tensors and DTensors) goes through DCP's default planners unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from moefold.parallel.sharding import full_shape, shards_of


def flat_range_boxes(shape: Iterable[int], lo: int, hi: int) -> list[tuple[list[int], list[int], int]]:
    """[(offsets, sizes, flat start)] of the boxes that exactly cover elements ``[lo, hi)`` of a row-major
    tensor of ``shape``, in order; each box is a contiguous part of the range."""
    shape = list(shape)
    if lo >= hi:
        return []
    if not shape:
        return [([], [], lo)]
    inner = math.prod(shape[1:])

    def within(i: int, a: int, b: int) -> list[tuple[list[int], list[int], int]]:   # part of row i of dim 0
        return [([i, *o], [1, *s], i * inner + f) for o, s, f in flat_range_boxes(shape[1:], a, b)]

    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return within(first, lo - first * inner, hi - first * inner)
    out, a, b = [], lo, hi // inner * inner
    if lo % inner:
        out += within(first, lo % inner, inner)
        a = (first + 1) * inner
    if a < b:
        out.append(([a // inner] + [0] * (len(shape) - 1), [(b - a) // inner, *shape[1:]], a))
    if b < hi:
        out += within(b // inner, 0, hi - b)
    return out


def local_offsets(param: Tensor) -> list[int]:
    """Where this rank's local tensor of ``param`` starts inside the full tensor (``moefold_shards``)."""
    start, size = [0] * param.dim(), list(full_shape(param))
    for s in shards_of(param):
        size[s.dim] //= s.num
        start[s.dim] += s.index * size[s.dim]
    return start


@dataclass
class ShardPieces:
    """The part of one full tensor of shape ``global_size`` that this rank holds: boxes (full-tensor offsets,
    sizes) and their data (views into this rank's state)."""

    global_size: torch.Size
    boxes: list[tuple[torch.Size, torch.Size, Tensor]]

    @classmethod
    def of_flat_range(cls, param: Tensor, lo: int, hi: int, data: Tensor) -> ShardPieces:
        """``data [hi - lo]``: elements ``lo..hi`` of ``param``'s local tensor, flattened row-major."""
        base = local_offsets(param)
        boxes = []
        for offsets, sizes, start in flat_range_boxes(param.shape, lo, hi):
            view = data[start - lo:start - lo + math.prod(sizes)].view(sizes)
            boxes.append((torch.Size(b + o for b, o in zip(base, offsets)), torch.Size(sizes), view))
        return cls(torch.Size(full_shape(param)), boxes)

    @property
    def shape(self) -> torch.Size:
        return self.global_size

    def size(self) -> torch.Size:   # DCP's load plan compares this with the saved tensor's size
        return self.global_size

    def box_at(self, offsets: torch.Size) -> Tensor:
        for o, _, t in self.boxes:
            if o == offsets:
                return t
        raise KeyError(f"no box at {tuple(offsets)}")


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one SHARD write item per ``ShardPieces`` box."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.pieces = {k: v for k, v in state_dict.items() if isinstance(v, ShardPieces)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in self.pieces}, storage_meta,
                               is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                       properties=TensorProperties.create_from_tensor(t),
                                                       size=pieces.global_size))
                 for fqn, pieces in self.pieces.items() for offsets, sizes, t in pieces.boxes]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        pieces = self.pieces.get(write_item.index.fqn)
        if pieces is None:
            return super().resolve_data(write_item)
        return pieces.box_at(write_item.index.offset)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus read items that fill each ``ShardPieces`` box from the saved chunks."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.pieces = {k: v for k, v in state_dict.items() if isinstance(v, ShardPieces)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in self.pieces}, metadata,
                               is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for fqn, pieces in self.pieces.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise ValueError(f"the checkpoint has no tensor {fqn!r}")
            if tuple(md.size) != tuple(pieces.global_size):
                raise ValueError(f"checkpoint tensor {fqn!r} has shape {tuple(md.size)} but this model expects "
                                 f"{tuple(pieces.global_size)}")
            chunks = [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in pieces.boxes]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        pieces = self.pieces.get(read_item.dest_index.fqn)
        if pieces is None:
            return super().resolve_tensor(read_item)
        t = pieces.boxes[read_item.dest_index.index][2]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, offset, length)
        return t
