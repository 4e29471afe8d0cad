"""Validation samples: Megatron's ``--split`` of each training corpus, or a separate ``--valid-data-path``.

``--split 969,30,1`` (Megatron's syntax and arithmetic, ``_get_split_indices``) cuts the *documents* of
every ``--data-path`` corpus into consecutive train / validation / test ranges in those proportions;
training then reads only the train range and validation only the validation range, so no validation
document is ever trained on. ``DocumentRange`` is the view of one range that the existing dataset
builders (``GPTDataset``, ``build_blended``) take in place of a corpus, with index caches of its own.

Validation uses the first ``eval_iters * global_batch_size`` samples of its (seeded) sample order
every time, so evaluations along a run and across runs are comparable, and the same samples at every
parallel layout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moefold.training.data.corpus import CorpusIndex, is_corpus, open_indexed
from moefold.training.data.indexed import IndexedDataset

SPLIT_PARTS = ("train", "valid", "test")


def parse_split(text: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"98,2"``, ``"0.9,0.1,0"``) -> normalised (train, valid, test) shares."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not np.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {text!r}: give up to three non-negative shares train,valid,test such as "
                         "969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)


def split_ranges(num_docs: int, split: str) -> list[tuple[int, int]]:
    """[start, stop) document ranges of train, valid, test for a corpus of ``num_docs`` documents."""
    bounds = [0]
    for share in parse_split(split):
        bounds.append(bounds[-1] + round(share * num_docs))
    excess = bounds[-1] - num_docs   # rounding may over/undershoot: Megatron shifts every boundary
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class DocumentRange(IndexedDataset):
    """Documents ``[start, stop)`` of an indexed corpus, read like the whole corpus (same token memmap;
    ``doc_offsets`` is the slice of the corpus' absolute offsets)."""

    def __init__(self, data: CorpusIndex | str | os.PathLike, start: int, stop: int, part: str = "") -> None:
        data = open_indexed(data)
        if not 0 <= start <= stop <= data.num_docs:
            raise ValueError(f"document range [{start}, {stop}) is outside [0, {data.num_docs}) of {data.prefix}")
        self.prefix, self.dtype, self.vocab_size = data.prefix, data.dtype, data.vocab_size
        self.tokens = data.tokens
        self.doc_offsets = data.doc_offsets[start:stop + 1]
        self.start, self.stop, self.part = start, stop, part

    @property
    def num_tokens(self) -> int:
        return int(self.doc_offsets[-1] - self.doc_offsets[0])

    def __repr__(self) -> str:
        return (f"DocumentRange({self.prefix!r}, {self.part or 'docs'} [{self.start}, {self.stop}), "
                f"tokens={self.num_tokens})")


def split_corpora(prefixes: Sequence[str | os.PathLike], split: str, part: str) -> list[DocumentRange]:
    """The ``part`` ("train" / "valid" / "test") range of every corpus; fails naming a corpus whose range is
    empty."""
    index = SPLIT_PARTS.index(part)
    out = []
    for prefix in prefixes:
        data = open_indexed(prefix)
        start, stop = split_ranges(data.num_docs, split)[index]
        if stop <= start:
            raise ValueError(f"--split {split} leaves no {part} documents in {data.prefix} ({data.num_docs} "
                             f"documents); give it a larger {part} share or use --valid-data-path")
        out.append(DocumentRange(data, start, stop, part))
    return out


def split_cache_dir(prefixes: Sequence[str | os.PathLike], split: str, part: str,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the sample indices of a split's ``part`` are cached: apart from the whole corpus' (their cache
    keys would not tell the ranges apart)."""
    first = prefixes[0].prefix if is_corpus(prefixes[0]) else os.fspath(prefixes[0])
    base = Path(cache_dir) if cache_dir is not None else Path(f"{first}.cache")
    return base / f"split-{re.sub(r'[^0-9.]+', '-', split)}-{part}"
