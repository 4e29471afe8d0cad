"""``CpuRowsGemm``: the ``grouped_mm`` backend of experts built on a CPU, its rows laid out for the CPU's GEMMs.

On a CPU tensor (``moe.cpu.shortcuts.takes_cpu_shortcut``: not inside ``gpu_code_paths()``) a call reads its
counts on the host (free there), lays the rows out (``moe.cpu.rows_gemm.choose_layout``: exact, aligned to 32 rows,
or one ``bmm`` block per expert; ``ExpertsConfig.row_layout`` fixes it; packed when the experts add biases per row)
and runs both projections on the laid-out rows (``moe.cpu.rows_gemm.rows_linear``: outputs in reused workspaces,
weight gradients into main-grad with gradient-accumulation fusion). Elsewhere (a GPU tensor, or the GPU's code
paths a host-sync count runs) it is ``GroupedMMGemm``: the device counts, no host read. The values of the two
paths are the same GEMMs' (bitwise for packed rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from moefold.dense.grad_accumulation import MainGradSlot
from moefold.moe.cpu.expert_rows import ExpertRows, RowLayout, pad_rows, unpad_rows
from moefold.moe.cpu.rows_gemm import choose_layout, rows_linear
from moefold.moe.cpu.shortcuts import takes_cpu_shortcut
from moefold.moe.expert_gemm import GemmCall, GroupedMMGemm, Projection


@dataclass(frozen=True)
class RowsCall(GemmCall):
    """A call on laid-out rows: ``rows`` (None: the device-count path)."""

    rows: ExpertRows | None = None


class CpuRowsGemm(GroupedMMGemm):
    """``grouped_mm`` experts on a CPU (module docstring); ``row_layout``: ``ExpertsConfig.row_layout``."""

    def __init__(self, row_layout: RowLayout = RowLayout.AUTO) -> None:
        self.row_layout = RowLayout(row_layout)

    def host_counts(self, x_NH: Tensor, counts_e: Tensor, counts_host: Sequence[int] | None,
                    ) -> tuple[int, ...] | None:
        if counts_host is None and takes_cpu_shortcut(x_NH):   # free on a CPU (the GPU path never reads them)
            counts_host = counts_e.tolist()
        return super().host_counts(x_NH, counts_e, counts_host)

    def enter(self, x_NH: Tensor, counts_e: Tensor, host: tuple[int, ...] | None, w13_eMK: Tensor,
              packed: bool) -> tuple[Tensor, RowsCall]:
        if host is None or not takes_cpu_shortcut(x_NH):
            return x_NH, RowsCall(counts_e, host)
        rows = choose_layout(host, x_NH, w13_eMK, RowLayout.PACKED if packed else self.row_layout)
        return pad_rows(x_NH, rows), RowsCall(counts_e, host, rows)

    def enter_probs(self, probs_N: Tensor | None, call: GemmCall) -> Tensor | None:
        if probs_N is None or not isinstance(call, RowsCall) or call.rows is None:
            return probs_N
        return pad_rows(probs_N, call.rows)   # zero for the padding rows, as their inputs

    def project(self, which: Projection, x: Tensor, w_eMK: Tensor, call: GemmCall,
                slot: MainGradSlot | None) -> Tensor:
        if not isinstance(call, RowsCall) or call.rows is None:
            return super().project(which, x, w_eMK, call, slot)
        return rows_linear(x, w_eMK, call.counts_e, call.rows, slot)

    def leave(self, out: Tensor, call: GemmCall) -> Tensor:
        return out if not isinstance(call, RowsCall) or call.rows is None else unpad_rows(out, call.rows)


__all__ = ["CpuRowsGemm", "RowsCall"]
