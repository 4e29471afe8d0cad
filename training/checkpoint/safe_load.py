"""Reading a checkpoint never runs code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` (any class, any callable), and its
default load planner unpickles "bytes" entries with an unrestricted ``torch.load``; a crafted checkpoint (a
payload in ``.metadata``, its manifest recomputed) would run under ``train --load``, ``convert`` and
``generate``. ``SafeFileSystemReader`` reads ``.metadata`` with an unpickler that admits only the classes a
moefold checkpoint's metadata is made of (DCP's tensor-metadata dataclasses, ``torch.Size``, dtypes, the
storage layout and a path: not ``BytesStorageMetadata``, moefold saves tensors only), and refuses storage
transforms (moefold writes none), so no bytes entry ever reaches that ``torch.load``. Tensor data is read by
DCP with ``torch.load(weights_only=True)``; the RNG files are read the same way.

A refused file raises ``UnsafeCheckpointError`` with one line naming the file and what it asked for.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                 "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # how a torch.layout (torch.strided) pickles
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),   # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
})
_DTYPES = frozenset(str(getattr(torch, n)).removeprefix("torch.") for n in dir(torch)
                    if isinstance(getattr(torch, n, None), torch.dtype))


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks for something a checkpoint never needs (a payload); nothing of it ran."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self.where} asks to load {module}.{name}, which checkpoint metadata never "
                                    "holds: refusing it (a crafted or foreign file; nothing of it ran)")


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The ``Metadata`` of a DCP ``.metadata`` file, read with the restricted unpickler (tensor entries only, no
    storage transforms). ``UnsafeCheckpointError`` (one line) otherwise."""
    path = Path(path)
    where = str(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(io.BufferedReader(f), where).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise UnsafeCheckpointError(f"{where} is not readable checkpoint metadata ({type(exc).__name__}: "
                                    f"{exc})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{where} does not hold DCP checkpoint metadata (got {type(md).__name__})")
    for info in (md.storage_data or {}).values():
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{where} asks for storage transforms {info.transform_descriptors}; "
                                        "moefold writes none: refusing them")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by ``read_dcp_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def load_tensors(path: str | os.PathLike) -> Any:
    """A small ``torch.save`` file of tensors (an RNG state): ``weights_only=True``, so a payload is refused."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        asked = re.search(r"GLOBAL ([\w.]+)", str(exc))   # torch's message names the global the file asks for
        what = f"it asks to load {asked[1]}" if asked else type(exc).__name__
        raise UnsafeCheckpointError(f"{path} holds more than tensors ({what}): refusing to load it") from None
