"""Fixed-length training samples over an indexed corpus, shuffled by seed, indices cached on disk.

The data order is a function of (corpus, seq_len, seed) only, never of how many samples a run asks
for: sample ``i`` is the same whether the run is 20 or 20,000 steps long, so a longer run (or a
resumed one with a larger ``--train-iters``) continues the same sequence.

Epoch ``e`` concatenates the documents in the order ``permutation(num_docs)`` drawn from
``default_rng([seed, e])`` into one token stream (the EOS at the end of each document separates them).
Its ``S = (num_tokens - 1) // seq_len`` samples are ``stream[k*L : k*L + L + 1]`` (``L = seq_len``;
consecutive samples share one token, the last label of one is the first input of the next), so
samples cross document boundaries and no token is padding; the few tokens after the last full sample
of an epoch are not used in that epoch. The same generator then permutes the epoch's samples. Sample
``i`` of the dataset is sample ``i % S`` (after that permutation) of epoch ``i // S``: every epoch is
reshuffled, deterministically, and its order is fixed before it is reached.

Two index arrays per epoch are cached as ``.npy`` under ``cache_dir``, in files named by a hash of
everything they depend on (the corpus' size and mtime, seq_len, seed) and the epoch number:

- ``KEY.eEEEEE.doc_idx.npy``    int64 [num_docs]: document order of the epoch's stream
- ``KEY.eEEEEE.sample_idx.npy`` int64 [S, 2]: (position in doc_idx, token offset in that document) of
  each sample's first token, in the epoch's shuffled sample order

Writers use temporary names and rename, so ranks that build the same cache at once do no harm and a
file that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from moefold.training.data.corpus import CorpusIndex, open_indexed
from moefold.training.data.indexed import idx_path

_INDEX_FORMAT = 2   # 2: per-epoch indices, independent of the run length


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def samples_per_epoch(num_tokens: int, seq_len: int) -> int:
    """Samples of ``seq_len + 1`` tokens in one pass over ``num_tokens`` tokens (consecutive ones share a token)."""
    return (num_tokens - 1) // seq_len


def build_epoch(doc_lengths: np.ndarray, seq_len: int, seed: int, epoch: int,
                shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(doc_idx int64 [num_docs], sample_idx int64 [S, 2]) of ``epoch``, as the module docstring says.
    A pure function of its arguments."""
    num_docs = len(doc_lengths)
    num_tokens = int(doc_lengths.sum())
    rng = np.random.default_rng([seed, epoch])
    doc_idx = (rng.permutation(num_docs) if shuffle else np.arange(num_docs)).astype(np.int64)
    starts = np.zeros(num_docs + 1, dtype=np.int64)
    np.cumsum(doc_lengths[doc_idx], out=starts[1:])
    positions = np.arange(samples_per_epoch(num_tokens, seq_len), dtype=np.int64) * seq_len
    # Empty documents give repeated starts; side="right" picks the last (non-empty) one.
    which = np.searchsorted(starts, positions, side="right") - 1
    sample_idx = np.stack([which, positions - starts[which]], axis=1)
    if shuffle:
        sample_idx = sample_idx[rng.permutation(len(sample_idx))]
    return doc_idx, sample_idx


class GPTDataset:
    """``len(self)`` samples of ``seq_len + 1`` token ids each (int64), from ``data``.

    Args:
        data: an opened corpus (``training.data.corpus.open_indexed``: either format) or its path prefix.
        seq_len: tokens per sample input; each sample has ``seq_len + 1`` ids (inputs + shifted labels).
        num_samples: how many samples (more than one epoch repeats the corpus, re-shuffled). ``None``:
            one epoch, ``(num_tokens - 1) // seq_len`` samples. Sample ``i`` does not depend on it.
        seed: document order and sample order of every epoch (a non-negative integer).
        cache_dir: where the index arrays are cached (default ``PREFIX.cache/`` next to the data).
    Raises ValueError when a sample does not fit in the corpus (seq_len + 1 > num_tokens), and from
    ``__getitem__`` when a token id is outside the vocabulary the ``.idx`` header declares.
    """

    def __init__(self, data: CorpusIndex | str | os.PathLike, seq_len: int, num_samples: int | None = None,
                 seed: int = 1234, cache_dir: str | os.PathLike | None = None, shuffle: bool = True) -> None:
        self.data = open_indexed(data)
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed} must be a non-negative integer")
        n = self.data.num_tokens
        if n == 0:
            raise ValueError(f"{self.data.prefix}.bin: empty corpus (0 tokens)")
        if seq_len + 1 > n:
            raise ValueError(f"seq_len={seq_len} is longer than the data: a sample needs seq_len + 1 = {seq_len + 1} "
                             f"tokens but {self.data.prefix}.bin holds only {n}")
        self.samples_per_epoch = samples_per_epoch(n, seq_len)
        if num_samples is None:
            num_samples = self.samples_per_epoch
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        self.seq_len, self.num_samples, self.seed, self.shuffle = seq_len, int(num_samples), seed, shuffle
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(f"{self.data.prefix}.cache")
        num_epochs = -(-self.num_samples // self.samples_per_epoch)
        self.cache_hit = True
        self.epochs = [self._load_or_build(e) for e in range(num_epochs)]

    def cache_key(self) -> tuple[str, dict]:
        """(hash naming the cache files, the description it hashes)."""
        st = idx_path(self.data.prefix).stat()
        desc = {"format": _INDEX_FORMAT, "prefix": os.path.abspath(self.data.prefix), "num_docs": self.data.num_docs,
                "num_tokens": self.data.num_tokens, "idx_mtime_ns": st.st_mtime_ns, "seq_len": self.seq_len,
                "seed": self.seed, "shuffle": self.shuffle}
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16], desc

    def _load_or_build(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        key, desc = self.cache_key()
        paths = [self.cache_dir / f"{key}.e{epoch:06d}.{name}.npy" for name in ("doc_idx", "sample_idx")]
        if all(p.is_file() for p in paths):   # each file is renamed into place complete
            return tuple(np.load(p, mmap_mode="r") for p in paths)
        self.cache_hit = False
        arrays = build_epoch(self.data.doc_lengths(), self.seq_len, self.seed, epoch, self.shuffle)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for p, arr in zip(paths, arrays):
            _save_npy(p, arr)
        marker = self.cache_dir / f"{key}.json"   # for people: what the files named KEY.* depend on
        if not marker.is_file():
            tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(desc, indent=1, sort_keys=True))
            os.replace(tmp, marker)
        return arrays

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: int64 [seq_len + 1]."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        i %= self.num_samples
        doc_idx, sample_idx = self.epochs[i // self.samples_per_epoch]
        j, offset = (int(v) for v in sample_idx[i % self.samples_per_epoch])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled = 0
        offsets = self.data.doc_offsets
        while filled < len(out):
            doc = int(doc_idx[j])
            start = int(offsets[doc]) + offset
            take = min(int(offsets[doc + 1]) - start, len(out) - filled)
            out[filled:filled + take] = self.data.tokens[start:start + take]
            filled += take
            j, offset = j + 1, 0
        top = int(out.max())
        if top >= self.data.vocab_size:   # the embedding would fail with a bare "index out of range"
            raise ValueError(f"{self.data.prefix}.bin: token id {top} in sample {i} is outside the vocabulary of "
                             f"{self.data.vocab_size} that {self.data.prefix}.idx declares (corrupt data, or a .bin "
                             "from another tokenizer); re-run `moefold prepare-data`")
        return out

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size
