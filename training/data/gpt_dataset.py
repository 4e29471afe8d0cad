"""Fixed-length training samples over an indexed corpus, shuffled by seed, indices cached on disk.

Per epoch the documents are concatenated in a seeded random order into one token stream (the EOS at
the end of each document separates them). Sample ``i`` of that stream is ``stream[i*L : i*L + L + 1]``
(``L = seq_len``; consecutive samples share one token, the last label of one is the first input of
the next), so samples cross document boundaries and no token is padding. Enough epochs are laid end
to end to give ``num_samples`` samples, and the sample order is a seeded permutation.

Three index arrays describe this and are cached as ``.npy`` under ``cache_dir``, in files named by a
hash of everything they depend on (the corpus' size and mtime, seq_len, num_samples, seed):

- ``doc_idx``    int64 [epochs * num_docs]: document order of the stream
- ``sample_idx`` int64 [num_samples, 2]: (position in doc_idx, token offset in that document) of each
  sample's first token
- ``shuffle_idx`` int64 [num_samples]: dataset index -> stream sample

Writers use temporary names and rename, so ranks that build the same cache at once do no harm.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from moefold.training.data.indexed import IndexedDataset, idx_path

_INDEX_FORMAT = 1


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def build_indices(doc_lengths: np.ndarray, seq_len: int, num_samples: int, seed: int,
                  shuffle: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) as described in the module docstring. Pure function."""
    num_docs = len(doc_lengths)
    num_tokens = int(doc_lengths.sum())
    epochs = max(1, -(-(num_samples * seq_len + 1) // num_tokens))
    rng = np.random.default_rng(seed)
    if shuffle:
        doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(epochs)]).astype(np.int64)
    else:
        doc_idx = np.tile(np.arange(num_docs, dtype=np.int64), epochs)
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(doc_lengths[doc_idx], out=starts[1:])
    positions = np.arange(num_samples, dtype=np.int64) * seq_len
    # Empty documents give repeated starts; side="right" picks the last (non-empty) one.
    which = np.searchsorted(starts, positions, side="right") - 1
    sample_idx = np.stack([which, positions - starts[which]], axis=1)
    shuffle_idx = rng.permutation(num_samples).astype(np.int64) if shuffle else np.arange(num_samples)
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset:
    """``len(self)`` samples of ``seq_len + 1`` token ids each (int64), from ``data``.

    Args:
        data: an ``IndexedDataset`` or its path prefix.
        seq_len: tokens per sample input; each sample has ``seq_len + 1`` ids (inputs + shifted labels).
        num_samples: how many samples (more than one epoch repeats the corpus, re-shuffled). ``None``:
            one epoch, ``(num_tokens - 1) // seq_len`` samples.
        seed: document order and sample order.
        cache_dir: where the index arrays are cached (default ``PREFIX.cache/`` next to the data).
    Raises ValueError when a sample does not fit in the corpus (seq_len + 1 > num_tokens).
    """

    def __init__(self, data: IndexedDataset | str | os.PathLike, seq_len: int, num_samples: int | None = None,
                 seed: int = 1234, cache_dir: str | os.PathLike | None = None, shuffle: bool = True) -> None:
        self.data = data if isinstance(data, IndexedDataset) else IndexedDataset(data)
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        n = self.data.num_tokens
        if n == 0:
            raise ValueError(f"{self.data.prefix}.bin: empty corpus (0 tokens)")
        if seq_len + 1 > n:
            raise ValueError(f"seq_len={seq_len} is longer than the data: a sample needs seq_len + 1 = {seq_len + 1} "
                             f"tokens but {self.data.prefix}.bin holds only {n}")
        if num_samples is None:
            num_samples = (n - 1) // seq_len
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        self.seq_len, self.num_samples, self.seed, self.shuffle = seq_len, int(num_samples), seed, shuffle
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(f"{self.data.prefix}.cache")
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load_or_build()

    def cache_key(self) -> tuple[str, dict]:
        """(hash naming the cache files, the description it hashes)."""
        st = idx_path(self.data.prefix).stat()
        desc = {"format": _INDEX_FORMAT, "prefix": os.path.abspath(self.data.prefix), "num_docs": self.data.num_docs,
                "num_tokens": self.data.num_tokens, "idx_mtime_ns": st.st_mtime_ns, "seq_len": self.seq_len,
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16], desc

    def _load_or_build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key, desc = self.cache_key()
        names = ("doc_idx", "sample_idx", "shuffle_idx")
        paths = [self.cache_dir / f"{key}.{name}.npy" for name in names]
        marker = self.cache_dir / f"{key}.json"
        if marker.is_file() and all(p.is_file() for p in paths):
            self.cache_hit = True
            return tuple(np.load(p, mmap_mode="r") for p in paths)
        self.cache_hit = False
        arrays = build_indices(self.data.doc_lengths(), self.seq_len, self.num_samples, self.seed, self.shuffle)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for p, arr in zip(paths, arrays):
            _save_npy(p, arr)
        tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(desc, indent=1, sort_keys=True))
        os.replace(tmp, marker)  # written last: its presence means the arrays are complete
        return arrays

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: int64 [seq_len + 1]."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        j, offset = (int(v) for v in self.sample_idx[int(self.shuffle_idx[i])])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled = 0
        offsets = self.data.doc_offsets
        while filled < len(out):
            doc = int(self.doc_idx[j])
            start = int(offsets[doc]) + offset
            take = min(int(offsets[doc + 1]) - start, len(out) - filled)
            out[filled:filled + take] = self.data.tokens[start:start + take]
            filled += take
            j, offset = j + 1, 0
        return out

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size
