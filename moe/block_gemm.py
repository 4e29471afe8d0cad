"""Block-scaled grouped expert GEMMs (``--fp8-recipe blockwise | mxfp8``, ``--fp4-format e2m1``; torchao backend).

For every local expert i over its block of rows (expert-major, as ``moe.gemm``), each operand cast by
``precision.block_cast`` in its recipe's blocks (b = 128 blockwise, 32 mxfp8, 16 nvfp4)::

    forward  y[rows_i]  = q(x[rows_i]) @ q(w[i])^T     x: 1 x b tiles along K; w[i]: its weight blocks
    backward dx[rows_i] = q(dy[rows_i]) @ q(w[i])      dy: 1 x b along M; w[i]: the same 2-D blocks (mxfp8: b x 1)
             dw[i]      = q(dy[rows_i])^T @ q(x[rows_i])   b x 1 tiles along the expert's rows, restarting at
                                                        its first row (torchao pads each group to the multiple;
                                                        ``--moe-router-padding-for-quantization`` makes the
                                                        dispatcher lay the groups out padded)

as torchao's ``moe_training`` grouped GEMMs define them (``_to_fp8_blockwise_then_scaled_grouped_mm``,
``_to_mxfp8_then_scaled_grouped_mm``). NVFP4's per-tensor scales are per expert (x's over that expert's
rows), like every expert scale in moefold: an expert's cast does not depend on which others share its rank.

Where it runs: the GEMMs multiply the dequantised operands in fp32 (``moe.gemm.grouped_gemm`` with
``grouped_mm``, the weight gradients one GEMM per expert): on a CPU the emulation; on GPUs torchao's grouped
kernels take over for blockwise and mxfp8 where they run (CUDA sm90+ / sm100, bf16, K and M multiples of
128 / 32, nothing split over ranks, ``_torchao_grouped``; not exercised here: no GPU).

Parallelism: etp splits w13's rows (M) and w2's columns (K); shards must hold whole blocks (checked by
``GroupedExperts``), or the dim must be one block (its amax reduced over etp). The rows of an expert are
this rank's: their tiles are never reduced across ranks (what the kernels compute on each rank), so
layouts that split one expert's rows over ranks (``ParallelDims.expert_token_group``) quantise the weight
gradient in other tiles than world 1 whenever an expert holds more rows than one tile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from moefold.moe.gemm import GemmBackend, grouped_gemm, no_rows
from moefold.parallel.groups import Group, group_size
from moefold.precision.block_cast import FORMATS, Cast, dequantize, quantize
from moefold.precision.fp8 import FP8Config, FP8Format, FP8Recipe
from moefold.precision.fp8_cast import E5M2, reduce_max


def _expert_amax(t: Tensor, counts_e: Tensor, groups: Sequence[Group]) -> Tensor:
    """[e] amax of each expert's rows of ``t [N, C]``, reduced over ``groups``."""
    e = counts_e.shape[0]
    gid = torch.repeat_interleave(torch.arange(e, device=t.device), counts_e, output_size=t.shape[0])
    rows = t.detach().abs().amax(dim=1).float() if t.shape[1] else t.new_zeros(t.shape[0], dtype=torch.float32)
    out = torch.zeros(e, dtype=torch.float32, device=t.device).scatter_reduce_(0, gid, rows, "amax")
    return reduce_max(out, groups)


class _BlockScaledGroupedMM(torch.autograd.Function):
    """Saved: ``w`` (a parameter), the counts, and ``x`` cast in forward as ``dw`` takes it (b x 1 tiles along each
    expert's rows: its elements and block scales, TE's column-wise quantised input), or ``x`` itself with
    ``gemm.save_original_input``; the backward dequantises the same values (``block_cast.dequantize``)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts_e: Tensor, counts_host: list[int] | None,
                gemm: BlockScaledGroupedGemm) -> Tensor:
        ctx.gemm, ctx.counts_host, ctx.x_dtype = gemm, counts_host, x.dtype
        qx = gemm.cast_rows(x, counts_e, contract=1, col_group=gemm.k_group, grad=False)
        qw = gemm.cast_weight(w, contract=1)
        y = grouped_gemm(qx, qw, counts_e, GemmBackend.GROUPED_MM, trans_w=True).to(x.dtype)
        ctx.original = gemm.save_original_input
        if not ctx.needs_input_grad[1]:
            ctx.save_for_backward(w, counts_e, None, None, None)
        elif ctx.original:
            ctx.save_for_backward(w, counts_e, x, None, None)
        else:
            c = gemm.cast_rows_compact(x, counts_e, contract=0, col_group=gemm.k_group, grad=False)
            ctx.save_for_backward(w, counts_e, c.data, c.scale, c.tensor_scale)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        w, counts_e, x_saved, scale, tensor_scale = ctx.saved_tensors
        gemm: BlockScaledGroupedGemm = ctx.gemm
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            q_dy = gemm.cast_rows(dy, counts_e, contract=1, col_group=gemm.m_group, grad=True)
            dx = grouped_gemm(q_dy, gemm.cast_weight(w, contract=0), counts_e, GemmBackend.GROUPED_MM
                              ).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            counts = ctx.counts_host if ctx.counts_host is not None else counts_e.tolist()
            q_dy = gemm.cast_rows(dy, counts_e, contract=0, col_group=gemm.m_group, grad=True)
            if ctx.original:
                q_x = gemm.cast_rows(x_saved, counts_e, contract=0, col_group=gemm.k_group, grad=False)
            else:
                q_x = dequantize(gemm.fmt, x_saved, scale, tensor_scale, gemm.fmt.operand_block(False, 0), counts_e)
            dw = torch.zeros_like(w)
            start = 0
            for i, m in enumerate(counts):
                if m:
                    dw[i] = (q_dy[start:start + m].t() @ q_x[start:start + m]).to(w.dtype)
                start += m
        return dx, dw, None, None, None


class BlockScaledGroupedGemm:
    """``grouped_gemm``'s signature in a block-scaled recipe: ``(x [N, K], w [e, M, K], tokens_per_expert_e,
    backend=None, *, trans_w=True, counts_host=None) -> [N, M]``; groups as ``moe.fp8_gemm.Float8GroupedGemm``
    (``k_group`` / ``m_group``: etp; ``token_group``: the ranks splitting an expert's rows, whose NVFP4
    per-expert tensor amaxes are reduced)."""

    def __init__(self, config: FP8Config, *, grouped: bool = True, k_group: Group = None, m_group: Group = None,
                 token_group: Group = None) -> None:
        if not config.block_scaled:
            raise ValueError(f"BlockScaledGroupedGemm runs blockwise / mxfp8 / nvfp4 (torchao), not "
                             f"{config.describe()}")
        self.config, self.fmt, self.grouped = config, FORMATS[config.recipe], grouped
        self.k_group, self.m_group, self.token_group = k_group, m_group, token_group
        self.grad_dtype = E5M2 if config.format is FP8Format.HYBRID else None
        # keep x itself for backward instead of its quantised copy, where x is kept anyway (Fp8Gemm.saving_original)
        self.save_original_input = False

    def __call__(self, x_NK: Tensor, w: Tensor, tokens_per_expert_e: Tensor, *, trans_w: bool = True,
                 counts_host: Sequence[int] | None = None) -> Tensor:
        if not trans_w:
            raise ValueError("BlockScaledGroupedGemm takes the experts' [e, out, in] weights (trans_w=True)")
        if x_NK.dim() != 2 or w.dim() != 3 or w.shape[2] != x_NK.shape[1]:
            raise ValueError(f"BlockScaledGroupedGemm expects x [N, K] and w [e, M, K], got {tuple(x_NK.shape)} and "
                             f"{tuple(w.shape)}")
        groups = (self.k_group, self.m_group, self.token_group)
        if x_NK.shape[0] == 0 and all(group_size(g) == 1 for g in groups):
            return no_rows(x_NK, w, True)   # (with groups, the casts' all-reduces must still run)
        kernel = self._torchao_grouped(x_NK, w)
        if kernel is not None:
            offs = torch.cumsum(tokens_per_expert_e, 0, dtype=torch.int32)
            return kernel(x_NK, w.transpose(-2, -1), offs)
        host = None if counts_host is None else [int(c) for c in counts_host]
        return _BlockScaledGroupedMM.apply(x_NK, w, tokens_per_expert_e, host, self)

    # -- casts ---------------------------------------------------------------------------------------------
    def cast_rows(self, t: Tensor, counts_e: Tensor, contract: int, col_group: Group, grad: bool) -> Tensor:
        """Token rows ``t [N, C]``: 1 x b tiles along C (``contract=1``) or b x 1 tiles along each expert's rows
        (0) -> the dequantised fp32 values."""
        return self.cast_rows_compact(t, counts_e, contract, col_group, grad).dq

    def cast_rows_compact(self, t: Tensor, counts_e: Tensor, contract: int, col_group: Group, grad: bool) -> Cast:
        """``cast_rows`` with its elements and scales (``block_cast.Cast``)."""
        f = self.fmt
        amax_t = _expert_amax(t, counts_e, (col_group, self.token_group)) if f.two_level else None
        block = f.operand_block(False, contract)
        return quantize(t, f, block, (None, col_group), row_counts=counts_e, dtype=self.grad_dtype if grad else None,
                        amax_t=amax_t)

    def cast_weight(self, w: Tensor, contract: int) -> Tensor:
        """``w [e, M, K]`` for the GEMM contracting its dim ``contract + 1`` (1: K, forward; 0: M, dx), per expert
        -> the dequantised fp32 ``[e, M, K]``."""
        f = self.fmt
        e, M, K = w.shape
        amax_t = None
        if f.two_level:
            a = w.detach().abs().amax(dim=(1, 2)).float() if w.numel() else w.new_zeros(e, dtype=torch.float32)
            amax_t = reduce_max(a, (self.m_group, self.k_group))
        rows = torch.full((e,), M, dtype=torch.long, device=w.device)
        c = quantize(w.reshape(e * M, K), f, f.operand_block(True, contract), (self.m_group, self.k_group),
                     row_counts=rows, amax_t=amax_t)
        return c.dq.view(e, M, K)

    def _torchao_grouped(self, x: Tensor, w: Tensor):
        """torchao's grouped autograd function where it runs (module docstring), else None."""
        if not (self.grouped and x.is_cuda and x.dtype == torch.bfloat16 and self.config.fp4 is None
                and self.grad_dtype is None):
            return None
        if any(group_size(g) > 1 for g in (self.k_group, self.m_group, self.token_group)):
            return None
        b = self.fmt.act
        if w.shape[1] % b or w.shape[2] % b:
            return None
        return _torchao_grouped(self.fmt.name, torch.cuda.get_device_capability(x.device),
                                self.config.router_padding)

    def describe(self) -> str:
        return f"block-scaled {self.config.describe()} (grouped)"


@functools.cache
def _torchao_grouped(recipe: FP8Recipe, capability: tuple[int, int], padded: bool):
    recipe = FP8Recipe(recipe)   # its word too (the format's name is the enum)
    try:
        if recipe is FP8Recipe.BLOCKWISE and capability >= (9, 0):
            from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import (
                _to_fp8_blockwise_then_scaled_grouped_mm,
            )

            return lambda x, w_t, offs: _to_fp8_blockwise_then_scaled_grouped_mm(
                x, w_t, offs, torch.bfloat16, pad_token_groups_for_grouped_mm=not padded)
        if recipe is FP8Recipe.MXFP8 and capability[0] == 10:
            from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

            return lambda x, w_t, offs: _to_mxfp8_then_scaled_grouped_mm(
                x, w_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=not padded)
    except ImportError:
        return None
    return None


def check_expert_blocks(config: FP8Config, ffn_local: int, etp: int) -> None:
    """ValueError when etp shards of the experts' FFN dim would cut through the recipe's blocks."""
    if not config.block_scaled or etp == 1:
        return
    f = FORMATS[config.recipe]
    b = max(f.act, *(f.weight or (f.act,)))
    if ffn_local % b:
        raise ValueError(f"{config.flags()}: the experts' FFN dim {ffn_local * etp} split over etp={etp} gives "
                         f"shards of {ffn_local}, which cut through the {b}-element quantisation blocks; use an "
                         f"--expert-tensor-parallel-size whose shards are multiples of {b}")


__all__ = ["BlockScaledGroupedGemm", "check_expert_blocks"]
