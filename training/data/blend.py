"""Several datasets mixed by weight, deterministically, with exact proportions.

Dataset ``d`` with normalised weight ``w_d`` contributes its ``k``-th sample at "time"
``(k + 0.5) / w_d``; the blend takes the first ``num_samples`` events in time order (ties by dataset
index). Every prefix of the blend therefore holds round(n * w_d) samples of dataset ``d`` to within
one sample per dataset, and the order depends only on the weights, never on a random state or on
``num_samples``: the blend of a longer run begins with the blend of a shorter one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from moefold.training.data.gpt_dataset import GPTDataset


def normalise_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError(f"weights={list(weights)} must be a non-empty list")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights={list(weights)} must all be positive and finite")
    return w / w.sum()


def blend_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int64 [n], dataset_sample_index int64 [n]): blend sample i is sample
    ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``."""
    w = normalise_weights(weights)
    times, owners = [], []
    # The n-th event has time < n + D/2 (each dataset has at least t*w_d - 1/2 events before time t), so
    # these counts hold every event up to it: the first n events are those of the infinite sequence, and
    # a longer run's blend starts with a shorter run's.
    for d, wd in enumerate(w):
        k = np.arange(int(np.ceil((num_samples + len(w) / 2) * wd)) + 2, dtype=np.float64)
        times.append((k + 0.5) / wd)
        owners.append(np.full(len(k), d, dtype=np.int64))
    t, o = np.concatenate(times), np.concatenate(owners)
    order = np.lexsort((o, t))[:num_samples]
    dataset_index = o[order]
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    for d in range(len(w)):
        mask = dataset_index == d
        dataset_sample_index[mask] = np.arange(int(mask.sum()))
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` in the proportions ``weights``.

    Each dataset must hold at least as many samples as the blend takes from it (``build_blended``
    sizes them so).
    """

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], num_samples: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights; give one weight per dataset")
        lengths = {ds.seq_len for ds in datasets}
        if len(lengths) > 1:
            raise ValueError(f"blended datasets have different seq_len {sorted(lengths)}; use one seq_len")
        vocabs = {ds.vocab_size for ds in datasets}
        if len(vocabs) > 1:
            raise ValueError(f"blended datasets have different vocab sizes {sorted(vocabs)}; "
                             "prepare them with the same --tokenizer")
        self.datasets = list(datasets)
        self.weights = normalise_weights(weights)
        self.num_samples = int(num_samples)
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, self.num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for ds, c in zip(self.datasets, counts):
            if c > len(ds):
                raise ValueError(f"the blend takes {c} samples from {ds.data.prefix} but that dataset was built "
                                 f"with {len(ds)}; build it with num_samples >= {c}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    @property
    def vocab_size(self) -> int:
        return self.datasets[0].vocab_size


def parse_data_path(items: Sequence[str]) -> tuple[list[str], list[float]]:
    """Megatron-style ``--data-path``: ``PREFIX`` or ``W1 PREFIX1 W2 PREFIX2 ...`` -> (prefixes, weights)."""
    items = list(items)
    if len(items) == 1:
        return items, [1.0]
    if not items or len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: give one PREFIX, or pairs of WEIGHT PREFIX")
    weights, prefixes = [], []
    for w, p in zip(items[::2], items[1::2]):
        try:
            weights.append(float(w))
        except ValueError:
            raise ValueError(f"--data-path: {w!r} is not a weight; give pairs of WEIGHT PREFIX") from None
        prefixes.append(p)
    return prefixes, weights


def build_blended(prefixes: Sequence[str | os.PathLike], weights: Sequence[float] | None, seq_len: int,
                  num_samples: int, seed: int = 1234,
                  cache_dir: str | os.PathLike | None = None) -> GPTDataset | BlendedDataset:
    """One ``GPTDataset`` per prefix, each sized to what the blend takes from it; a single prefix
    gives the ``GPTDataset`` itself."""
    if len(prefixes) == 1:
        return GPTDataset(prefixes[0], seq_len, num_samples, seed=seed, cache_dir=cache_dir)
    weights = [1.0] * len(prefixes) if weights is None else weights
    if len(weights) != len(prefixes):
        raise ValueError(f"{len(prefixes)} data prefixes but {len(weights)} weights")
    dataset_index, _ = blend_indices(weights, num_samples)
    counts = np.bincount(dataset_index, minlength=len(prefixes))
    datasets = [GPTDataset(p, seq_len, max(1, int(c)), seed=seed, cache_dir=cache_dir)
                for p, c in zip(prefixes, counts)]
    return BlendedDataset(datasets, weights, num_samples)
