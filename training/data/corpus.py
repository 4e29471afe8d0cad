"""Opening an indexed corpus in either format, chosen by the ``.idx`` file's magic, and its largest token id.

    data = open_indexed("corpus/web")     # moefold's MOEFIDX or Megatron's MMIDIDX pair
    top = max_token_id(data)              # pre-flight: every id must fit the model's vocabulary

Both readers expose the same interface (``prefix``, ``dtype``, ``vocab_size``, ``tokens``, ``doc_offsets``,
``num_docs``, ``num_tokens``, ``doc_lengths()``, ``document(d)``), so the datasets, the blend and the split
never ask which format they read.
"""

from __future__ import annotations

import os
from typing import Any

from moefold.training.data.indexed import IndexedDataset, idx_path
from moefold.training.data.megatron_indexed import MegatronIndexedDataset, is_megatron_index, scan_max_token_id

CorpusIndex = IndexedDataset   # MegatronIndexedDataset and validation.DocumentRange are IndexedDatasets


def is_corpus(obj: Any) -> bool:
    """An opened corpus (either format, or a document range of one), not a path."""
    return isinstance(obj, IndexedDataset)


def open_indexed(prefix: str | os.PathLike | CorpusIndex) -> CorpusIndex:
    """The reader for ``PREFIX.idx``'s format (an opened corpus is returned as it is)."""
    if is_corpus(prefix):
        return prefix
    path = idx_path(prefix)
    if path.is_file() and is_megatron_index(path):
        return MegatronIndexedDataset(prefix)
    return IndexedDataset(prefix)


def max_token_id(data: Any) -> int:
    """Largest token id of an opened corpus (-1 when empty): the format's own record when it has one (a
    Megatron index has none: a chunked scan of the ``.bin``, cached), else a chunked scan of the tokens."""
    value = getattr(data, "max_token_id", None)
    if callable(value):
        value = value()
    if value is not None:
        return int(value)
    return scan_max_token_id(data.tokens)
