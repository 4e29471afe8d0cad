"""Micro-batches for one data-parallel rank, resumable at an exact global sample.

The run consumes the dataset in order: global micro-step ``k`` (counted from ``consumed_samples``)
takes samples ``[c + k*m*D, c + (k+1)*m*D)`` (``m`` micro-batch size, ``D`` dp size), and rank ``r``
gets the slice ``[c + k*m*D + r*m, c + k*m*D + (r+1)*m)``. A global batch of ``G`` samples is
therefore the same set of samples at every dp size, and the position is one number,
``consumed_samples``, which a checkpoint stores and a resumed run (at any layout) continues from.
``batch_to_device`` sends a micro-batch to the rank's device without a host wait.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:   # torch is imported where a batch is made (the data layer loads without it)
    import torch
    from torch import Tensor


class Samples(Protocol):
    """Indexable training samples of ``seq_len + 1`` token ids each (a ``GPTDataset``, a
    ``BlendedDataset`` or a ``[num_samples, seq_len + 1]`` array)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class MicroBatchSampler:
    """Yields lists of ``micro_batch_size`` global sample indices for rank ``dp_rank`` of ``dp_size``.

    ``consumed_samples`` (global, all ranks together) advances by ``micro_batch_size * dp_size`` as
    each micro-batch is handed out; iteration stops when a whole micro-step no longer fits.
    """

    def __init__(self, total_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        if total_samples < micro_batch_size * dp_size:
            raise ValueError(f"the dataset's {total_samples} samples do not fill one micro-step of "
                             f"micro_batch_size * dp_size = {micro_batch_size * dp_size}")
        self.total_samples, self.micro_batch_size = total_samples, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = 0
        self.load_state_dict({"consumed_samples": consumed_samples})

    @property
    def step_samples(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches left."""
        return (self.total_samples - self.consumed_samples) // self.step_samples

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples + self.step_samples <= self.total_samples:
            start = self.consumed_samples + self.dp_rank * self.micro_batch_size
            self.consumed_samples += self.step_samples
            yield list(range(start, start + self.micro_batch_size))

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = int(state["consumed_samples"])
        if not 0 <= consumed <= self.total_samples:
            raise ValueError(f"consumed_samples={consumed} lies outside the dataset's [0, {self.total_samples}]")
        self.consumed_samples = consumed


class MicroBatchLoader:
    """This rank's micro-batches of ``dataset`` as int64 [micro_batch_size, seq_len + 1] tensors
    (inputs are ``[:, :-1]``, labels ``[:, 1:]``), or numpy arrays with ``as_numpy=True``.

    Nothing crosses ranks: every rank computes its own indices from the shared ``consumed_samples``.
    """

    def __init__(self, dataset: Samples, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, as_numpy: bool = False) -> None:
        self.dataset = dataset
        self.sampler = MicroBatchSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples)
        self.as_numpy = as_numpy

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator:
        for indices in self.sampler:
            batch = np.stack([self.dataset[i] for i in indices])
            if self.as_numpy:
                yield batch
            else:
                import torch

                yield torch.from_numpy(batch)

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def batch_to_device(batch: Tensor, device: torch.device) -> Tensor:
    """A host batch on ``device`` without making the host wait: on CUDA it is copied into pinned (page-locked)
    memory first and sent with ``non_blocking=True`` (a copy from pageable memory blocks the host until it is
    done); torch's caching host allocator keeps the pinned block until the copy has run. A no-op on its device."""
    if batch.device == device:
        return batch
    if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)
