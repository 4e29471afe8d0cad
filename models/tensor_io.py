"""Reading slices of, and writing, (sharded) safetensors checkpoint directories.

A directory holds either ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` files listed
by ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``),
the layout HF ``save_pretrained`` writes. ``TensorReader.read(name, box)`` reads only the requested
slice (``safe_open(...).get_slice``), so each rank of a parallel layout reads what it holds.

The index is a file anyone can edit: each file it names must be a plain name inside the directory
(``models.safe_names``: ``../x/model.safetensors`` is refused, never opened), and an unreadable index or
safetensors header is a ``ValueError`` of one line naming the file (safetensors' own error type is not one).
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from moefold.models.safe_names import inside

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TensorReader:
    """Lazy access to the tensors of a checkpoint directory (or one ``.safetensors`` file). Use as a
    context manager, or call ``close()``."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if path.is_file():
            files = {path.name: path}
            root = path.parent
        else:
            root = path
            files = {}
        self.root = root
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        if files:
            self.weight_map = self._names_of(path)
        elif (root / INDEX).is_file():
            self.weight_map = _read_index(root)
        elif (root / SINGLE).is_file():
            self.weight_map = self._names_of(root / SINGLE)
        else:
            raise ValueError(f"{root}: no {INDEX} and no {SINGLE} (not a safetensors checkpoint directory)")

    def _names_of(self, file: Path) -> dict[str, str]:
        return dict.fromkeys(self._open(file.name, file).keys(), file.name)

    def _open(self, fname: str, file: Path | None = None):
        if fname not in self._handles:
            file = file or inside(self.root, fname, "file", self.root / INDEX)
            if not file.is_file():
                raise ValueError(f"checkpoint file {file} (listed in {INDEX}) does not exist")
            try:
                self._handles[fname] = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except Exception as exc:   # safetensors' SafetensorError (not an OSError/ValueError) or an OSError
                raise ValueError(f"{file}: not a readable safetensors file ({_first_line(exc)})") from None
        return self._handles[fname]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape; an "F4" tensor's (two e2m1 values per byte) is its bytes' (the last dim halved), the
        shape torch gives it, which ``read`` slices."""
        sl = self._open(self.weight_map[name]).get_slice(name)
        shape = tuple(sl.get_shape())
        return (*shape[:-1], shape[-1] // 2) if str(sl.get_dtype()) == "F4" else shape

    def dtype(self, name: str) -> str:
        """The stored dtype of ``name`` as safetensors names it ("F32", "BF16", ...)."""
        return str(self._open(self.weight_map[name]).get_slice(name).get_dtype())

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> Tensor:
        """Tensor ``name``, or only ``box`` (one slice per leading dim) of it."""
        if name not in self.weight_map:
            raise KeyError(name)
        handle = self._open(self.weight_map[name])
        sl = handle.get_slice(name)
        if str(sl.get_dtype()) == "F4":   # safetensors 0.8 cannot slice packed FP4: read it whole, as int8 bytes
            t = handle.get_tensor(name).view(torch.int8)
            return t if box is None else t[box]
        return sl[:] if box is None else sl[box]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _read_index(root: Path) -> dict[str, str]:
    """The index's ``weight_map`` {tensor name: file}, every file a plain name inside ``root``; ValueError (one
    line naming the index) when it is unreadable or names a file elsewhere."""
    where = root / INDEX
    try:
        weight_map = json.loads(where.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not a mapping of names to files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a readable safetensors index ({_first_line(exc)})") from None
    for fname in set(weight_map.values()):
        inside(root, fname, "file", where)
    return dict(weight_map)


class DictReader:
    """``TensorReader``'s interface over tensors already in memory (e.g. a model loaded from a training
    checkpoint), so code that reads slices by name works on both."""

    def __init__(self, tensors: dict[str, Tensor], root: str = "<memory>") -> None:
        self.weight_map, self.root = dict(tensors), root

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weight_map[name].shape)

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> Tensor:
        t = self.weight_map[name]
        return t if box is None else t[box]

    def close(self) -> None:
        self.weight_map = {}

    def __enter__(self) -> DictReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardedWriter:
    """Writes tensors into ``model-XXXXX-of-YYYYY.safetensors`` files of at most ``max_shard_bytes``
    (a single ``model.safetensors`` when everything fits) and the index. Only call ``add`` on the rank
    that writes."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._current: dict[str, Tensor] = {}
        self._current_bytes = 0
        self._files: list[list[str]] = []
        self.total_size = 0

    def add(self, name: str, tensor: Tensor) -> None:
        if any(name in f for f in self._files) or name in self._current:
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._current[name] = tensor.detach().to("cpu").contiguous().clone()
        self._current_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        idx = len(self._files)
        save_file(self._current, str(self.out_dir / f"_part{idx}.safetensors"), metadata={"format": "pt"})
        self._files.append(list(self._current))
        self._current, self._current_bytes = {}, 0

    def finish(self) -> None:
        if self._current or not self._files:
            self._flush()
        n = len(self._files)
        if n == 1:
            os.replace(self.out_dir / "_part0.safetensors", self.out_dir / SINGLE)
            return
        weight_map = {}
        for i, names in enumerate(self._files):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"_part{i}.safetensors", self.out_dir / fname)
            weight_map.update(dict.fromkeys(names, fname))
        (self.out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": self.total_size},
                                                      "weight_map": weight_map}, indent=2))


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, str(dtype))
