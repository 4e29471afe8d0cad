"""The non-weight files of an HF model directory that travel with its weights: generation settings and
the tokenizer.

``copy_assets(src, dst)`` copies those present in ``src``; ``convert``, ``upcycle`` and
``train --load-hf`` (into ``SAVE/hf_assets``) use it, so an exported directory can be used with
``transformers`` (and ``moefold generate``) exactly as the one it came from.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
ASSET_FILES = (GENERATION_CONFIG, *TOKENIZER_FILES)
# where a training run keeps the assets of the directory it started from (under its --save root)
RUN_ASSETS_DIR = "hf_assets"


def present_assets(src: str | os.PathLike) -> list[str]:
    """The asset files ``src`` holds, in ``ASSET_FILES`` order."""
    return [name for name in ASSET_FILES if (Path(src) / name).is_file()]


def copy_assets(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the asset files of ``src`` into ``dst`` (created); returns their names. Same directory: no-op."""
    src, dst = Path(src), Path(dst)
    names = present_assets(src)
    if not names or (dst.exists() and src.resolve() == dst.resolve()):
        return names
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = dst / f".{name}.tmp{os.getpid()}"
        shutil.copyfile(src / name, tmp)
        os.replace(tmp, dst / name)   # a reader never sees half a tokenizer
    return names
