"""The routed experts' grouped GEMM on a CPU: rows laid out for the CPU's GEMMs, outputs in reused buffers.

``rows_linear(x, w, counts_e, rows, slot)`` computes ``out[rows_i] = x[rows_i] @ w[i]^T`` for every local expert i
(``w [e, M, K]``) over the blocks of ``rows`` (``moe.cpu.expert_rows.ExpertRows``, host counts; ``x`` already in its
blocks), differentiable in ``x`` and ``w``:

- forward and input gradient: one ``torch.mm`` per expert block, or one ``torch.bmm`` for the ``uniform`` layout,
  each writing its slice of an output from the workspace pool (``dense.workspace``: no fresh, page-faulted
  buffer per call);
- weight gradient ``dw[i] = dy[rows_i]^T x[rows_i]``: with a main-grad ``slot`` (gradient-accumulation fusion,
  ``dense.grad_accumulation``) written straight into the parameter's main-grad buffer, the step's first
  micro-batch as a plain product, later ones accumulated (``addmm_`` / ``baddbmm_``); without a slot returned to
  autograd. Experts without rows get a zero gradient.

The products are the ones autograd's ``grouped_mm`` backward computes (``x_i^T dy_i`` into the transposed
buffer), so packed-layout results are bitwise those of the device-count path (``moe.grouped_linear``) on CPU.
Local: nothing crosses ranks.

``choose_layout`` decides the row layout of a call (``moe.cpu.expert_rows``): by a fixed rule of the dtype and the
CPU's kind (AMX or not) that follows the measurements (``auto``, reproducible; ``describe_auto_layout`` states it
at start-up), or by timing its shape (``measured``).
"""

from __future__ import annotations

import random
import time

import torch
from torch import Tensor

from moefold.dense.grad_accumulation import MainGradSlot, mm_into, widen_into
from moefold.dense.workspace import workspace
from moefold.moe.cpu.expert_rows import ExpertRows, RowLayout, max_auto_rows, pad_rows
from moefold.moe.grouped_linear import weight_grad


def _split(t: Tensor, rows: ExpertRows, dim: int = 0) -> tuple[Tensor, ...]:
    """Every expert's block of ``t`` (its ``rows.total`` rows along ``dim``) as views, from one ``split``: no
    Python-level slicing per expert (256 experts: 1,500 GEMMs a step, each with its views)."""
    return t.split(rows.blocks, dim)


def grouped_forward(x_PK: Tensor, w_eMK: Tensor, rows: ExpertRows) -> Tensor:
    """[rows.total, M]: each block times its expert's ``w[i]^T``, into a workspace."""
    e, M, K = w_eMK.shape
    out = workspace(x_PK.device).empty((rows.total, M), x_PK.dtype)
    if rows.uniform and rows.total:
        torch.bmm(x_PK.view(e, -1, K), w_eMK.transpose(1, 2), out=out.view(e, -1, M))
        return out
    xs, outs, wts = _split(x_PK, rows), _split(out, rows), w_eMK.transpose(1, 2).unbind(0)
    for i in rows.nonempty:
        torch.mm(xs[i], wts[i], out=outs[i])
    return out


def grouped_input_grad(dy_PM: Tensor, w_eMK: Tensor, rows: ExpertRows) -> Tensor:
    """[rows.total, K]: each block of ``dy`` times its expert's ``w[i]``, into a workspace."""
    e, M, K = w_eMK.shape
    out = workspace(dy_PM.device).empty((rows.total, K), dy_PM.dtype)
    if rows.uniform and rows.total:
        torch.bmm(dy_PM.view(e, -1, M), w_eMK, out=out.view(e, -1, K))
        return out
    dys, outs, ws = _split(dy_PM, rows), _split(out, rows), w_eMK.unbind(0)
    for i in rows.nonempty:
        torch.mm(dys[i], ws[i], out=outs[i])
    return out


def grouped_weight_grad(x_PK: Tensor, dy_PM: Tensor, rows: ExpertRows, target_eMK: Tensor, accumulate: bool) -> None:
    """``target[i] = dy_i^T x_i`` (or ``+=`` with ``accumulate``) for every expert; zero for one without rows."""
    e, M, K = target_eMK.shape
    if rows.uniform and rows.total and target_eMK.is_contiguous():
        # dy^T x straight into the [e, M, K] target: with a transposed output oneDNN has no bf16 batched kernel
        # and runs its reference loop (thousands of times slower: 7.7 s instead of 1.5 ms for 16 x 128 x 256 x 512)
        x3, dy3 = x_PK.view(e, -1, K), dy_PM.view(e, -1, M).transpose(1, 2)
        if accumulate:
            target_eMK.baddbmm_(dy3, x3)
        else:
            torch.bmm(dy3, x3, out=target_eMK)
        return
    if not accumulate:
        for i, b in enumerate(rows.blocks):
            if b == 0:
                target_eMK[i].zero_()
    # x_i^T dy_i into the transposed target (autograd's mm backward): x^T split along its columns
    xts, dys, targets = _split(x_PK.t(), rows, 1), _split(dy_PM, rows), target_eMK.transpose(1, 2).unbind(0)
    for i in rows.nonempty:
        mm_into(targets[i], xts[i], dys[i], accumulate)


def _weight_grad_into(x: Tensor, dy: Tensor, rows: ExpertRows, target: Tensor, accumulate: bool) -> None:
    if target.dtype != x.dtype and target.device.type != "cuda":   # CPU has no mixed-dtype GEMM: a bf16 workspace
        tmp = workspace(x.device).empty(target.shape, x.dtype)
        grouped_weight_grad(x, dy, rows, tmp, False)
        widen_into(target, tmp, accumulate)
        return
    grouped_weight_grad(x, dy, rows, target, accumulate)


class _RowsLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts_e: Tensor, rows: ExpertRows, slot: MainGradSlot | None) -> Tensor:
        ctx.save_for_backward(x, w, counts_e)
        ctx.rows, ctx.slot = rows, slot
        return grouped_forward(x, w, rows)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, _ = ctx.saved_tensors
        rows = ctx.rows
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_input_grad(dy, w, rows)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(ctx.slot, w, lambda target, accumulate: _weight_grad_into(x, dy, rows, target,
                                                                                         accumulate))
        return dx, dw, None, None, None


def rows_linear(x_PK: Tensor, w_eMK: Tensor, counts_e: Tensor, rows: ExpertRows,
                slot: MainGradSlot | None = None) -> Tensor:
    """Per-expert ``x @ w[i]^T`` over ``rows``' blocks (module docstring); ``slot``: ``w``'s parameter's main-grad
    slot."""
    if x_PK.dtype != w_eMK.dtype:
        raise ValueError(f"rows_linear: x is {x_PK.dtype} but w is {w_eMK.dtype}")
    if x_PK.shape[0] != rows.total:
        raise ValueError(f"rows_linear: x has {x_PK.shape[0]} rows, the layout {rows.total}")
    return _RowsLinear.apply(x_PK, w_eMK, counts_e, rows, slot)


# ------------------------------------------------------------------------------------------------ the choice
_CHOSEN: dict[tuple, RowLayout] = {}
MIN_GAIN = 0.05   # a padded layout must beat packed by this fraction to be chosen


def _shape_key(device: torch.device, dtype: torch.dtype, counts: tuple[int, ...], K: int, M: int) -> tuple:
    mean = max(1, sum(counts) // max(1, len(counts)))
    return device.type, dtype, len(counts), K, M, 1 << (mean.bit_length() - 1)


def _perturbed(counts: tuple[int, ...], rng: random.Random) -> tuple[int, ...]:
    """The same total over the same experts with up to ~10% of each expert's rows moved to the next one: new
    exact shapes, as the next step's routing gives."""
    out = list(counts)
    for i in range(len(out)):
        moved = rng.randint(0, max(1, out[i] // 10)) if out[i] else 0
        out[i] -= moved
        out[(i + 1) % len(out)] += moved
    return tuple(out)


def _time_layout(kind: RowLayout, counts: tuple[int, ...], x_NK: Tensor, w_eMK: Tensor, tries: int,
                 rng: random.Random) -> float:
    """Best seconds of the first projection's forward + weight-gradient GEMMs (with the padding copy) in
    ``kind``, each try on new row counts (the first try, on the real ones, warms up and is not counted)."""
    best = float("inf")
    grad = workspace(x_NK.device).empty(w_eMK.shape, w_eMK.dtype)
    for t in range(tries + 1):
        rows = ExpertRows.build(counts if t == 0 else _perturbed(counts, rng), kind)
        t0 = time.perf_counter()
        xp = pad_rows(x_NK, rows)
        grouped_weight_grad(xp, grouped_forward(xp, w_eMK, rows), rows, grad, False)
        if t > 0:
            best = min(best, time.perf_counter() - t0)
    return best


def amx_tiles() -> bool:
    """The CPU has AMX tiles (oneDNN's bf16 GEMMs then run AMX kernels compiled per GEMM shape)."""
    return bool(torch.cpu._is_amx_tile_supported())


def _rule(dtype: torch.dtype) -> RowLayout:
    """``auto``'s layout before the memory cap, by the dtype and the CPU's kind:

    - fp32 (and wider): ``packed``: fp32 GEMMs take any row count at full speed;
    - bf16 / fp16 on a CPU with AMX: ``aligned``: oneDNN compiles an AMX kernel per new GEMM shape (~6-7 ms each
      on the Intel Xeon, against ~1 ms for the GEMM), and exact row counts are new shapes every step; blocks of
      whole 32-row tiles repeat their shapes. With a new routing every step (``benchmarks/row_layouts.py``, as
      training runs) the layer ran packed 225 / 363 / 460 ms, uniform 223-227 / 302 / 475-483, aligned
      211-220 / 302 / 475 at E16 / E64 / E256 (after the first steps' compilations; packed only catches up at
      E256, whose few distinct row counts fill the kernel cache): aligned is level with or ahead of uniform,
      and pads less (``max_auto_rows`` bounds both);
    - bf16 / fp16 without AMX (AVX-512 BF16, AVX2): ``packed``: a new row count costs no compilation there
      (per-expert GEMMs over fresh random counts each call as fast as over repeated ones, on the AMD EPYC), and
      padding to the largest block adds GEMM work (uniform at E256 k8: blocks of ~192 rows for a mean of 128)
      plus the padding copies: the whole bf16 layer ran 5-16% faster packed than uniform in 11 of 12 (run,
      shape) pairs of four runs, the twelfth (E16) within 2% (``benchmarks/RESULTS.md``, issue 52).

    A rule of the machine, never a timing: every rank of a run (one CPU kind) takes the same layout in every
    run, so a run and its resumption are bitwise the same."""
    if dtype.itemsize >= 4:
        return RowLayout.PACKED
    return RowLayout.ALIGNED if amx_tiles() else RowLayout.PACKED


def describe_auto_layout() -> str:
    """One line for start-up output: what ``auto`` lays out on this CPU, and why."""
    low = _rule(torch.bfloat16)
    why = "AMX: kernels compiled per GEMM shape" if low is RowLayout.ALIGNED else "no AMX: any row count runs at speed"
    return f"expert rows (auto): fp32 {_rule(torch.float32)}, bf16/fp16 {low} ({why})"


def choose_layout(counts: tuple[int, ...], x_NK: Tensor, w_eMK: Tensor,
                  forced: RowLayout = RowLayout.AUTO) -> ExpertRows:
    """The rows of this call. ``forced`` (``ExpertsConfig.row_layout``):

    - ``auto``: ``_rule``'s layout for the dtype and the CPU's kind: the same on every rank and in every run, so a
      run and its resumption are bitwise the same (the layouts' GEMMs differ in the last bits);
    - ``measured``: the fastest layout timed for the call's shape (device, dtype, experts, K, M, rows per
      expert rounded down to a power of two), once per process on the real weights, a padded layout kept only
      when >= 5% faster than packed: for a machine where the rule is wrong, at the price of run-to-run bits;
    - ``packed`` / ``aligned`` / ``uniform``: that layout.

    Packed off the CPU and for one expert. An automatic (``auto``/``measured``) ``uniform`` whose blocks would
    exceed ``max_auto_rows`` for these counts (skewed routing) gives ``aligned`` rows for this call: the padding
    is activation memory, bounded so the planner can count it."""
    forced = RowLayout(forced)
    if forced not in (RowLayout.AUTO, RowLayout.MEASURED):
        return ExpertRows.build(counts, forced)
    if x_NK.device.type != "cpu" or len(counts) < 2 or sum(counts) == 0:
        return ExpertRows.build(counts, RowLayout.PACKED)
    kind = _rule(x_NK.dtype) if forced is RowLayout.AUTO else _measured(counts, x_NK, w_eMK)
    rows = ExpertRows.build(counts, kind)
    if rows.total > max_auto_rows(rows.num_rows, len(counts)):
        rows = ExpertRows.build(counts, RowLayout.ALIGNED)
    return rows


def _measured(counts: tuple[int, ...], x_NK: Tensor, w_eMK: Tensor) -> RowLayout:
    key = _shape_key(x_NK.device, x_NK.dtype, counts, x_NK.shape[1], w_eMK.shape[1])
    kind = _CHOSEN.get(key)
    if kind is None:
        rng = random.Random(0)
        with torch.no_grad():
            times = {k: _time_layout(k, counts, x_NK.detach(), w_eMK.detach(), 2, rng)
                     for k in (RowLayout.PACKED, RowLayout.ALIGNED, RowLayout.UNIFORM)}
        kind = min(times, key=times.get)
        if kind is not RowLayout.PACKED and times[kind] > (1 - MIN_GAIN) * times[RowLayout.PACKED]:
            kind = RowLayout.PACKED
        _CHOSEN[key] = kind
    return kind


def chosen_layouts() -> dict[tuple, RowLayout]:
    """{(device, dtype, experts, K, M, rows per expert rounded down to a power of two): layout} measured so far
    (``measured`` layouts)."""
    return dict(_CHOSEN)


__all__ = ["amx_tiles", "choose_layout", "chosen_layouts", "describe_auto_layout", "grouped_forward",
           "grouped_input_grad", "grouped_weight_grad", "rows_linear"]
