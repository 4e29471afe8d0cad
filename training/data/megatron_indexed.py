"""Megatron-LM's indexed token format (``MMIDIDX``): the ``.bin``/``.idx`` pair that
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` (``tools/preprocess_data.py``) writes.

``.bin``: the tokens of every sequence back to back, in the index's dtype (little-endian). ``.idx``::

    offset  size                 field
    0       9                    magic b"MMIDIDX\\0\\0"
    9       8                    version uint64, 1
    17      1                    dtype code uint8 (DTYPE_CODES: 1 uint8 ... 8 uint16)
    18      8                    sequence_count uint64 (S)
    26      8                    document_count uint64 (D + 1)
    34      4*S                  sequence_lengths int32
    .       8*S                  sequence_pointers int64 (byte offsets into .bin)
    .       8*(D+1)              document_indices int64 (sequence index where each document starts; 0 first, S last)
    .       S                    sequence_modes int8 (multimodal datasets only; not read here)

A document is one or more sequences (sentences with ``--split-sentences``); Megatron's ``GPTDataset`` draws
samples over sequences, so this reader exposes sequences as its "documents" (``doc_offsets``), exactly like
moefold's ``IndexedDataset``. The format records no vocabulary size: ``vocab_size`` is the smallest
vocabulary that holds the data, ``largest_token_id() + 1``, found by one chunked scan of the ``.bin`` (bounded
memory) and cached in ``PREFIX.cache/``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from moefold.training.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    bin_path,
    check_offsets,
    idx_path,
    scan_max_token_id,
)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
HEADER_BYTES = _HEADER.size  # 34
# megatron.core.datasets.indexed_dataset.DType: every dtype the format defines
DTYPE_CODES: dict[int, type[np.number]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                            6: np.float64, 7: np.float32, 8: np.uint16}


def is_megatron_index(path: str | os.PathLike) -> bool:
    """The file starts with Megatron's magic."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """The token dtype Megatron's ``preprocess_data.py`` picks (``DType.optimal_dtype``): uint16 below 65500
    ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class MegatronIndexedDatasetWriter(IndexedDatasetWriter):
    """Writes an ``MMIDIDX`` pair byte for byte as Megatron's ``IndexedDatasetBuilder`` does (one sequence per
    document, ``add_item`` + ``end_document``). Temporary names, renamed on ``finalize()`` (.bin first); documents
    are added (and checked against the vocabulary) as by moefold's writer."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, dtype: type[np.number] | None = None) -> None:
        super().__init__(prefix, vocab_size)
        self.dtype = dtype or optimal_dtype(self.vocab_size)
        if not any(d is self.dtype for d in DTYPE_CODES.values()):
            self.abort()
            valid = [d.__name__ for d in DTYPE_CODES.values()]
            raise ValueError(f"dtype {self.dtype} is not one of Megatron's {valid}")

    def finalize(self) -> None:
        self._file.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(self.dtype).itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        code = next(c for c, d in DTYPE_CODES.items() if d is self.dtype)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, code, len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))


class MegatronIndexedDataset(IndexedDataset):
    """Read-only view of a Megatron ``PREFIX.bin``/``PREFIX.idx`` with moefold's ``IndexedDataset`` interface
    (its sequences are the "documents": ``num_docs``, ``document(d)``, ``doc_lengths()``).

    ``tokens``: memmap [num_tokens] in the stored dtype; ``doc_offsets``: int64 [num_sequences + 1] token
    offsets of the sequences; ``document_indices``: Megatron's document boundaries (in sequences).
    Raises ``ValueError`` naming the file for a wrong magic/version/dtype, a truncated ``.idx``, sequences that
    are not stored back to back, or a ``.bin`` whose size does not match; ``FileNotFoundError`` when a file is
    missing.
    """

    format = "megatron"

    def __init__(self, prefix: str | os.PathLike) -> None:   # not the base's: it parses moefold's header
        self.prefix = os.fspath(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise FileNotFoundError(f"{p}: no such file (expected the pair {bpath.name}/{ipath.name})")
        size = ipath.stat().st_size
        if size < HEADER_BYTES:
            raise ValueError(f"{ipath}: {size} bytes is shorter than Megatron's {HEADER_BYTES}-byte header "
                             "(truncated?)")
        with open(ipath, "rb") as f:
            magic, version, code, num_seqs, num_doc_idx = _HEADER.unpack(f.read(HEADER_BYTES))
        if magic != MAGIC:
            raise ValueError(f"{ipath}: not a Megatron index file (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise ValueError(f"{ipath}: Megatron index version {version} is not supported (valid: {VERSION})")
        if code not in DTYPE_CODES:
            raise ValueError(f"{ipath}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)})")
        need = HEADER_BYTES + 12 * num_seqs + 8 * num_doc_idx
        if size not in (need, need + num_seqs):   # + int8 modes of a multimodal index
            raise ValueError(f"{ipath}: {size} bytes, but a header with {num_seqs} sequences and {num_doc_idx} "
                             f"document indices needs {need} bytes (truncated or corrupt)")
        self.dtype = DTYPE_CODES[code]
        itemsize = np.dtype(self.dtype).itemsize
        self.sequence_lengths = np.memmap(ipath, dtype="<i4", mode="r", offset=HEADER_BYTES, shape=(num_seqs,)) \
            if num_seqs else np.zeros(0, dtype=np.int32)
        pointers = np.memmap(ipath, dtype="<i8", mode="r", offset=HEADER_BYTES + 4 * num_seqs, shape=(num_seqs,)) \
            if num_seqs else np.zeros(0, dtype=np.int64)
        self.document_indices = np.memmap(ipath, dtype="<i8", mode="r", offset=HEADER_BYTES + 12 * num_seqs,
                                          shape=(num_doc_idx,)) if num_doc_idx else np.zeros(0, dtype=np.int64)
        if num_seqs and int(np.asarray(self.sequence_lengths).min()) < 0:
            first = int(np.flatnonzero(np.asarray(self.sequence_lengths) < 0)[0])
            raise ValueError(f"{ipath}: sequence {first} has length {int(self.sequence_lengths[first])} (valid: >= 0; "
                             "corrupt index)")
        if num_doc_idx and (self.document_indices[0] != 0 or self.document_indices[-1] != num_seqs):
            raise ValueError(f"{ipath}: document indices run from {self.document_indices[0]} to "
                             f"{self.document_indices[-1]}, expected 0 to the {num_seqs} sequences (corrupt index)")
        check_offsets(self.document_indices, num_seqs, f"{ipath}: document index")
        offsets = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=offsets[1:])
        if num_seqs and not np.array_equal(np.asarray(pointers), offsets[:-1] * itemsize):
            raise ValueError(f"{ipath}: sequence pointers are not the running sum of the lengths (sequences not stored "
                             "back to back; corrupt index)")
        num_tokens = int(offsets[-1])
        bsize = bpath.stat().st_size
        if bsize != num_tokens * itemsize:
            raise ValueError(f"{bpath}: {bsize} bytes, but {ipath.name} says {num_tokens} tokens x {itemsize} bytes = "
                             f"{num_tokens * itemsize} bytes (truncated or from another run)")
        self.doc_offsets = offsets
        self.tokens = (np.memmap(bpath, dtype=self.dtype, mode="r", shape=(num_tokens,)) if num_tokens
                       else np.zeros(0, dtype=self.dtype))
        self.max_token_id: int | None = None   # the format records none: largest_token_id scans once

    def largest_token_id(self, progress: bool = True) -> int:
        """Largest token id in the ``.bin`` (-1 when empty): one chunked scan, cached in ``PREFIX.cache/``."""
        if self.max_token_id is None:
            self.max_token_id = _cached_max_token_id(self, progress)
        return self.max_token_id

    @property
    def vocab_size(self) -> int:
        """The smallest vocabulary that holds every token id of the data (the format stores none)."""
        return self.largest_token_id(progress=False) + 1

    def __repr__(self) -> str:
        return (f"MegatronIndexedDataset({self.prefix!r}, sequences={self.num_docs}, tokens={self.num_tokens}, "
                f"dtype={np.dtype(self.dtype).name})")


def _cached_max_token_id(data: MegatronIndexedDataset, progress: bool) -> int:
    ipath = idx_path(data.prefix)
    st = ipath.stat()
    key = {"idx_bytes": st.st_size, "idx_mtime_ns": st.st_mtime_ns, "bin_bytes": bin_path(data.prefix).stat().st_size}
    cache = Path(f"{data.prefix}.cache") / "max_token_id.json"
    try:
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return int(saved["max_token_id"])
    except (OSError, ValueError, KeyError):
        pass
    top = scan_max_token_id(data.tokens, progress=progress, desc=f"largest token id of {bin_path(data.prefix).name}")
    try:   # a read-only corpus directory only costs the scan next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "max_token_id": top}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return top

