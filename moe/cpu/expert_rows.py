"""How the routed experts lay out their rows for the grouped GEMMs, chosen by measured speed per shape.

``ExpertRows`` describes the rows of one experts call: ``counts`` (each local expert's real rows, host ints)
and ``blocks`` (the rows each expert occupies in the GEMM buffers, >= its count). Three layouts:

- ``packed``:  blocks = counts. One GEMM per expert on its exact rows, no copies.
- ``aligned``: each block rounded up to a multiple of ``ALIGN`` rows, the extra rows zero. The GEMM shapes
               then repeat from call to call. This is what bf16 on an AMX CPU needs: oneDNN (torch's bf16
               matmul) JIT-compiles an AMX kernel per new shape, ~7 ms each on the project's Xeon, while the
               GEMM itself takes ~0.5 ms, and exact row counts are new shapes every step (without AMX, on
               AVX-512 BF16, new shapes cost nothing measurable: issue 52).
- ``uniform``: every block the same size, ``ALIGN`` x ceil(max count / ALIGN): the experts' GEMMs become
               one batched ``bmm`` per projection (many small experts: one call instead of 6 E).

Padded layouts cost a copy of the input rows into the blocks and of the output rows back (``pad_rows`` /
``unpad_rows``, both reused workspaces) plus the GEMM work on the padding rows; zero padding rows stay zero
through the SwiGLU experts, so the gradients are exactly those of the packed layout.

``moe.cpu.rows_gemm.choose_layout`` picks one by a fixed rule of the dtype and the CPU's kind (``auto``: packed,
bf16 on an AMX CPU aligned) or by timing the shape
(``measured``); ``ExpertsConfig.row_layout`` fixes it. Memory: the padded rows are activations (the padded
input copy, the gate/up output and the product are saved for backward), so an automatic choice never holds
more than ``max_auto_rows`` (``aligned``'s worst case, N + e(ALIGN - 1)): a ``uniform`` call over skewed counts
(one hot expert: e times N rows) takes ``aligned`` instead. The planner
(``planner.activations_ffn``) counts that bound on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

import torch
from torch import Tensor

from moefold.dense.workspace import workspace


class RowLayout(StrEnum):
    """The rows' layout (module docstring): ``AUTO`` and ``MEASURED`` choose one of the other three per call
    (``moe.cpu.rows_gemm.choose_layout``)."""

    AUTO = "auto"
    MEASURED = "measured"
    PACKED = "packed"
    ALIGNED = "aligned"
    UNIFORM = "uniform"

    @classmethod
    def _missing_(cls, value: object) -> RowLayout:
        raise ValueError(f"expert_row_layout={value!r} (row_layout); valid: {', '.join(cls)}")


ALIGN = 32   # rows: oneDNN's kernels for M (or K) a multiple of 32 cover every block size seen in training


def max_auto_rows(num_rows: int, experts: int) -> int:
    """The most buffer rows a measured (``auto``) layout holds for ``num_rows`` rows over ``experts`` experts."""
    return num_rows + experts * (ALIGN - 1)


@dataclass(frozen=True)
class ExpertRows:
    """The rows of one experts call: ``counts`` real rows per local expert, ``blocks`` rows in the buffers."""

    counts: tuple[int, ...]
    blocks: tuple[int, ...]
    kind: RowLayout = RowLayout.PACKED
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(counts: tuple[int, ...], kind: RowLayout) -> ExpertRows:
        kind = RowLayout(kind)
        if kind is RowLayout.PACKED:
            return ExpertRows(counts, counts, kind)
        if kind is RowLayout.ALIGNED:
            return ExpertRows(counts, tuple(-(-c // ALIGN) * ALIGN for c in counts), kind)
        if kind is RowLayout.UNIFORM:
            block = max(ALIGN, -(-max(counts, default=0) // ALIGN) * ALIGN)
            return ExpertRows(counts, (block,) * len(counts), kind)
        raise ValueError(f"ExpertRows: layout '{kind}' chooses one per call (choose_layout); build one of packed, "
                         "aligned, uniform")

    @property
    def padded(self) -> bool:
        return self.blocks != self.counts

    @property
    def uniform(self) -> bool:
        return self.kind is RowLayout.UNIFORM

    @cached_property
    def num_rows(self) -> int:
        return sum(self.counts)

    @cached_property
    def total(self) -> int:
        """Rows in the GEMM buffers."""
        return sum(self.blocks)

    @cached_property
    def nonempty(self) -> tuple[int, ...]:
        """The experts whose block has rows."""
        return tuple(i for i, b in enumerate(self.blocks) if b)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """First buffer row of each expert's block."""
        out, s = [], 0
        for b in self.blocks:
            out.append(s)
            s += b
        return tuple(out)

    def spans(self) -> list[tuple[int, int, int]]:
        """(expert, first buffer row, real rows) of every expert with rows."""
        return [(i, s, c) for i, (s, c) in enumerate(zip(self.starts, self.counts)) if c]

    def real_rows(self, device: torch.device) -> Tensor:
        """[num_rows] int64: the buffer row of each packed row (built once per device)."""
        key = ("real", device)
        if key not in self._index:
            idx = torch.cat([torch.arange(s, s + c) for _, s, c in self.spans()] or [torch.zeros(0, dtype=torch.long)])
            self._index[key] = idx.to(device)
        return self._index[key]


def _scatter_rows(x_NH: Tensor, rows: ExpertRows) -> Tensor:
    """Packed rows -> the blocks of ``rows`` (padding rows zero), in a workspace: one ``cat`` of each expert's rows
    and its padding (aten's ``index_copy_`` copies element by element on CPU: 9.2 against 2.7 ms for 32,768 rows
    of 512 bf16 over 64 experts)."""
    pad = max(b - c for b, c in zip(rows.blocks, rows.counts))
    zeros = x_NH.new_zeros((pad, *x_NH.shape[1:]))
    pieces: list[Tensor] = []
    for x_i, c, b in zip(x_NH.split(rows.counts), rows.counts, rows.blocks):
        pieces.append(x_i)
        if b > c:
            pieces.append(zeros[: b - c])
    out = workspace(x_NH.device).empty((rows.total, *x_NH.shape[1:]), x_NH.dtype)
    return torch.cat(pieces, out=out)


def _gather_rows(x_PH: Tensor, rows: ExpertRows) -> Tensor:
    """Blocks -> packed rows, in a workspace."""
    out = workspace(x_PH.device).empty((rows.num_rows, *x_PH.shape[1:]), x_PH.dtype)
    return torch.index_select(x_PH, 0, rows.real_rows(x_PH.device), out=out)


class _PadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH: Tensor, rows: ExpertRows) -> Tensor:
        ctx.rows = rows
        return _scatter_rows(x_NH.contiguous(), rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather_rows(grad.contiguous(), ctx.rows), None


class _UnpadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PH: Tensor, rows: ExpertRows) -> Tensor:
        ctx.rows = rows
        return _gather_rows(x_PH.contiguous(), rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _scatter_rows(grad.contiguous(), ctx.rows), None


def pad_rows(x_NH: Tensor, rows: ExpertRows) -> Tensor:
    """[N, ...] expert-major rows -> [rows.total, ...] in ``rows``' blocks (zero padding); identity when packed."""
    return _PadRows.apply(x_NH, rows) if rows.padded else x_NH


def unpad_rows(x_PH: Tensor, rows: ExpertRows) -> Tensor:
    """The inverse of ``pad_rows`` (padding rows dropped; their gradient is zero)."""
    return _UnpadRows.apply(x_PH, rows) if rows.padded else x_PH


__all__ = ["ALIGN", "ExpertRows", "RowLayout", "max_auto_rows", "pad_rows", "unpad_rows"]
