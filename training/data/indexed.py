"""The indexed token format: ``PREFIX.bin`` (the tokens) and ``PREFIX.idx`` (header + document offsets).

``.bin``: every document's token ids, EOS included, back to back, little-endian ``uint16`` when the
vocabulary has fewer than 65536 ids, else ``uint32``. Nothing else.

``.idx`` (little-endian)::

    offset  size  field
    0       8     magic      b"MOEFIDX\\0"
    8       8     version    uint64, currently 2
    16      8     dtype code uint8 (1 = uint16, 2 = uint32) + 7 bytes padding
    24      8     num_docs   uint64
    32      8     num_tokens uint64
    40      8     vocab_size uint64 (the tokenizer's, so a reader can size its embedding)
    48      8     max_token_id uint64 (the largest id in the .bin; version 2)
    56      8*(num_docs+1)   doc_offsets int64: document d is tokens[doc_offsets[d]:doc_offsets[d+1]]

Version 1 files (no ``max_token_id``: the offsets start at byte 48) stay readable; their largest id is found
by a scan of the ``.bin`` (``IndexedDataset.largest_token_id``).

Both files are read through ``numpy.memmap``; a reader never loads the tokens into memory. A writer
writes to temporary names and renames, so a reader never sees a half-written pair.

Opening validates the whole index, not only its ends: every document offset lies in ``[0, num_tokens]`` and none
is smaller than the one before (``check_offsets``: vectorised, in chunks of the memmap, with a progress bar on a
terminal once it has taken a second), so a corrupt offset (one of 2^40, or a decreasing one) is refused naming
the document, instead of training on whatever it points at.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MOEFIDX\0"
VERSION = 2
_HEADER_V1 = struct.Struct("<8sQB7xQQQ")
_HEADER = struct.Struct("<8sQB7xQQQQ")
HEADER_BYTES = _HEADER.size  # 56 (version 1: 48)
_SCAN_CHUNK = 1 << 24   # tokens per step of a largest-id scan (32-64 MiB of a memmap at a time)
DTYPES: dict[int, type[np.unsignedinteger]] = {1: np.uint16, 2: np.uint32}


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 when every id fits (vocab_size < 65536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive")
    return np.uint16 if vocab_size < 65536 else np.uint32


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


class IndexedDatasetWriter:
    """Appends documents (1-D integer arrays) and writes the ``.idx`` on ``finalize()``.

    Use as a context manager; leaving it by an exception removes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int) -> None:
        self.prefix = os.fspath(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        self._tmp_bin = Path(f"{self.prefix}.bin.tmp{os.getpid()}")
        self._tmp_idx = Path(f"{self.prefix}.idx.tmp{os.getpid()}")
        self._tmp_bin.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize()/abort()
        self._lengths: list[int] = []
        self.max_token_id = 0

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D array of token ids, got shape {arr.shape}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{lo}, {hi}]")
            self.max_token_id = max(self.max_token_id, hi)
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(arr.size))

    @property
    def num_docs(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self._lengths)

    def finalize(self) -> None:
        self._file.close()
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self._lengths, dtype=np.int64), out=offsets[1:])
        code = next(c for c, d in DTYPES.items() if d is self.dtype)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, code, len(self._lengths), int(offsets[-1]), self.vocab_size,
                                 self.max_token_id))
            f.write(offsets.astype("<i8").tobytes())
        # .bin first: a reader that finds the .idx finds a complete .bin next to it.
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        self._file.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx``, validated on open.

    ``tokens``: memmap [num_tokens] (uint16/uint32); ``doc_offsets``: memmap [num_docs + 1] int64.
    Raises ``ValueError`` naming the file for a wrong magic/version/dtype, a truncated ``.idx`` or a
    ``.bin`` whose size does not match the index; ``FileNotFoundError`` when either file is missing.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise FileNotFoundError(f"{p}: no such file (expected the pair {bpath.name}/{ipath.name} "
                                        "written by `moefold prepare-data`)")
        size = ipath.stat().st_size
        if size < _HEADER_V1.size:
            raise ValueError(f"{ipath}: {size} bytes is shorter than the {_HEADER_V1.size}-byte header (truncated?)")
        with open(ipath, "rb") as f:
            head = f.read(HEADER_BYTES)
        magic, version, code, num_docs, num_tokens, vocab_size = _HEADER_V1.unpack(head[:_HEADER_V1.size])
        if magic != MAGIC:
            raise ValueError(f"{ipath}: not a moefold index file (magic {magic!r}, expected {MAGIC!r})")
        if version not in (1, VERSION):
            raise ValueError(f"{ipath}: index format version {version} is not supported (this moefold reads "
                             f"versions 1 and {VERSION}); re-run `moefold prepare-data`")
        header_bytes = _HEADER_V1.size if version == 1 else HEADER_BYTES
        if size < header_bytes:
            raise ValueError(f"{ipath}: {size} bytes is shorter than the {header_bytes}-byte header (truncated?)")
        self.max_token_id: int | None = None if version == 1 else _HEADER.unpack(head)[-1]
        if code not in DTYPES:
            raise ValueError(f"{ipath}: unknown dtype code {code} (valid: {sorted(DTYPES)})")
        expected_idx = header_bytes + 8 * (num_docs + 1)
        if size != expected_idx:
            raise ValueError(f"{ipath}: {size} bytes, but a header with num_docs={num_docs} needs "
                             f"{expected_idx} bytes (truncated or corrupt)")
        self.dtype = DTYPES[code]
        self.vocab_size = int(vocab_size)
        itemsize = np.dtype(self.dtype).itemsize
        bsize = bpath.stat().st_size
        if bsize != num_tokens * itemsize:
            raise ValueError(f"{bpath}: {bsize} bytes, but {ipath.name} says {num_tokens} tokens x {itemsize} "
                             f"bytes = {num_tokens * itemsize} bytes (truncated or from another run)")
        self.doc_offsets = np.memmap(ipath, dtype="<i8", mode="r", offset=header_bytes, shape=(num_docs + 1,))
        if self.doc_offsets[0] != 0 or self.doc_offsets[-1] != num_tokens:
            raise ValueError(f"{ipath}: document offsets run from {self.doc_offsets[0]} to "
                             f"{self.doc_offsets[-1]}, expected 0 to num_tokens={num_tokens} (corrupt)")
        check_offsets(self.doc_offsets, num_tokens, f"{ipath}: document")
        # np.memmap cannot map an empty file; an empty corpus is refused later by the datasets.
        self.tokens = (np.memmap(bpath, dtype=self.dtype, mode="r", shape=(num_tokens,)) if num_tokens
                       else np.zeros(0, dtype=self.dtype))

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def largest_token_id(self, progress: bool = True) -> int:
        """The largest id in the ``.bin`` (0 when empty, as the writer records it): the header's (version 2),
        else a scan of the memmap (``scan_max_token_id``), kept for the next call."""
        if self.max_token_id is None:
            self.max_token_id = max(0, scan_max_token_id(self.tokens, progress=progress,
                                                         desc=f"largest token id of {bin_path(self.prefix).name}"))
        return self.max_token_id

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def doc_lengths(self) -> np.ndarray:
        """int64 [num_docs]."""
        return np.diff(np.asarray(self.doc_offsets))

    def document(self, d: int) -> np.ndarray:
        """Token ids of document ``d`` (EOS included), a memmap slice."""
        if not 0 <= d < self.num_docs:
            raise IndexError(f"document {d} out of range [0, {self.num_docs})")
        return self.tokens[self.doc_offsets[d]:self.doc_offsets[d + 1]]

    def __len__(self) -> int:
        return self.num_docs

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, docs={self.num_docs}, tokens={self.num_tokens}, "
                f"vocab={self.vocab_size}, dtype={np.dtype(self.dtype).name})")


def check_offsets(offsets: np.ndarray, end: int, what: str, chunk: int | None = None, progress: bool = True) -> None:
    """ValueError naming the first bad entry unless ``offsets`` (a memmap) never decreases and lies in ``[0, end]``
    (``what``: "FILE: document", the message's subject). Chunks of ``chunk`` entries (default ``_SCAN_CHUNK``),
    each compared with the last of the one before; a progress bar on a terminal once it has taken a second."""
    import sys

    from tqdm import tqdm

    chunk = chunk or _SCAN_CHUNK
    previous = 0
    with tqdm(total=len(offsets), unit="offset", unit_scale=True, desc=f"checking {what} offsets", delay=1.0,
              disable=not (progress and sys.stderr.isatty()), leave=False) as bar:
        for start in range(0, len(offsets), chunk):
            part = np.asarray(offsets[start:start + chunk], dtype=np.int64)
            steps = np.diff(part, prepend=previous)
            bad = np.flatnonzero((steps < 0) | (part < 0) | (part > end))
            if bad.size:
                i = int(bad[0])
                before = int(part[i - 1]) if i else previous
                raise ValueError(f"{what} offset {start + i} is {int(part[i])} (the one before: {before}; valid: "
                                 f"non-decreasing, within [0, {end}]): a corrupt index; re-run `moefold prepare-data`")
            previous = int(part[-1]) if part.size else previous
            bar.update(len(part))


def scan_max_token_id(tokens: np.ndarray, chunk: int | None = None, progress: bool = False, desc: str = "") -> int:
    """max over ``tokens`` in chunks of ``chunk`` elements (default ``_SCAN_CHUNK``; memory bounded by one
    chunk), with a progress bar once it has taken a second; -1 when empty. Float tokens (Megatron allows
    float32/64 ``.bin`` files) must hold integral non-negative ids."""
    from tqdm import tqdm

    chunk = chunk or _SCAN_CHUNK
    top = -1
    with tqdm(total=len(tokens), unit="tok", unit_scale=True, desc=desc or "largest token id", delay=1.0,
              disable=not progress, leave=False) as bar:
        for start in range(0, len(tokens), chunk):
            part = np.asarray(tokens[start:start + chunk])
            if part.dtype.kind == "f":
                if not np.all(np.isfinite(part)) or np.any(part != np.floor(part)) or np.any(part < 0):
                    raise ValueError("token ids stored as floats must be non-negative integers")
            elif part.size and int(part.min()) < 0:
                raise ValueError(f"negative token id {int(part.min())} in the data")
            if part.size:
                top = max(top, int(part.max()))
            bar.update(len(part))
    return top
