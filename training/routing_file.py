"""The routing replay file: per MoE layer, per token, the top-k global expert ids one forward chose.

One safetensors file::

    layers.<i>.expert_ids   [N, S, K] integers (written as the narrowest of uint8, int16, int32 that holds E - 1;
                            read as any integer dtype): MoE layer i (its global index; MTP depth k is
                            num_layers + k - 1), sample n (the run's sample order: the dataset's sample index),
                            position s (0..S-1, the whole sequence whatever the layout), the token's K global expert
                            ids in [0, E), distinct, in the router's top-k order, before any capacity drop
    metadata                format = "moefold.routing_replay", version = "1", num_experts = "E", topk = "K"

Every layer holds the same N and S. The ids are the layout's own business nowhere: a recording made at one layout
(tp, ep, etp, pp, dp, cp) replays at any other (``training.routing_replay``). Written atomically (a temporary file
renamed over the target); read lazily, only the samples a step needs (``RoutingFile.read``), each read checked: an
unreadable file, a wrong name, shape, dtype or metadata, an id outside [0, E) or a token choosing one expert twice
is a ``ValueError`` of one line naming the file. Nothing here crosses ranks.
"""

from __future__ import annotations

import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

FORMAT = "moefold.routing_replay"
VERSION = "1"
_NAME = re.compile(r"layers\.(\d+)\.expert_ids")
_INT_DTYPES = ("I16", "I32", "I64", "U8", "I8", "U16")


def tensor_name(layer: int) -> str:
    """The file's name of layer ``layer``'s ids."""
    return f"layers.{layer}.expert_ids"


def storage_dtype(num_experts: int) -> torch.dtype:
    """The file's id dtype: the narrowest of uint8, int16, int32 that holds ``num_experts - 1`` (DeepSeek-V3's 256
    experts: one byte per id)."""
    for dtype in (torch.uint8, torch.int16):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int32


def check_ids(ids: Tensor, num_experts: int, where: str) -> Tensor:
    """``ids`` (integer ``[..., K]``) as int64, or ValueError naming ``where`` and the first bad token: an id outside
    [0, num_experts) or one expert twice in a token's K."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{where}: expert ids are {ids.dtype}, expected an integer dtype")
    ids = ids.to(torch.int64)
    if ids.numel() == 0:
        return ids
    bad = (ids < 0) | (ids >= num_experts)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{where}: expert id {int(ids[at])} at {list(at)} is outside [0, num_experts={num_experts})")
    ordered = ids.sort(dim=-1).values
    twice = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if twice.any():
        at = tuple(int(i) for i in twice.nonzero()[0])
        raise ValueError(f"{where}: token {list(at)} chooses one expert twice: {ids[at].tolist()}")
    return ids


@dataclass(frozen=True)
class RoutingRecording:
    """The ids of one recorded forward, by layer (``ids[i]``: int64 ``[N, S, K]`` on the host), and the model's
    expert count. Checked once here: every layer the same N, S, K; every id in [0, E), distinct per token."""

    num_experts: int
    ids: dict[int, Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"RoutingRecording: num_experts={self.num_experts!r} must be a positive integer")
        if not self.ids:
            raise ValueError("RoutingRecording: no layers")
        shapes = {layer: tuple(t.shape) for layer, t in self.ids.items()}
        first = next(iter(shapes.values()))
        if len(first) != 3 or any(s != first for s in shapes.values()):
            raise ValueError(f"RoutingRecording: every layer's ids must be one [N, S, K] shape, got {shapes}")
        checked = {int(layer): check_ids(t.detach().cpu(), self.num_experts, f"RoutingRecording layer {layer}")
                   for layer, t in sorted(self.ids.items())}
        object.__setattr__(self, "ids", checked)

    @property
    def layers(self) -> list[int]:
        return list(self.ids)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(N samples, S positions, K)."""
        n, s, k = next(iter(self.ids.values())).shape
        return n, s, k

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file (format above) atomically; returns its path."""
        path = Path(path)
        k = self.shape[2]
        store = storage_dtype(self.num_experts)
        tensors = {tensor_name(layer): t.to(store).contiguous() for layer, t in self.ids.items()}
        meta = {"format": FORMAT, "version": VERSION, "num_experts": str(self.num_experts), "topk": str(k)}
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


class RoutingFile:
    """A routing replay file opened for reading (headers checked here; each ``read`` checks its ids). Use as a context
    manager, or ``close()``.

    ``num_experts``/``topk``/``layers``/``seq_length``: what the model needs, each checked against the file when
    given (None: whatever the file holds)."""

    def __init__(self, path: str | os.PathLike, *, num_experts: int | None = None, topk: int | None = None,
                 layers: list[int] | None = None, seq_length: int | None = None) -> None:
        self.path = Path(path)
        self._stack = ExitStack()
        try:
            self._file = self._stack.enter_context(safe_open(str(self.path), framework="pt"))
            meta = self._file.metadata() or {}
            names = list(self._file.keys())
        except Exception as exc:   # safetensors' SafetensorError (not an OSError/ValueError), or an OSError
            raise self._error(f"not a readable safetensors file ({type(exc).__name__}: "
                              f"{(str(exc).strip().splitlines() or [''])[0]})") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise self._error(f"metadata format={meta.get('format')!r} version={meta.get('version')!r}, expected "
                              f"format={FORMAT!r} version={VERSION!r}")
        self.num_experts, self.topk = self._meta_int(meta, "num_experts"), self._meta_int(meta, "topk")
        self.layers: list[int] = []
        for name in names:
            match = _NAME.fullmatch(name)
            if match is None:
                raise self._error(f"tensor {name!r} is not named layers.<i>.expert_ids")
            self.layers.append(int(match.group(1)))
        self.layers.sort()
        if not self.layers:
            raise self._error("holds no layers")
        shapes = {i: tuple(self._file.get_slice(tensor_name(i)).get_shape()) for i in self.layers}
        dtypes = {i: str(self._file.get_slice(tensor_name(i)).get_dtype()) for i in self.layers}
        first = shapes[self.layers[0]]
        if len(first) != 3 or first[2] != self.topk or any(s != first for s in shapes.values()):
            raise self._error(f"every layer must hold [N, S, K={self.topk}] ids, one shape for all; got {shapes}")
        bad = {i: d for i, d in dtypes.items() if d not in _INT_DTYPES}
        if bad:
            raise self._error(f"ids must be integers; layers {bad}")
        self.num_samples, self.seq_length = first[0], first[1]
        for what, want, have in (("num_experts", num_experts, self.num_experts), ("topk", topk, self.topk),
                                 ("seq_length", seq_length, self.seq_length)):
            if want is not None and want != have:
                raise self._error(f"{what}={have}, the model (run) has {want}")
        if layers is not None and sorted(layers) != self.layers:
            raise self._error(f"holds MoE layers {self.layers}, the model has {sorted(layers)}")

    def read(self, start: int, stop: int) -> dict[int, Tensor]:
        """Samples ``[start, stop)`` of every layer: {layer: int64 ``[stop - start, S, K]``}, checked."""
        if not 0 <= start <= stop <= self.num_samples:
            raise self._error(f"samples [{start}, {stop}) requested, it holds {self.num_samples}")
        return {i: check_ids(self._file.get_slice(tensor_name(i))[start:stop], self.num_experts,
                             f"{self.path} layer {i} samples [{start}, {stop})") for i in self.layers}

    def recording(self) -> RoutingRecording:
        """The whole file."""
        return RoutingRecording(self.num_experts, self.read(0, self.num_samples))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> RoutingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _meta_int(self, meta: dict[str, str], key: str) -> int:
        value = meta.get(key, "")
        if not value.isdigit() or int(value) < 1:
            raise self._error(f"metadata {key}={value!r} must be a positive integer")
        return int(value)

    def _error(self, what: str) -> ValueError:
        return ValueError(f"routing replay file {self.path}: {what}")


def load_routing(path: str | os.PathLike) -> RoutingRecording:
    """The whole file at ``path`` as a ``RoutingRecording`` (ValueError of one line when it is malformed)."""
    with RoutingFile(path) as f:
        return f.recording()


__all__ = ["FORMAT", "VERSION", "RoutingFile", "RoutingRecording", "check_ids", "load_routing", "storage_dtype",
           "tensor_name"]
