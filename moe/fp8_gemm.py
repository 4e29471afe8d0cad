"""FP8 grouped expert GEMMs (``--fp8-backend torchao``): ``Float8GroupedGemm``, the float8 ``grouped_gemm``.

For every local expert i over its block of rows (expert-major, as ``moe.gemm``)::

    forward  y[rows_i]  = q(x[rows_i]) @ q(w[i])^T         x [N, K], w [e, M, K] -> y [N, M]
    backward dx[rows_i] = q(dy[rows_i]) @ q(w[i])           dw[i] = q(dy[rows_i])^T @ q(x[rows_i])

with each operand cast by torchao's recipe (``precision.fp8_cast``; the gradient in e5m2 with hybrid):

- ``tensorwise``: one scale per expert: the amax of that expert's rows of x (or dy), of w[i];
- ``rowwise``: one scale per row along each GEMM's contraction dim: per token row of x (over K) and of
  dy (over M), per row of w[i] (over K) and per column (over M, for dx), and for dw per (expert,
  channel) over that expert's rows.

Scales and layouts. Scales are per expert, never per tensor, so an expert's cast does not depend on
which other experts share its rank. Dims split over etp (the FFN rows of w13 and dy of the first GEMM,
the FFN columns of w2 and x of the second) reduce their amax over the etp group. Scales over an
expert's token rows (tensorwise x and dy, dw's per-channel scales) reduce over ``token_group``
(``ParallelDims.expert_token_group``): the ranks holding the same experts that split one micro-batch's
tokens, e.g. the tp ranks at tp2 x ep1 where each runs all experts on its sequence shard. So an
expert's scales cover every row of the micro-batch routed to it, whatever the layout. (Expert
parallelism does put rows of several data-parallel ranks' micro-batches into one expert instance, by
design: those share its scales, which per-row scales and world 1 with one micro-batch per dp rank
would not; tests/models/test_fp8_parallel.py gives its dp ranks the same micro-batch.)

Two kernels consume the same cast operands (one set of scale tensors, built once):

- grouped: ``torch._scaled_grouped_mm`` (CUDA compute capability 9.x/10.x, K and M multiples of 16,
  both operands e4m3, row scales ``[N]`` and per-expert column scales ``[e, M]``, bf16 output, group
  offsets on the device: no host synchronisation). It runs the forward and, with ``--fp8-format
  e4m3``, dx; with hybrid (an e5m2 gradient, which the grouped kernel does not take) dx runs per
  expert, and dw always does (its K-grouped form needs 16-row-aligned groups). Chosen for the
  ``grouped_mm`` gemm backend wherever the device supports it.
- per expert: ``torch._scaled_mm`` once per expert with the same row/column scales: everywhere else
  (CPU, older GPUs, the ``loop`` backend). It takes the counts on the host (the dispatcher's, else one
  read).

Outputs: the per-expert path writes the operand dtype (tensorwise scales go to the kernel as scalars;
row-wise ones make torch's CUDA kernel write bf16); the grouped kernel writes bf16 only, cast to the
operand dtype. With bf16 activations (FP8 training's usual setting) the two paths are bit for bit the
same computation from the same operands; with fp32 the grouped kernel's results are the per-expert
ones rounded to bf16 (tests/moe/test_fp8_gemm.py emulates ``_scaled_grouped_mm`` on CPU to check
both). Keeping fp32 where the kernel allows matters under expert-tensor parallelism: a K-split GEMM's
partial sums rounded to bf16 before their reduction would make etp layouts differ from world 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moefold.dense.split_backward import SplitWeights, WeightGradStore, accumulate_or_defer, weight_inputs
from moefold.moe.gemm import GemmBackend, no_rows, row_experts
from moefold.parallel.groups import Group, group_size
from moefold.precision.fp8 import FP8Backend, FP8Config
from moefold.precision.fp8_cast import E4M3, Float8Recipe, amax, amax_to_scale, reduce_max, scaled_mm, to_float8

FP8_GEMM_BACKENDS: dict[FP8Backend, tuple[GemmBackend, ...]] = {
    FP8Backend.TORCHAO: (GemmBackend.GROUPED_MM, GemmBackend.LOOP), FP8Backend.TE: (GemmBackend.TE,)}


def check_fp8_gemm_backend(fp8: FP8Config | None, gemm_backend: GemmBackend) -> None:
    """ValueError naming the valid choices when the FP8 backend cannot run the expert GEMMs of ``gemm_backend``."""
    if fp8 is None or not fp8.enabled:
        return
    valid = FP8_GEMM_BACKENDS[fp8.backend]
    if gemm_backend not in valid:
        other = FP8Backend.TE if fp8.backend is FP8Backend.TORCHAO else FP8Backend.TORCHAO
        raise ValueError(f"FP8 ({fp8.describe()}) runs the expert GEMMs with gemm backend "
                         f"{' or '.join(repr(v.value) for v in valid)} (--moe-grouped-gemm-backend), not "
                         f"'{gemm_backend}'; or use --fp8-backend {other} (gemm backend "
                         f"{' or '.join(FP8_GEMM_BACKENDS[other])})")


def grouped_kernel_supported(x: Tensor, K: int, M: int) -> bool:
    """``torch._scaled_grouped_mm`` runs here: CUDA compute capability 9.x or 10.x, K and M multiples of 16."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
            and K % 16 == 0 and M % 16 == 0)


# torch's grouped FP8 kernel, looked up at call time (tests substitute an emulation on CPU)
_scaled_grouped_mm = getattr(torch, "_scaled_grouped_mm", None)


class _Operands:
    """A GEMM's cast operands in the kernels' form: ``a [N, K']`` float8 with row scales ``sa [N]``,
    ``b [e, K', M']`` float8 column-major per expert with column scales ``sb [e, M']``."""

    def __init__(self, a: Tensor, sa: Tensor, b: Tensor, sb: Tensor) -> None:
        self.a, self.sa, self.b, self.sb = a, sa, b, sb


class _Float8GroupedMM(torch.autograd.Function):
    """Saved for backward: ``w`` (a parameter), the counts, and ``x`` as the weight gradient's GEMMs take it (per
    expert, contracted over its rows: ``cast_per_expert_columns``), cast in forward as Transformer Engine's
    ``GroupedLinear`` keeps its column-wise quantised inputs; or ``x`` itself with ``gemm.save_original_input``
    (the down GEMM's input under ``moe_act`` recompute: Megatron's ``set_save_original_input``). The backward
    multiplies the same values either way."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts_e: Tensor, counts_host: list[int] | None,
                gemm: Float8GroupedGemm, split: SplitWeights | None, _anchor: Tensor | None) -> Tensor:
        ctx.gemm, ctx.counts_host, ctx.split = gemm, counts_host, split   # split backward: w detached
        ctx.x_dtype, ctx.rows = x.dtype, x.shape[0]
        gid = _group_ids(counts_e, x.shape[0])
        ops = _Operands(*gemm.cast_rows(x, gemm.recipe.input, gid, w.shape[0], gemm.k_group),
                        *gemm.cast_weight(w, contract=2))
        y, ctx.counts_host = gemm.rows_gemm(ops, counts_e, counts_host, x.dtype)
        ctx.original = gemm.save_original_input
        if not (split is not None or ctx.needs_input_grad[1]):
            ctx.save_for_backward(w, counts_e, None, None)
        elif ctx.original:
            ctx.save_for_backward(w, counts_e, x, None)
        else:   # dw's operand, per (expert, column) or per expert over that expert's rows
            ctx.save_for_backward(w, counts_e, *gemm.cast_per_expert_columns(x, gemm.recipe.input, gid, w.shape[0],
                                                                              gemm.k_group))
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None]:
        w, counts_e, x_saved, sx_saved = ctx.saved_tensors
        gemm: Float8GroupedGemm = ctx.gemm
        r, e = gemm.recipe, w.shape[0]
        dy = dy.contiguous()
        gid = _group_ids(counts_e, ctx.rows)
        counts_host = ctx.counts_host
        dx = dw = None
        if ctx.needs_input_grad[0]:
            ops = _Operands(*gemm.cast_rows(dy, r.grad_output, gid, e, gemm.m_group), *gemm.cast_weight(w, contract=1))
            dx, counts_host = gemm.rows_gemm(ops, counts_e, counts_host, ctx.x_dtype)
        counts = counts_host
        original = ctx.original

        def weight_grad() -> tuple[Tensor]:
            host = counts if counts is not None else counts_e.tolist()
            q_dy, s_dy = gemm.cast_per_expert_columns(dy, r.grad_output, gid, e, gemm.m_group)
            if original:
                q_x, s_x = gemm.cast_per_expert_columns(x_saved, r.input, gid, e, gemm.k_group)
            else:
                q_x, s_x = x_saved, sx_saved
            grad = torch.zeros_like(w)
            start = 0
            for i, m in enumerate(host):
                if m:
                    rows = slice(start, start + m)
                    s_a, s_b = (s_dy[i], s_x[i]) if gemm.rowwise else (s_dy[i, 0], s_x[i, 0])
                    grad[i] = scaled_mm(q_dy[rows].t(), s_a, q_x[rows], s_b, w.dtype)
                start += m
            return (grad,)

        if ctx.split is not None:   # split backward: now or deferred (its casts too)
            accumulate_or_defer(gemm.store, ctx.split.edges, weight_grad)
        elif ctx.needs_input_grad[1]:
            (dw,) = weight_grad()
        return dx, dw, None, None, None, None, None


def _group_ids(counts_e: Tensor, N: int) -> Tensor:
    """[N] local expert index of every row, ``e`` past the last expert's block (``moe.gemm.row_experts``)."""
    return row_experts(counts_e, N)


def _per_expert_amax(t: Tensor, gid: Tensor, e: int, per_column: bool, groups: Sequence[Group]) -> Tensor:
    """amax of each expert's rows of ``t [N, C]``: ``[e + 1, C]`` per column, else ``[e + 1]``, reduced over
    ``groups``; the last entry is that of the rows past the last expert's block (none, or a sync-free dispatcher's
    worst-case rows, whose values are unspecified), so they never reach an expert's scale."""
    rows = t.abs().float() if per_column else amax(t, (1,)).squeeze(1)
    shape = (e + 1, t.shape[1]) if per_column else (e + 1,)
    index = gid[:, None].expand(-1, t.shape[1]) if per_column else gid
    out = torch.zeros(shape, dtype=torch.float32, device=t.device).scatter_reduce_(0, index, rows, "amax")
    return reduce_max(out, groups)


class Float8GroupedGemm:
    """``grouped_gemm``'s signature in FP8: ``(x [N, K], w [e, M, K], tokens_per_expert_e, backend=None, *,
    trans_w=True, counts_host=None) -> [N, M]`` (``w`` in the experts' ``[out, in]`` layout).

    ``k_group`` / ``m_group``: the group the K / M dim is split over (etp), or None; ``token_group``:
    the group an expert's rows are split over (module docstring), or None.
    ``grouped``: use ``torch._scaled_grouped_mm`` where the device supports it (else per expert).
    ``store``: split backward (``dense.split_backward``): the weight gradient may be deferred to it, or None.
    """

    def __init__(self, config: FP8Config, *, grouped: bool = True, k_group: Group = None,
                 m_group: Group = None, token_group: Group = None, store: WeightGradStore | None = None) -> None:
        self.config, self.recipe = config, Float8Recipe.from_config(config)
        self.grouped, self.k_group, self.m_group, self.token_group = grouped, k_group, m_group, token_group
        self.store = store
        # keep x itself for backward instead of its quantised copy, where x is kept anyway (Fp8Gemm.saving_original)
        self.save_original_input = False

    def with_weight_grad_store(self, store: WeightGradStore) -> Float8GroupedGemm:
        """This GEMM with a split backward: its weight gradient (its casts too) deferred while ``store`` defers."""
        gemm = Float8GroupedGemm(self.config, grouped=self.grouped, k_group=self.k_group, m_group=self.m_group,
                                 token_group=self.token_group, store=store)
        gemm.save_original_input = self.save_original_input
        return gemm

    def __call__(self, x_NK: Tensor, w: Tensor, tokens_per_expert_e: Tensor, *, trans_w: bool = True,
                 counts_host: Sequence[int] | None = None) -> Tensor:
        if not trans_w:
            raise ValueError("Float8GroupedGemm takes the experts' [e, out, in] weights (trans_w=True)")
        if x_NK.dim() != 2 or w.dim() != 3 or w.shape[2] != x_NK.shape[1]:
            raise ValueError(f"Float8GroupedGemm expects x [N, K] and w [e, M, K], got {tuple(x_NK.shape)} and "
                             f"{tuple(w.shape)}")
        if x_NK.shape[0] == 0 and group_size(self.token_group) == 1:
            return no_rows(x_NK, w, True)  # (with a token group, the casts' all-reduces must still run)
        host = None if counts_host is None else [int(c) for c in counts_host]
        (w_in,), split = weight_inputs(self.store, w)
        return _Float8GroupedMM.apply(x_NK, w_in, tokens_per_expert_e, host, self, split,
                                      None if split is None else split.anchor)

    # -- casts (shared by both kernels) -----------------------------------------------------
    def cast_rows(self, t: Tensor, cast, gid: Tensor, e: int, contract_group: Group) -> tuple[Tensor, Tensor]:
        """Token rows ``t [N, C]`` contracted over C: per row (rowwise) or per expert -> (data, scales [N])."""
        if cast.rowwise:
            a = amax(t, (1,), (contract_group,))
        else:
            a = _per_expert_amax(t, gid, e, False, (contract_group, self.token_group))[gid].unsqueeze(1)
        q, inv = to_float8(t.contiguous(), a, cast.dtype, self.recipe.pow2_scales)
        return q, inv.squeeze(1)

    def cast_weight(self, w: Tensor, contract: int) -> tuple[Tensor, Tensor]:
        """``w [e, M, K]`` contracted over dim ``contract`` (2: forward, over K; 1: dx, over M) ->
        (``b [e, K', M']`` column-major, scales ``[e, M']``)."""
        cast = self.recipe.weight
        if cast.rowwise:
            a = amax(w, (contract,), (self.k_group if contract == 2 else self.m_group,))
        else:
            a = amax(w, (1, 2), (self.k_group, self.m_group))
        q, inv = to_float8(w.contiguous(), a, cast.dtype, self.recipe.pow2_scales)
        if contract == 2:  # b = w^T: [e, K, M], column-major (in memory [e, M, K])
            return q.transpose(1, 2), inv.expand(-1, w.shape[1], 1).squeeze(2).contiguous()
        # dx: b = w [e, M, K] column-major (in memory [e, K, M])
        return q.transpose(1, 2).contiguous().transpose(1, 2), inv.expand(-1, 1, w.shape[2]).squeeze(1).contiguous()

    def cast_per_expert_columns(self, t: Tensor, cast, gid: Tensor, e: int, column_group: Group
                                ) -> tuple[Tensor, Tensor]:
        """``t [N, C]`` for dw, contracted over each expert's rows: per (expert, column) or per expert
        -> (data [N, C], scales [e, C])."""
        if cast.rowwise:
            a_eC = _per_expert_amax(t, gid, e, True, (self.token_group,))
        else:
            a_eC = _per_expert_amax(t, gid, e, False, (column_group, self.token_group))[:, None].expand(-1, t.shape[1])
        q, _ = to_float8(t, a_eC[gid], cast.dtype, self.recipe.pow2_scales)
        return q, amax_to_scale(a_eC, cast.dtype, self.recipe.pow2_scales).reciprocal()

    # -- kernels ------------------------------------------------------------------------------
    @property
    def rowwise(self) -> bool:
        return self.recipe.input.rowwise

    def rows_gemm(self, ops: _Operands, counts_e: Tensor, counts_host: list[int] | None, out_dtype: torch.dtype
                  ) -> tuple[Tensor, list[int] | None]:
        """``out[rows_i] = (a[rows_i] * sa) @ (b[i] * sb[i])`` -> (out [N, M'], host counts if read)."""
        K, M = ops.b.shape[1], ops.b.shape[2]
        if (self.grouped and ops.a.dtype == ops.b.dtype == E4M3 and _scaled_grouped_mm is not None
                and ops.a.shape[0] > 0 and grouped_kernel_supported(ops.a, K, M)):
            offs = torch.cumsum(counts_e, 0, dtype=torch.int32)
            out = _scaled_grouped_mm(ops.a, ops.b, ops.sa, ops.sb, offs=offs, out_dtype=torch.bfloat16,
                                     use_fast_accum=self.recipe.fast_accum_forward)
            return out.to(out_dtype), counts_host
        counts_host = counts_host if counts_host is not None else counts_e.tolist()
        out = ops.a.new_empty((ops.a.shape[0], M), dtype=out_dtype)
        start = 0
        for i, m in enumerate(counts_host):
            if m:
                rows = slice(start, start + m)
                # tensorwise: one scale per expert, passed as scalars (torch's tensor-wise kernel)
                s_a, s_b = (ops.sa[rows], ops.sb[i]) if self.rowwise else (ops.sa[start], ops.sb[i, 0])
                out[rows] = scaled_mm(ops.a[rows], s_a, ops.b[i], s_b, out_dtype)
            start += m
        return out, counts_host

    def describe(self) -> str:
        kernel = "torch._scaled_grouped_mm where supported, else per expert" if self.grouped else "per expert"
        return f"torchao fp8 {self.config.format} {self.config.recipe} ({kernel})"


__all__ = ["FP8_GEMM_BACKENDS", "Float8GroupedGemm", "check_fp8_gemm_backend", "grouped_kernel_supported"]
