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
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch

from moefold.models.dcp_metadata import SafeFileSystemReader, UnsafeCheckpointError, read_dcp_metadata


def load_tensors(path: str | os.PathLike) -> Any:
    """A small ``torch.save`` file of tensors (an RNG state): ``weights_only=True``, so a payload is refused."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        asked = re.search(r"GLOBAL ([\w.]+)", str(exc))   # torch's message names the global the file asks for
        what = f"it asks to load {asked[1]}" if asked else type(exc).__name__
        raise UnsafeCheckpointError(f"{path} holds more than tensors ({what}): refusing to load it") from None


__all__ = ["SafeFileSystemReader", "UnsafeCheckpointError", "load_tensors", "read_dcp_metadata"]
