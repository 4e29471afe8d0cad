"""Reading slices of, and writing, ``torch.distributed.checkpoint`` directories (Megatron's ``torch_dist``).

Loading never executes code from the files: ``.metadata`` (a pickle) is read by the unpickler moefold's own
checkpoints are read with (``models.dcp_metadata``: only the classes DCP's metadata consists of, here with
``BytesStorageMetadata`` and the save plan Megatron-Core keeps there; no storage transforms), which fails
naming any other; tensor data is read by DCP's ``FileSystemReader`` (``torch.load(weights_only=True)`` per
chunk); byte items (Megatron's ``ShardedObject``: Transformer Engine extra state, RNG states, optimizer objects)
are never unpickled.

``DcpReader.read_boxes([(key, box), ...])`` reads only the requested regions of the requested tensors in one pass
(each rank of a parallel layout reads its slices). ``write_dcp(tensors, dir)`` writes full tensors as one
chunk each from one process (``no_dist``); DCP loads them at any sharding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from moefold.models.dcp_metadata import SafeFileSystemReader, read_dcp_metadata

METADATA = ".metadata"

Box = tuple[slice, ...]


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The ``.metadata`` of a DCP directory, through the restricted unpickler (``models.dcp_metadata``;
    Megatron's byte entries and save plan admitted as metadata, the entries never read). ``ValueError`` naming
    the file otherwise."""
    file = Path(path) / METADATA
    if not file.is_file():
        raise ValueError(f"{path}: no {METADATA} (not a torch.distributed.checkpoint / torch_dist directory)")
    return read_dcp_metadata(file, megatron=True)


class _BoxPlanner(LoadPlanner):
    """Reads the requested boxes of the requested tensors into fresh tensors; nothing else."""

    def __init__(self, requests: Mapping[str, list[tuple[Box, Tensor]]]) -> None:
        self.requests = requests

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, boxes in self.requests.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size([s.start for s in box]),
                                           sizes=torch.Size([s.stop - s.start for s in box])) for box, _ in boxes]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"refusing to unpickle the byte item {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        dest = self.requests[read_item.dest_index.fqn][read_item.dest_index.index][1]
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, off, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass


class DcpReader:
    """The tensors of a DCP directory: ``keys()``, ``shape(key)``, ``dtype(key)``, ``read_boxes``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = Path(path)
        self.metadata = read_metadata(path)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.objects = sorted(k for k in self.metadata.state_dict_metadata if k not in self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read_boxes(self, requests: list[tuple[str, Box]]) -> list[Tensor]:
        """The ``box`` region of tensor ``key`` for each ``(key, box)``, in one pass over the files (a box may
        cover the whole tensor: ``full_box(shape)``). Only the stored chunks that overlap a box are read."""
        grouped: dict[str, list[tuple[Box, Tensor]]] = {}
        out = []
        for key, box in requests:
            if key not in self.tensors:
                raise KeyError(key)
            t = torch.empty([s.stop - s.start for s in box], dtype=self.dtype(key))
            grouped.setdefault(key, []).append((box, t))
            out.append(t)
        if grouped:
            import torch.distributed.checkpoint as dcp

            dcp.load({}, storage_reader=SafeFileSystemReader(self.root, megatron=True),
                     planner=_BoxPlanner(grouped), no_dist=True)
        return out


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple(slice(0, n) for n in shape)


def write_dcp(values: Mapping[str, object], out_dir: str | os.PathLike) -> None:
    """Write ``values`` (full CPU tensors; any other value becomes one byte item, ``torch.save``d, under its own
    key) as a DCP directory from this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {k: v.detach().to("cpu").contiguous() if isinstance(v, Tensor) else v for k, v in values.items()}
    dcp.save(state, storage_writer=FileSystemWriter(str(out_dir), single_file_per_rank=True),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)

