"""Reading a ``torch.distributed.checkpoint`` directory's ``.metadata`` without running code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` (any class, any callable). Here an
unpickler admits only the classes DCP's metadata is made of (its tensor-metadata dataclasses, ``torch.Size``,
dtypes, the storage layout and a path) and refuses storage transforms, so a crafted ``.metadata`` (a payload,
its manifest recomputed) is refused in one line before anything of it runs. ``BytesStorageMetadata`` (a
pickled object inside the checkpoint) and DCP's save-plan classes are admitted only with ``megatron=True``:
Megatron's torch_dist checkpoints hold such entries (``ShardedObject``: RNG states, Transformer Engine's extra
state), which ``models.megatron.dcp_io`` never reads, and the save plan Megatron-Core's planner keeps in the
metadata; moefold's own checkpoints hold tensors only (``training.checkpoint.safe_load``).

Each tensor's shard file (``_StorageInfo.relative_path``, which DCP's reader joins to the checkpoint folder and
opens) must be a plain name inside the folder (``models.safe_names``): a crafted ``../x.distcp`` is refused before
anything is opened.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moefold.models.safe_names import UnsafeNameError, inside

_METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                 "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # how a torch.layout (torch.strided) pickles
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),   # StorageMeta.checkpoint_id
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
})
# what Megatron-Core's torch_dist .metadata holds besides: bytes entries, and the global save plan its planner keeps
MEGATRON_CLASSES = frozenset({("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")} | {
    ("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType",
                                                                 "TensorWriteData")})
_DTYPES = frozenset(str(getattr(torch, n)).removeprefix("torch.") for n in dir(torch)
                    if isinstance(getattr(torch, n, None), torch.dtype))


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks for something a checkpoint never needs (a payload); nothing of it ran."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str, megatron: bool) -> None:
        super().__init__(file)
        self.where, self.megatron = where, megatron

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and name in _DTYPES) \
                or (self.megatron and (module, name) in MEGATRON_CLASSES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self.where} asks to load {module}.{name}, which checkpoint metadata never "
                                    "holds: refusing it (a crafted or foreign file; nothing of it ran)")


def read_dcp_metadata(path: str | os.PathLike, megatron: bool = False) -> Metadata:
    """The ``Metadata`` of a DCP ``.metadata`` file, read with the restricted unpickler (tensor entries, and
    with ``megatron`` bytes entries and the save plan; no storage transforms). ``UnsafeCheckpointError`` (one
    line) otherwise."""
    path = Path(path)
    where = str(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(io.BufferedReader(f), where, megatron).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise UnsafeCheckpointError(f"{where} is not readable checkpoint metadata ({type(exc).__name__}: "
                                    f"{exc})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{where} does not hold DCP checkpoint metadata (got {type(md).__name__})")
    if not isinstance(md.storage_data or {}, dict):
        raise UnsafeCheckpointError(f"{where} does not hold DCP checkpoint metadata (storage_data is a "
                                    f"{type(md.storage_data).__name__})")
    for name in {getattr(info, "relative_path", None) for info in (md.storage_data or {}).values()}:
        try:
            inside(path.parent, name, "shard file", where)
        except UnsafeNameError as exc:
            raise UnsafeCheckpointError(str(exc)) from None
    for info in (md.storage_data or {}).values():
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{where} asks for storage transforms {info.transform_descriptors}; "
                                        "no checkpoint this reads uses them: refusing them")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by ``read_dcp_metadata`` (``megatron`` passed on)."""

    def __init__(self, path: str | os.PathLike, *args: Any, megatron: bool = False, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.megatron = megatron

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")), megatron=self.megatron)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
