"""The three layouts Megatron-Core stores a GPTModel's layers in, read through one per-layer view.

``models.megatron.mapping`` names every tensor per layer, with the experts of a layer stacked:
``decoder.layers.3.mlp.experts.experts.linear_fc1.weight [E, 2F, H]``. What ``TransformerBlock.sharded_state_dict``
(megatron-core 0.16.1) writes depends on the model and on the ``content_metadata`` of the save:

- per layer (``non_homogeneous_layers``: a list-valued or > 1 ``moe_layer_freq``, or the metadata's flag):
  ``decoder.layers.<i>.<name>``, the per-layer view itself;
- stacked (homogeneous layers: ``--moe-layer-freq 1``, Megatron-LM's default, every layer alike): one tensor per
  name with a leading layer axis, ``decoder.layers.<name> [L, ...]`` (MTP layers are never stacked);
- singleton local shards (``singleton_local_shards``): per layer, each expert its own tensors
  ``...mlp.experts.experts.<e>.linear_fc1.weight_w / _v / linear_fc2.weight``, and every GLU projection's gate
  and up halves apart (``linear_fc1.weight_w [F, H]`` and ``linear_fc1.weight_v``).

``MegatronTensors(reader)`` answers ``key in view``, ``view.shape(key)`` and ``view.read([(key, box), ...])``
for per-layer keys, reading only the stored regions under each box (one pass over the files), and
``view.stored(key)`` says which stored tensors a key is made of (to find checkpoint tensors nothing reads).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.models.megatron.dcp_io import Box, DcpReader

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERTS = ".mlp.experts.experts."
_GLU = ("linear_fc1.weight", "linear_fc1.bias")   # a GLU projection's gate and up halves (and its bias's)


@dataclass(frozen=True)
class _Leaf:
    key: str           # a stored tensor
    box: Box           # the region of it to read
    squeeze: bool      # drop the leading (layer) axis of length 1


@dataclass(frozen=True)
class _Join:
    op: str            # "cat" (along dim 0) or "stack"
    parts: tuple


class MegatronTensors:
    """A per-layer view of a Megatron checkpoint's tensors, whichever of the three layouts stores them."""

    def __init__(self, reader: DcpReader) -> None:
        self.reader = reader

    def _stacked(self, key: str) -> tuple[str, int] | None:
        m = _LAYER.fullmatch(key)
        if m and f"decoder.layers.{m[2]}" in self.reader:
            return f"decoder.layers.{m[2]}", int(m[1])
        return None

    def _experts(self, key: str) -> tuple[str, str, int] | None:
        """(per-expert prefix, projection, experts) of a singleton experts layout."""
        if _EXPERTS not in key:
            return None
        head, tail = key.split(_EXPERTS, 1)
        if re.match(r"\d+\.", tail):   # already one expert's key
            return None
        count = 0
        while f"{head}{_EXPERTS}{count}.{tail}" in self:
            count += 1
        return (f"{head}{_EXPERTS}", tail, count) if count else None

    def __contains__(self, key: str) -> bool:
        return (key in self.reader or self._stacked(key) is not None
                or (key.endswith(_GLU) and f"{key}_w" in self.reader and f"{key}_v" in self.reader)
                or self._experts(key) is not None)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self.reader:
            return self.reader.shape(key)
        if (stacked := self._stacked(key)) is not None:
            return self.reader.shape(stacked[0])[1:]
        if key.endswith(_GLU) and f"{key}_w" in self.reader:
            rows, *rest = self.reader.shape(f"{key}_w")
            return (2 * rows, *rest)
        head, tail, count = self._experts(key)
        return (count, *self.shape(f"{head}0.{tail}"))

    def layers_stored(self, key: str) -> int | None:
        """The leading layer axis of the stacked tensor holding ``key`` (None: not stacked)."""
        stacked = self._stacked(key) if key not in self.reader else None
        return None if stacked is None else self.reader.shape(stacked[0])[0]

    def _plan(self, key: str, box: Box):
        if key in self.reader:
            return _Leaf(key, box, False)
        if (stacked := self._stacked(key)) is not None:
            name, layer = stacked
            return _Leaf(name, (slice(layer, layer + 1), *box), True)
        if key.endswith(_GLU) and f"{key}_w" in self.reader:   # [2F, ...]: gate rows (_w), then up rows (_v)
            F = self.reader.shape(f"{key}_w")[0]
            parts = []
            for g, half in enumerate(("_w", "_v")):
                lo, hi = max(box[0].start - g * F, 0), min(box[0].stop - g * F, F)
                if lo < hi:
                    parts.append(_Leaf(key + half, (slice(lo, hi), *box[1:]), False))
            return parts[0] if len(parts) == 1 else _Join("cat", tuple(parts))
        head, tail, _ = self._experts(key)
        return _Join("stack", tuple(self._plan(f"{head}{e}.{tail}", box[1:])
                                    for e in range(box[0].start, box[0].stop)))

    def stored(self, key: str) -> list[str]:
        """The stored tensors ``key`` reads from (all of them, for any box)."""
        out: list[str] = []

        def walk(node) -> None:
            if isinstance(node, _Leaf):
                out.append(node.key)
            else:
                for part in node.parts:
                    walk(part)
        walk(self._plan(key, tuple(slice(0, n) for n in self.shape(key))))
        return out

    def read(self, requests: list[tuple[str, Box]]) -> list[Tensor]:
        """The ``box`` of per-layer tensor ``key`` for each request, in one pass over the stored chunks."""
        plans = [self._plan(key, box) for key, box in requests]
        leaves: list[_Leaf] = []

        def collect(node) -> None:
            if isinstance(node, _Leaf):
                leaves.append(node)
            else:
                for part in node.parts:
                    collect(part)
        for plan in plans:
            collect(plan)
        values = iter(self.reader.read_boxes([(leaf.key, leaf.box) for leaf in leaves]))

        def build(node) -> Tensor:
            if isinstance(node, _Leaf):
                value = next(values)
                return value[0] if node.squeeze else value
            parts = [build(p) for p in node.parts]
            return torch.cat(parts) if node.op == "cat" else torch.stack(parts)
        return [build(plan) for plan in plans]
