"""Block-scaled GEMMs for the column/row-parallel linears: ``--fp8-recipe blockwise | mxfp8``, ``--fp4-format e2m1``.

``BlockScaledLinearGemm`` is a linear's ``local_gemm`` (``execution.fp8_linear.convert_linears_to_fp8`` installs
it) computing, with every operand cast by ``precision.block_cast`` in its recipe's blocks::

    forward  y  = q(x) q(w)^T           x: 1 x b tiles along K         w: its weight blocks
    backward dx = q(dy) q(w)            dy: 1 x b tiles along N        w: the same 2-D blocks (blockwise 128x128,
                                                                          nvfp4 16x16), mxfp8: 32 x 1 along N
             dw = q(dy)^T q(x)          dy, x: b x 1 tiles along the tokens M

(b = 128 blockwise, 32 mxfp8, 16 nvfp4), as torchao's ``fp8_blockwise_mm`` / ``mx_mm`` define them. The
saved tensors are ``w`` (a parameter) and ``x`` cast in forward for ``dw`` (its elements, 1 byte each (nvfp4's
e2m1 codes unpacked), and block scales: what Transformer Engine keeps, the column-wise quantised input), or
``x`` itself with ``save_original_input``; the bias is added in high precision.

Where it runs: the casts are torch ops on the operands' device; the GEMM multiplies the dequantised
operands in fp32 (``torch.mm``) and writes the activation dtype. On a CPU that is the emulation (the exact
numerics of the quantised GEMM, no speed-up); on GPUs too, except where torchao's own kernels take over
(``_torchao_kernel``): ``fp8_blockwise_mm`` (Triton + ``torch._scaled_mm`` block scaling, sm90+) and
``mx_mm`` (sm100), when no dim of the layer is split over ranks (their scales cannot be all-reduced) and
the shapes are the kernels' multiples. (Not exercised here: this machine has no GPU.)

Scales and parallelism follow ``precision.block_cast``: dims split over tp (column-parallel ``out``,
row-parallel ``in``, the token shard of replicated sequence-parallel layers) reduce a block's amax over tp
when the whole dim is one block, need no communication when shards hold whole blocks, and are refused at
construction when shards would cut through blocks (``check_split``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from moefold.parallel.groups import Group, group_size
from moefold.parallel.sequence_input import keep_rows_as_shard
from moefold.precision.block_cast import FORMATS, BlockFormat, Cast, check_split, dequantize, quantize, tensor_amax
from moefold.precision.fp8 import FP8Config, FP8Format, FP8Recipe
from moefold.precision.fp8_cast import E5M2, shared_cast


class _BlockScaledLinear(torch.autograd.Function):
    """``x [M, K] @ w [N, K]^T`` with every GEMM operand block-cast by ``gemm`` (module docstring).

    Saved: ``w`` (a parameter) and ``x`` as the weight gradient's GEMM takes it, cast in forward in b x 1 tiles
    along the tokens (its elements and block scales: TE's column-wise quantised input), or ``x`` itself with
    ``gemm.save_original_input``; the backward dequantises (``block_cast.dequantize``) the same values."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, gemm: BlockScaledLinearGemm) -> Tensor:
        ctx.gemm, ctx.x_dtype = gemm, x.dtype
        qx = gemm.cast(x, False, contract=1, split=(gemm.token_group, gemm.in_group), role="input")
        qw = gemm.cast(w, True, contract=1, split=(gemm.out_group, gemm.in_group), role="weight")
        y = gemm.mm(qx, qw.t(), x.dtype)
        ctx.original = gemm.save_original_input
        if not ctx.needs_input_grad[1]:
            ctx.save_for_backward(w, None, None, None)
        elif ctx.original:
            ctx.save_for_backward(w, x, None, None)
        else:   # dw's operand: b x 1 tiles along the tokens M
            split = (gemm.token_group, gemm.in_group)   # one copy for every GEMM on this input (q, k, v; gate, up)
            c = shared_cast(x, ("block dw", gemm.config, split), lambda: gemm.cast_compact(
                x, False, contract=0, split=split, role="input")._replace(dq=None))   # (not its fp32 values)
            keep_rows_as_shard(c.data, x)   # under SP: this rank's rows of it (parallel.sequence_input)
            ctx.save_for_backward(w, c.data, c.scale, c.tensor_scale)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        w, x_saved, scale, tensor_scale = ctx.saved_tensors
        gemm: BlockScaledLinearGemm = ctx.gemm
        gy = gy.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:   # dx = dy @ w: contracts N
            q_dy = gemm.cast(gy, False, contract=1, split=(gemm.token_group, gemm.out_group), role="grad")
            qw = gemm.cast(w, True, contract=0, split=(gemm.out_group, gemm.in_group), role="weight")
            gx = gemm.mm(q_dy, qw, ctx.x_dtype)
        if ctx.needs_input_grad[1]:   # dw = dy^T @ x: contracts the tokens M
            q_dy = gemm.cast(gy, False, contract=0, split=(gemm.token_group, gemm.out_group), role="grad")
            if ctx.original:
                qx = gemm.cast(x_saved, False, contract=0, split=(gemm.token_group, gemm.in_group), role="input")
            else:
                qx = dequantize(gemm.fmt, x_saved, scale, tensor_scale, gemm.fmt.operand_block(False, 0))
            gw = gemm.mm(q_dy.t(), qx, w.dtype)
        return gx, gw, None


class BlockScaledLinearGemm:
    """``(x [..., K], w [N, K], b [N] | None) -> [..., N]`` in a block-scaled recipe, for one linear layer.

    ``in_group`` / ``out_group`` / ``token_group``: the groups K / N / the rows M are split over (None:
    complete here), as in ``execution.fp8_linear.Float8LinearGemm``.
    """

    def __init__(self, config: FP8Config, *, in_group: Group = None, out_group: Group = None,
                 token_group: Group = None) -> None:
        if not config.block_scaled:
            raise ValueError(f"BlockScaledLinearGemm runs blockwise / mxfp8 / nvfp4 (torchao), not {config.describe()}")
        self.config, self.fmt = config, FORMATS[config.recipe]
        self.in_group, self.out_group, self.token_group = in_group, out_group, token_group
        # FP8 element types: hybrid gives e5m2 gradients (only TE allows it with block recipes; kept general)
        self.grad_dtype = E5M2 if config.format is FP8Format.HYBRID else None
        self.save_original_input = False   # keep x itself for backward (execution.fp8_linear.original_input_linears)

    def check_shapes(self, name: str, in_local: int, out_local: int) -> None:
        """ValueError when this layer's shards would cut through the recipe's blocks (see ``precision.block_cast``)."""
        f = self.fmt
        wb = f.weight or (f.act, f.act)
        check_split(f"{name} in_features", in_local, self.in_group, max(f.act, wb[1]))
        check_split(f"{name} out_features", out_local, self.out_group, max(f.act, wb[0]))

    def cast(self, t: Tensor, is_weight: bool, contract: int, split: tuple[Group, Group], role: str) -> Tensor:
        """The dequantised fp32 values the GEMM multiplies (``role``: input | weight | grad)."""
        return self.cast_compact(t, is_weight, contract, split, role).dq

    def cast_compact(self, t: Tensor, is_weight: bool, contract: int, split: tuple[Group, Group], role: str
                     ) -> Cast:
        """``t`` cast for a GEMM contracting its dim ``contract``: its values, elements and scales (``Cast``)."""
        f: BlockFormat = self.fmt
        amax_t = tensor_amax(t, split) if f.two_level else None
        dtype = self.grad_dtype if role == "grad" else None
        return quantize(t, f, f.operand_block(is_weight, contract), split, dtype=dtype, amax_t=amax_t)

    @staticmethod
    def mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
        return torch.mm(a, b).to(out_dtype)

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        kernel = self._torchao_kernel(x2, w)
        y = kernel(x2, w) if kernel is not None else _BlockScaledLinear.apply(x2, w, self)
        y = y.view(*lead, w.shape[0])
        return y if b is None else y + b

    def _torchao_kernel(self, x: Tensor, w: Tensor):
        """torchao's own autograd function for this GEMM where it runs (CUDA, bf16, shapes the kernels'
        multiples, nothing split over ranks), else None (the casts above, emulated GEMM)."""
        if not x.is_cuda or x.dtype != torch.bfloat16 or self.config.fp4 is not None or self.grad_dtype is not None:
            return None
        if any(group_size(g) > 1 for g in (self.in_group, self.out_group, self.token_group)):
            return None
        b = self.fmt.act
        if x.shape[0] % b or x.shape[1] % b or w.shape[0] % b:
            return None
        return _torchao_linear(self.fmt.name, torch.cuda.get_device_capability(x.device))

    def describe(self) -> str:
        return f"block-scaled {self.config.describe()}"


@functools.cache
def _torchao_linear(recipe: FP8Recipe, capability: tuple[int, int]):
    """torchao's linear autograd function for ``recipe`` on a GPU of ``capability`` (None when it has none)."""
    recipe = FP8Recipe(recipe)   # its word too (the format's name is the enum)
    try:
        if recipe is FP8Recipe.BLOCKWISE and capability >= (9, 0):
            from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

            return lambda x, w: fp8_blockwise_mm.apply(x, w, 128, torch.bfloat16, True)
        if recipe is FP8Recipe.MXFP8 and capability[0] == 10:
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common import KernelPreference

            return lambda x, w: _to_mxfp8_then_scaled_mm(x, w, KernelPreference.AUTO, ScaleCalculationMode.RCEIL)
    except ImportError:   # e.g. triton missing: the emulated GEMM
        return None
    return None


__all__ = ["BlockScaledLinearGemm"]
