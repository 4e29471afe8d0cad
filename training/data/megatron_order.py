"""``--data-order megatron``: Megatron-Core 0.16's sample order, reimplemented in numpy, sample for sample.

Megatron-Core builds (``megatron/core/datasets/``) for every split of every corpus a ``GPTDataset`` and, for a
blend, a ``BlendedDataset`` over them (``BlendedMegatronDatasetBuilder``). This module computes the same
index arrays from the same inputs, so sample ``i`` here is the token sequence of Megatron's sample ``i``:

- **split** (``split_matrix``): ``--split 969,30,1`` is normalised and turned into book-ends; split ``s`` of a
  corpus of ``N`` sequences is sequences ``[round(a*N), round(b*N))`` (``_build_megatron_dataset_splits``).
- **document index** (``build_document_index``): the split's sequence ids repeated ``num_epochs`` times, as
  int32, shuffled in place by ``numpy.random.RandomState(seed)``; when the last epoch is needed for less than
  80% of its samples it is shuffled separately (``separate_final_epoch``).
- **sample index** (``build_sample_index``, ``helpers.cpp::build_sample_idx``): sample ``k`` starts at token
  ``k * seq_length`` of the concatenation of the documents in document-index order and holds
  ``seq_length + 1`` tokens; entry ``k`` is (position in the document index, offset in that document).
- **shuffle index** (``build_shuffle_index``): a permutation of the samples drawn next from the same
  ``RandomState`` (two, when the final epoch is separate).
- **blend** (``blending_indices``, ``helpers.cpp::build_blending_indices``): each corpus is built with
  ``ceil(ceil(size * w) * (1 + surplus))`` samples per split, the blend holds ``sum_d ceil(size * w_d)``
  samples, and blend sample ``i`` comes from the corpus with the largest ``w_d * max(i, 1) - taken_d``
  (the first on ties). Without weights (``--data-path A B``), each corpus is one epoch and the weights are
  their lengths (Megatron's exhaustive blend when there is no size).

Megatron's sizes (``get_train_valid_test_num_samples``): train ``train_iters * global_batch_size``, valid
``(train_iters // eval_interval + 1) * eval_iters * global_batch_size``, test ``eval_iters * global_batch_size``.
The order depends on those sizes (unlike moefold's own order): the same ``--train-iters`` gives Megatron's
samples. Index arrays are cached as ``.npy`` files named by a hash of what they depend on.
Not reproduced: ``--no-drop-last-partial-validation-sequence`` (padded last samples), mock data, object storage.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moefold.training.data.corpus import CorpusIndex, open_indexed
from moefold.training.data.indexed import idx_path

SPLITS = ("train", "valid", "test")
SURPLUS = 0.005           # BlendedMegatronDatasetConfig.mid_level_dataset_surplus (--mid-level-dataset-surplus)
_FINAL_EPOCH_THRESHOLD = 0.80


def normalize(weights: Sequence[float]) -> list[float]:
    """megatron.core.datasets.utils.normalize: w / sum(w) in float64, as a list."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """``"969,30,1"`` -> book-ends per split, None for an empty split (parse_and_normalize_split +
    convert_split_vector_to_split_matrix)."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(values) <= 3 or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative shares train,valid,test such as 969,30,1")
    vector = normalize(values + [0.0] * (3 - len(values)))
    ends = functools.reduce(lambda a, b: [*a, a[-1] + b], [[0], *vector])
    out: list[tuple[float, float] | None] = []
    for lo, hi in itertools.pairwise(ends):
        out.append(None if hi <= lo else (lo, hi))
    return out


def parse_blend(items: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """megatron.core.datasets.utils.get_blend_from_list: ``A`` / ``A B`` (no weights) / ``W1 A W2 B``."""
    items = [str(i) for i in items]
    if len(items) % 2 == 1:
        return [i.strip() for i in items], None
    try:
        weights = [float(w) for w in items[::2]]
    except ValueError:
        return [i.strip() for i in items], None
    return [p.strip() for p in items[1::2]], weights


def num_samples_per_split(train_iters: int, global_batch_size: int, eval_iters: int,
                          eval_interval: int | None) -> list[int]:
    """Megatron-LM's ``get_train_valid_test_num_samples`` (``eval_interval=None``: one evaluation at the end)."""
    interval = eval_interval or train_iters
    return [train_iters * global_batch_size, (train_iters // interval + 1) * eval_iters * global_batch_size,
            eval_iters * global_batch_size]


# --------------------------------------------------------------------------------------------- index builders
def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """gpt_dataset._build_document_index: int32 [num_epochs * len(documents)]."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int64), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, add_extra_token: bool = True) -> np.ndarray:
    """helpers.cpp::build_sample_idx with ``drop_last_partial_sequence=True``: [num_samples + 1, 2]
    (int32 while every entry fits, as Megatron's), row ``k`` = (position in ``document_index``, offset) of the
    token where sample ``k`` starts (row ``num_samples``: where the next one would)."""
    extra = int(add_extra_token)
    num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    doc_sizes = np.asarray(sizes, dtype=np.int64)[np.asarray(document_index, dtype=np.int64)]
    starts = np.zeros(len(doc_sizes) + 1, dtype=np.int64)
    np.cumsum(doc_sizes, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # the document holding each start; empty documents share a start, side="right" skips them as the C++ loop does
    which = np.searchsorted(starts, positions, side="right") - 1
    out = np.stack([which, positions - starts[which]], axis=1)
    out[0] = 0   # the C++ loop starts at (0, 0) even when the first document is empty
    dtype = np.int32 if max(len(document_index), int(np.max(sizes, initial=0))) <= np.iinfo(np.int32).max \
        else np.int64
    return out.astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """gpt_dataset._build_shuffle_index: [0, num_samples) shuffled, then [num_samples, total_size) shuffled."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _most_behind(w: Sequence[float], counts: Sequence[int], x: float, candidates) -> int:
    """The candidate with the largest ``w_d * x - counts_d`` (the first on ties), in float64 as the C++."""
    best, top = -1, -math.inf
    for d in candidates:
        err = w[d] * x - counts[d]
        if err > top:
            best, top = d, err
    return best


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """helpers.cpp::build_blending_indices: (dataset_index int16 [size], dataset_sample_index int64 [size]).
    Sample ``i`` goes to the dataset with the largest ``w_d * max(i, 1) - taken_d`` (first on ties). A sequential
    rule (each choice depends on the previous ones): a plain loop, about 1 s per million samples, once per run
    (the result is cached)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    owner, position = array("h"), array("q")
    every = range(len(w))
    for i in range(size):
        best = _most_behind(w, counts, max(float(i), 1.0), every)
        owner.append(best)
        position.append(counts[best])
        counts[best] += 1
    return np.frombuffer(owner, dtype=np.int16).copy(), np.frombuffer(position, dtype=np.int64).copy()


def exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """helpers.cpp::build_exhaustive_blending_indices: every sample of every dataset once, in proportion."""
    total = int(sum(sizes))
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]   # ascending, as the C++ std::set
    owner, position = array("h"), array("q")
    i = 0
    while unspent:
        best = _most_behind(w, counts, max(float(i), 1.0), unspent)
        owner.append(best)
        position.append(counts[best])
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
        i += 1
    return np.frombuffer(owner, dtype=np.int16).copy(), np.frombuffer(position, dtype=np.int64).copy()


def _size_per_split_per_dataset(weights: Sequence[float], sizes: Sequence[int], surplus: float = 0.0,
                                ) -> list[list[int]]:
    return [[math.ceil(math.ceil(s * w) * (1 + surplus)) for s in sizes] for w in weights]


# --------------------------------------------------------------------------------------------- datasets
def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def _cached(cache_dir: Path | None, desc: dict, names: Sequence[str],
            build: Callable[[], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """The arrays ``build()`` returns, cached under ``cache_dir`` in files named by a hash of ``desc``."""
    if cache_dir is None:
        return build()
    key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    paths = [cache_dir / f"{key}-{n}.npy" for n in names]
    if all(p.is_file() for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)
    arrays = build()
    cache_dir.mkdir(parents=True, exist_ok=True)
    for p, a in zip(paths, arrays):
        _save_npy(p, a)
    marker = cache_dir / f"{key}.json"
    if not marker.is_file():
        tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(desc, indent=1, sort_keys=True))
        os.replace(tmp, marker)
    return arrays


class MegatronGPTDataset:
    """Megatron's ``GPTDataset`` over sequences ``indices`` of ``data``: ``len(self)`` samples of
    ``seq_length + 1`` token ids (int64), sample ``i`` = Megatron's ``text`` of sample ``i``.

    ``num_samples=None``: one epoch. ``len(self)`` may exceed ``num_samples`` (Megatron's too: whole epochs).
    """

    def __init__(self, data: CorpusIndex | str | os.PathLike, indices: np.ndarray, num_samples: int | None,
                 seq_length: int, seed: int, split: str = "train", cache_dir: str | os.PathLike | None = None) -> None:
        self.data = open_indexed(data)
        self.indices = np.asarray(indices, dtype=np.int32)
        self.seq_len, self.num_samples, self.seed, self.split = seq_length, num_samples, seed, split
        if seq_length < 2:
            raise ValueError(f"seq_length={seq_length} must be >= 2 (Megatron's sample index needs it)")
        sizes = self.data.doc_lengths()
        tokens_per_epoch = int(sizes[self.indices].sum())
        if tokens_per_epoch < 2:
            raise ValueError(f"{self.data.prefix}: the {split} split ({len(self.indices)} sequences) holds "
                             f"{tokens_per_epoch} tokens; a sample needs at least seq_length + 1 = {seq_length + 1}")
        num_epochs = 1
        if num_samples is not None:
            while num_epochs * tokens_per_epoch < num_samples * seq_length + 1:
                num_epochs += 1
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate, before_final = False, 0
        if num_epochs > 1:
            before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
            separate = num_samples - before_final < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
        if (num_epochs * tokens_per_epoch - 1) // seq_length < 1:
            raise ValueError(f"{self.data.prefix}: the {split} split holds {tokens_per_epoch} tokens, fewer than one "
                             f"sample of seq_length + 1 = {seq_length + 1}")

        def build() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            rng = np.random.RandomState(seed)
            doc_index = build_document_index(self.indices, num_epochs, rng, separate)
            sample_index = build_sample_index(sizes.astype(np.int32), doc_index, seq_length, num_epochs,
                                              tokens_per_epoch)
            total = sample_index.shape[0] - 1
            shuffle_index = build_shuffle_index(before_final if separate else total, total, rng)
            return doc_index, sample_index, shuffle_index

        st = idx_path(self.data.prefix).stat()
        desc = {"kind": "megatron GPTDataset", "prefix": os.path.abspath(self.data.prefix),
                "idx_mtime_ns": st.st_mtime_ns, "idx_bytes": st.st_size, "split": split,
                "first": int(self.indices[0]) if len(self.indices) else 0, "count": len(self.indices),
                "num_samples": num_samples, "seq_length": seq_length, "seed": seed}
        base = Path(cache_dir) if cache_dir is not None else Path(f"{self.data.prefix}.cache") / "megatron"
        self.document_index, self.sample_index, self.shuffle_index = _cached(
            base, desc, ("document_index", "sample_index", "shuffle_index"), build)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        """Sample ``idx``: int64 [seq_length + 1] (GPTDataset._query_document_sample_shuffle_indices)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        i = int(self.shuffle_index[idx])
        (j, offset), (j_end, end_offset) = self.sample_index[i], self.sample_index[i + 1]
        j, offset, j_end, end_offset = int(j), int(offset), int(j_end), int(end_offset)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled, offsets, tokens = 0, self.data.doc_offsets, self.data.tokens
        for k in range(j, j_end + 1):
            doc = int(self.document_index[k])
            start = int(offsets[doc]) + (offset if k == j else 0)
            stop = int(offsets[doc]) + end_offset + 1 if k == j_end else int(offsets[doc + 1])
            out[filled:filled + stop - start] = tokens[start:stop]
            filled += stop - start
        return out

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size


class MegatronBlendedDataset:
    """Megatron's ``BlendedDataset``: ``size`` samples (None: every sample of every dataset once, Megatron's
    exhaustive blend), sample ``i`` = sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``."""

    def __init__(self, datasets: Sequence[MegatronGPTDataset], weights: Sequence[float] | None, size: int | None,
                 cache_dir: str | os.PathLike | None = None) -> None:
        self.datasets = list(datasets)
        if weights is None:
            weights = [len(d) for d in self.datasets]
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = size

        def build() -> tuple[np.ndarray, np.ndarray]:
            if size is None:
                return exhaustive_blending_indices(self.weights)
            return blending_indices(self.weights, size)

        desc = {"kind": "megatron BlendedDataset", "weights": self.weights, "size": size,
                "datasets": [[os.path.abspath(d.data.prefix), d.split, d.num_samples, d.seq_len, d.seed,
                              int(d.indices[0]) if len(d.indices) else 0, len(d.indices)] for d in self.datasets]}
        first = self.datasets[0].data.prefix
        base = Path(cache_dir) if cache_dir is not None else Path(f"{first}.cache") / "megatron"
        self.dataset_index, self.dataset_sample_index = _cached(base, desc, ("dataset_index", "dataset_sample_index"),
                                                                build)
        taken = np.bincount(np.asarray(self.dataset_index, dtype=np.int64), minlength=len(self.datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, taken)):
            if n > len(ds):
                raise ValueError(f"the {ds.split} blend takes {n} samples from {ds.data.prefix} (dataset {d}) but it "
                                 f"has {len(ds)}; Megatron raises the same (raise --mid-level-dataset-surplus)")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    @property
    def vocab_size(self) -> int:
        return max(d.vocab_size for d in self.datasets)

    @property
    def seq_len(self) -> int:
        return self.datasets[0].seq_len


@dataclass(frozen=True)
class MegatronBlend:
    """What Megatron's ``BlendedMegatronDatasetConfig`` gets from the data flags: ``blend`` (``--data-path`` with
    ``--split``) or ``blend_per_split`` (``--train-data-path``/``--valid-data-path``/``--test-data-path``)."""

    blend: tuple[tuple[str, ...], tuple[float, ...] | None] | None = None
    blend_per_split: tuple[tuple[tuple[str, ...], tuple[float, ...] | None] | None, ...] | None = None
    split: str | None = None


def _split_datasets(prefix: str, matrix: Sequence[tuple[float, float] | None], sizes: Sequence[int | None],
                    seq_length: int, seed: int, cache_dir: str | os.PathLike | None) -> list[MegatronGPTDataset | None]:
    data = open_indexed(prefix)
    n = data.num_docs
    out: list[MegatronGPTDataset | None] = []
    for s, bookends in enumerate(matrix):
        if bookends is None:
            out.append(None)
            continue
        begin, end = round(bookends[0] * float(n)), round(bookends[1] * float(n))   # Megatron's int(round())
        if end <= begin:
            raise ValueError(f"--split leaves no {SPLITS[s]} sequences in {prefix} ({n} sequences)")
        out.append(MegatronGPTDataset(data, np.arange(begin, end, dtype=np.int32), sizes[s], seq_length, seed,
                                      SPLITS[s], cache_dir))
    return out


def _blend_splits(prefixes: Sequence[str], weights: Sequence[float] | None, matrix, sizes: Sequence[int | None],
                  seq_length: int, seed: int, surplus: float, cache_dir, per_split: bool = False) -> list:
    # one corpus is its GPTDataset itself; with --data-path only without a weight (Megatron's two code paths)
    if len(prefixes) == 1 and (weights is None or per_split):
        return _split_datasets(prefixes[0], matrix, sizes, seq_length, seed, cache_dir)
    if weights is not None:
        weights = normalize(weights)
        target = _size_per_split_per_dataset(weights, [s or 0 for s in sizes])
        buffer = _size_per_split_per_dataset(weights, [s or 0 for s in sizes], surplus)
    else:
        target, buffer = None, [[None] * 3 for _ in prefixes]
    per_prefix = [_split_datasets(p, matrix, buffer[d], seq_length, seed, cache_dir) for d, p in enumerate(prefixes)]
    out: list = [None] * 3
    for s in range(3):
        if matrix[s] is None:
            continue
        parts = [per_prefix[d][s] for d in range(len(prefixes))]
        if weights is not None:
            size = sum(target[d][s] for d in range(len(prefixes)))
            out[s] = MegatronBlendedDataset(parts, weights, size, cache_dir)
        else:
            lengths = [len(p) for p in parts]
            size = min(sizes[s], sum(lengths)) if sizes[s] is not None else None
            out[s] = MegatronBlendedDataset(parts, lengths, size, cache_dir)
    return out


def build_megatron_datasets(blend: MegatronBlend, sizes: Sequence[int | None], seq_length: int, seed: int,
                            surplus: float = SURPLUS, cache_dir: str | os.PathLike | None = None) -> list:
    """[train, valid, test] as Megatron's ``BlendedMegatronDatasetBuilder(GPTDataset, sizes, ...).build()``
    returns them (None for a split without data)."""
    if blend.blend is not None:
        prefixes, weights = blend.blend
        return _blend_splits(list(prefixes), list(weights) if weights is not None else None,
                             split_matrix(blend.split or "969,30,1"), sizes, seq_length, seed, surplus, cache_dir)
    out: list = [None] * 3
    for s, per in enumerate(blend.blend_per_split or (None,) * 3):
        if per is None:
            continue
        matrix: list = [None] * 3
        matrix[s] = (0.0, 1.0)
        one = [0, 0, 0]
        one[s] = sizes[s]
        prefixes, weights = per
        out[s] = _blend_splits(list(prefixes), list(weights) if weights is not None else None, matrix, one,
                               seq_length, seed, surplus, cache_dir, per_split=True)[s]
    return out
