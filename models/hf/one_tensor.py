"""A moefold parameter stored as one HF tensor in another row order.

``layout`` is any of the row-order converters (``models.hf.qwen3_next.ConvLayout``: DeltaNet's convolution;
``dense.mamba2_layout.GroupMajor``: Mamba-2's ``in_proj`` and convolution), each with ``hf_shape`` / ``to_hf`` /
``from_hf``; ``OneTensor`` gives it the interface of the importer's and exporter's layouts (``hf_parts``, lists
of tensors), as ``models.hf.qwen3_5_moe.SplitLayout`` has for entries stored as several tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class OneTensor:
    """A moefold entry stored as the one HF tensor ``hf_name`` in ``layout``'s row order."""

    hf_name: str
    layout: Any   # ConvLayout | GroupMajor: hf_shape(shape), to_hf(full), from_hf(hf, shape)

    def hf_parts(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        return [(self.hf_name, self.layout.hf_shape(shape))]

    def to_hf(self, full: Tensor) -> list[Tensor]:
        return [self.layout.to_hf(full)]

    def from_hf(self, tensors: list[Tensor], shape: tuple[int, ...]) -> Tensor:
        return self.layout.from_hf(tensors[0], shape)


__all__ = ["OneTensor"]
