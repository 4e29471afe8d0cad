"""The built-in corpus: the running Python's standard library sources, tokenised on first use and cached.

Real text present on every machine, so ``moefold train`` needs no download. The files are the
``*.py`` under ``sysconfig.get_paths()["stdlib"]`` in sorted relative-path order, without
installed packages (site-packages), the test suites, codec tables (``encodings``) and the pydoc
topic dump (``pydoc_data``), skipping files that are not UTF-8, taken until ``max_bytes`` (default
4 MB: about a million tokens at vocab 4096, prepared in a few seconds on 2 cores). Each file is one
document.

The cache directory is ``$XDG_CACHE_HOME/moefold`` or ``~/.cache/moefold``, one sub-directory
``stdlib-<python version>-v<vocab>-<cap>`` per setting. Preparation holds a file lock, so ranks
that start together prepare it once.
"""

from __future__ import annotations

import fcntl
import os
import sys
import sysconfig
from pathlib import Path

from moefold.training.data.indexed import idx_path
from moefold.training.data.prepare import prepare

DEFAULT_VOCAB = 4096
DEFAULT_MAX_BYTES = 4 * 2**20
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__", "encodings",
                           "pydoc_data", "idle_test"})
NAME = "stdlib"


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES, root: str | os.PathLike | None = None) -> list[Path]:
    """The corpus' files, in order, until their total size reaches ``max_bytes``."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: site-packages can be huge
        candidates.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    files, total = [], 0
    for p in candidates:
        if total >= max_bytes:
            break
        try:
            data = p.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if data:
            files.append(p)
            total += len(data)
    return files


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moefold"


def builtin_corpus(vocab_size: int = DEFAULT_VOCAB, cache_dir: str | os.PathLike | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES, workers: int = 1, progress: bool = False) -> str:
    """Path prefix of the prepared built-in corpus (``PREFIX.bin``/``.idx``/``.tokenizer.json``).

    ``cache_dir`` is the directory holding this one corpus (default: a sub-directory of
    ``default_cache_root()`` named by Python version, vocab and cap). Prepared on first call (``progress``: with
    progress bars when stderr is a terminal).
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be positive")
    version = ".".join(str(v) for v in sys.version_info[:3])
    cap = f"{max_bytes // 2**20}MB" if max_bytes % 2**20 == 0 else f"{max_bytes}B"
    name = f"stdlib-{version}-v{vocab_size}-{cap}"
    directory = Path(cache_dir) if cache_dir is not None else default_cache_root() / name
    prefix = directory / NAME
    if idx_path(prefix).is_file():  # the .idx is renamed into place last
        return str(prefix)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not idx_path(prefix).is_file():  # another process may have finished while we waited
                files = stdlib_files(max_bytes)
                if not files:
                    raise ValueError(f"built-in corpus: no UTF-8 *.py files under {sysconfig.get_paths()['stdlib']}")
                prepare([], prefix, vocab_size=vocab_size, workers=workers, files=files,
                        progress=None if progress else False)   # a bar only on a terminal
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(prefix)
