"""Reading a checkpoint never runs code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` (any class, any callable), and its
default load planner unpickles "bytes" entries with an unrestricted ``torch.load``; a crafted checkpoint (a
payload in ``.metadata``, its manifest recomputed) would run under ``train --load``, ``convert`` and
``generate``. ``SafeFileSystemReader`` reads ``.metadata`` with an unpickler that admits only the classes a
moefold checkpoint's metadata is made of (DCP's tensor-metadata dataclasses, ``torch.Size``, dtypes, the
storage layout and a path: not ``BytesStorageMetadata``, moefold saves tensors only), and refuses storage
transforms (moefold writes none), so no bytes entry ever reaches that ``torch.load``. Tensor data is read by
DCP with ``torch.load(weights_only=True)``; the RNG files are read the same way.

A refused file raises ``UnsafeCheckpointError`` with one line naming the file and what it asked for. The
unpickler is ``models.dcp_metadata``'s, shared with the Megatron torch_dist reader (``models.megatron.dcp_io``).

``check_shard_records`` lets the launcher refuse a payload in a ``.distcp`` before any rank starts (the ranks'
``torch.load(weights_only=True)`` would refuse it too, but in torch's many-line message, after they started):
each tensor record (a ``torch.save`` zip at the offset ``.metadata`` gives) has its ``data.pkl`` read (not its
tensor data) by an unpickler that admits only what a saved tensor pickles (torch's tensor-rebuild function, a
storage type, a dtype, ``OrderedDict``), each replaced by an inert stand-in, so nothing of the file runs.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any, BinaryIO

import torch

from moefold.models.dcp_metadata import SafeFileSystemReader, UnsafeCheckpointError, read_dcp_metadata
from moefold.models.safe_names import inside

# what torch.save of one tensor pickles (torch/_tensor.py __reduce_ex__, torch/serialization.py persistent ids)
_RECORD_GLOBALS = frozenset({("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
                             ("torch._utils", "_rebuild_tensor"), ("collections", "OrderedDict"),
                             ("torch", "device")})


def load_tensors(path: str | os.PathLike) -> Any:
    """A small ``torch.save`` file of tensors (an RNG state): ``weights_only=True``, so a payload is refused."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        asked = re.search(r"GLOBAL ([\w.]+)", str(exc))   # torch's message names the global the file asks for
        what = f"it asks to load {asked[1]}" if asked else type(exc).__name__
        raise UnsafeCheckpointError(f"{path} holds more than tensors ({what}): refusing to load it") from None


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file of its own (one DCP record)."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, (0, self.pos, self.length)[whence] + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _inert(*_args: Any, **_kwargs: Any) -> None:
    return None


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORD_GLOBALS or (module == "torch" and (
                name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype))):
            return _inert   # a stand-in: the record is only read, never rebuilt
        raise UnsafeCheckpointError(f"{self.where} asks to load {module}.{name}, which a saved tensor never holds: "
                                    "refusing it (a crafted or foreign file; nothing of it ran)")

    def persistent_load(self, pid: Any) -> None:
        return None


def check_shard_records(ckpt: str | os.PathLike) -> None:
    """Read the pickle of every tensor record of checkpoint ``ckpt``'s shards (module docstring); its tensor data
    is not read. ``UnsafeCheckpointError`` (one line naming the file and the offset) for a record that is not a
    ``torch.save`` of tensors."""
    ckpt = Path(ckpt)
    md = read_dcp_metadata(ckpt / ".metadata")
    records: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for info in (md.storage_data or {}).values():
        records[info.relative_path].append((int(info.offset), int(info.length)))
    for rel, spans in sorted(records.items()):
        path = inside(ckpt, rel, "shard file", ckpt / ".metadata")
        with open(path, "rb") as f:
            for offset, length in sorted(spans):
                where = f"{path} (the record at byte {offset})"
                try:
                    with zipfile.ZipFile(io.BufferedReader(_Slice(f, offset, length))) as z:
                        pkl = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
                        if len(pkl) != 1:
                            raise ValueError(f"{len(pkl)} data.pkl entries")
                        data = z.read(pkl[0])
                    _RecordUnpickler(data, where).load()
                except UnsafeCheckpointError:
                    raise
                except (zipfile.BadZipFile, OSError, ValueError, EOFError, pickle.UnpicklingError, TypeError,
                        AttributeError, IndexError, KeyError) as exc:
                    raise UnsafeCheckpointError(f"{where} is not a saved tensor ({type(exc).__name__}: "
                                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


__all__ = ["SafeFileSystemReader", "UnsafeCheckpointError", "check_shard_records", "load_tensors",
           "read_dcp_metadata"]
