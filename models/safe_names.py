"""Names read from files never become paths outside their folder.

A run id in ``meta.json`` / ``run.json`` names a directory (``SAVE/previous/<run id>/``); a DCP ``.metadata``
names the shard file each tensor lies in; an HF ``model.safetensors.index.json`` names the file of each tensor.
Any of these files can be edited or crafted, so a name read from one is checked to be a plain name (one path
component of ordinary characters: no ``/``, no ``..``, not absolute, nothing hidden) before it is joined to a
folder, and the joined path, resolved (symbolic links followed), is checked to lie inside that folder. A name
that fails raises ``UnsafeNameError``: one line naming the file, the value and what would be valid.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# what run ids, DCP shard names and safetensors file names are made of (moefold, torch and HF write nothing else)
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")


class UnsafeNameError(ValueError):
    """A name read from a file would leave its folder (or is not a plain name); nothing was read or written."""


def plain_name(value: object, what: str, where: str | os.PathLike) -> str:
    """``value`` when it is a plain name (module docstring), else ``UnsafeNameError`` naming ``what`` (e.g.
    "run_id") and ``where`` (the file it was read from)."""
    if not isinstance(value, str) or not _PLAIN.fullmatch(value) or value.strip(".") == "":
        raise UnsafeNameError(f"{where}: {what} {value!r} is not a plain name (letters, digits and . _ + -, no "
                              "path separators, not starting with '.'); refusing to use it as a file name")
    return value


def inside(root: str | os.PathLike, name: object, what: str, where: str | os.PathLike) -> Path:
    """``root / name`` for a plain ``name`` whose resolved path lies inside resolved ``root`` (a symbolic link
    pointing out of it is refused too); ``UnsafeNameError`` otherwise."""
    path = Path(root) / plain_name(name, what, where)
    base = Path(os.path.realpath(root))
    if not Path(os.path.realpath(path)).is_relative_to(base):
        raise UnsafeNameError(f"{where}: {what} {name!r} resolves to {os.path.realpath(path)}, outside {base}; "
                              "refusing to read or write it")
    return path


__all__ = ["UnsafeNameError", "inside", "plain_name"]
