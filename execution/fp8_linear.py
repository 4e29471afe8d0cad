"""FP8 GEMMs for the column/row-parallel linears, and ``convert_linears_to_fp8`` that installs them.

A ``ColumnParallelLinear``/``RowParallelLinear`` runs its local GEMM through ``layer.local_gemm(x, w, b)``
(``F.linear`` by default). ``convert_linears_to_fp8(model, config, tp_group)`` walks a built model once
and gives every linear whose qualified name contains none of ``config.exclude_modules`` an FP8 GEMM:

- ``Float8LinearGemm`` (``--fp8-backend torchao``): torchao's recipe (``precision.fp8_cast``) in one
  autograd function: forward ``y = q(x) q(w)^T``, backward ``dx = q(dy) q(w)``, ``dw = q(dy)^T q(x)``,
  each operand cast along that GEMM's contraction dim (rowwise) or as a whole (tensorwise), the
  gradient in e5m2 with ``hybrid``. It saves ``w`` (a parameter) and ``x`` as the weight gradient's GEMM
  takes it, quantised in forward (1 byte an element and its scales, as Transformer Engine keeps its input;
  ``save_original_input``: ``x`` itself); the bias is added in high precision.
- ``precision.te_linear.TELinearGemm`` (``--fp8-backend te``): a persistent ``te.Linear`` run on the layer's
  weight inside the TE autocast region the model entered for the whole stage forward;
- ``precision.block_linear.BlockScaledLinearGemm`` (block-scaled recipes: blockwise, mxfp8, nvfp4).

The execution pass (``execution.apply``) runs ``convert_linears_to_fp8`` once per model, before split backward and
gradient-accumulation fusion (which wrap or keep the GEMM installed here). ``Float8LinearGemm`` lives here, not in
``precision``, because it defers its weight-gradient GEMM through ``dense.split_backward``'s store.

Scales and parallelism (torchao backend). Which dims of each operand are sharded follows from the
layer: a column-parallel weight and output gradient are split along ``out`` over tp; a row-parallel
input and weight along ``in``; a replicated layer whose weight is marked sequence-parallel (MLA's
down projections, MTP's ``eh_proj``) sees only this rank's sequence shard, so its tokens are split
over tp. Every amax taken over a sharded dim is all-reduced (MAX) over tp, so each rank casts with
the scale of the unsharded tensor and a TP/SP layout computes what world 1 computes (up to fp32
summation order). Per-shard scales would be cheaper by one scalar/vector all-reduce per cast but
make every layout a different quantisation of the same model.

Kept in high precision: the output head (default ``exclude_modules``), a head tied to the embedding
(it is not a linear layer), the router (an fp32 GEMM), and the k/v projections of GQA when there are
fewer kv heads than tp ranks (those run on rows of a replicated weight outside the layer's GEMM).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.attention import GQAAttention
from moefold.dense.block import TransformerBlock
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.mla import MLAttention
from moefold.dense.regions import recomputes
from moefold.dense.split_backward import SplitWeights, WeightGradStore, accumulate_or_defer, weight_inputs
from moefold.execution.grad_accumulation import fused_linear
from moefold.moe.layer import MoELayer
from moefold.parallel.groups import Group, group_size
from moefold.parallel.sequence_input import keep_rows_as_shard
from moefold.parallel.sharding import is_sequence_parallel
from moefold.precision.block_linear import BlockScaledLinearGemm
from moefold.precision.fp8 import FP8Backend, FP8Config
from moefold.precision.fp8_cast import Float8Recipe, quantize, scaled_mm, shared_cast
from moefold.precision.fp8_param import mark_fp8_param
from moefold.precision.te_linear import TELinearGemm


class _Float8Linear(torch.autograd.Function):
    """``x [M, K] @ w[N, K]^T`` with every GEMM operand cast by ``gemm``'s recipe (module docstring).

    Saved for backward: the weight (a parameter, kept anyway) and, for the weight gradient, ``x`` already cast
    as that GEMM takes it (contracted over the tokens M: the forward's own cast under tensorwise scales, a second
    cast under rowwise ones), as Transformer Engine keeps its input quantised (``gemm.save_original_input``: ``x``
    itself, cast again in backward, for an input kept anyway by another consumer). The backward multiplies the
    same values either way."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, gemm: Float8LinearGemm, split: SplitWeights | None,
                _anchor: Tensor | None) -> Tensor:
        ctx.gemm, ctx.split, ctx.x_dtype = gemm, split, x.dtype   # split backward: w detached (weight_inputs)
        r = gemm.recipe
        x_sharded = (gemm.token_group, gemm.in_group)
        qx, sx = shared_cast(x, ("fp8 fwd", r.input, r.pow2_scales, x_sharded),
                             lambda: gemm.cast(x, r.input, contract=1, sharded=x_sharded))
        qw, sw = gemm.cast(w, r.weight, contract=1, sharded=(gemm.out_group, gemm.in_group))
        y = scaled_mm(qx, sx, qw.t(), sw.t(), x.dtype, r.fast_accum_forward)
        ctx.original = gemm.save_original_input
        if not (split is not None or ctx.needs_input_grad[1]):   # no weight gradient: x is not needed
            ctx.save_for_backward(None, None, w)
        elif ctx.original:
            ctx.save_for_backward(x, None, w)
        else:
            if r.input.rowwise:   # dw's cast: scales over the tokens (tensorwise: one scale, the forward's cast);
                # one copy for every GEMM on this input (q, k, v; gate, up)
                sharded = (gemm.token_group, gemm.in_group)
                qx, sx = shared_cast(x, ("fp8 dw", r.input, r.pow2_scales, sharded),
                                     lambda: gemm.cast(x, r.input, contract=0, sharded=sharded))
            keep_rows_as_shard(qx, x)   # under SP: this rank's rows of it (parallel.sequence_input)
            ctx.save_for_backward(qx, sx, w)
        return y

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        x_saved, sx_saved, w = ctx.saved_tensors
        gemm: Float8LinearGemm = ctx.gemm
        r = gemm.recipe
        gy = gy.contiguous()
        gx = gw = q_dy = None
        gy_sharded = (gemm.token_group, gemm.out_group)
        if ctx.needs_input_grad[0]:  # dx = dy @ w: contracts N
            q_dy = gemm.cast(gy, r.grad_output, contract=1, sharded=gy_sharded)
            qw, sw = gemm.cast(w, r.weight, contract=0, sharded=(gemm.out_group, gemm.in_group))
            gx = scaled_mm(*q_dy, qw, sw, ctx.x_dtype)
        reuse = q_dy if q_dy is not None and not r.grad_output.rowwise else None
        original = ctx.original

        def weight_grad() -> tuple[Tensor]:  # dw = dy^T @ x: contracts the tokens M (a tensorwise cast is the same)
            qg, sg = reuse if reuse is not None else gemm.cast(gy, r.grad_output, contract=0, sharded=gy_sharded)
            if original:
                qx, sx = gemm.cast(x_saved, r.input, contract=0, sharded=(gemm.token_group, gemm.in_group))
            else:
                qx, sx = x_saved, sx_saved
            return (scaled_mm(qg.t(), sg.t(), qx, sx, w.dtype),)

        if ctx.split is not None:   # split backward: now or deferred (its casts too)
            accumulate_or_defer(gemm.store, ctx.split.edges, weight_grad)
        elif ctx.needs_input_grad[1]:
            (gw,) = weight_grad()
        return gx, gw, None, None, None


class Float8LinearGemm:
    """``(x [..., K], w [N, K], b [N] | None) -> [..., N]`` in FP8 (torchao recipe), for one linear layer.

    Groups along which this layer's GEMM dims are split (None: complete on this rank):
    ``in_group`` K (row-parallel), ``out_group`` N (column-parallel), ``token_group`` the rows M
    (a replicated layer on the sequence-parallel shard).
    """

    def __init__(self, recipe: Float8Recipe, *, in_group: Group = None, out_group: Group = None,
                 token_group: Group = None) -> None:
        self.recipe = recipe
        self.in_group, self.out_group, self.token_group = in_group, out_group, token_group
        self.store: WeightGradStore | None = None   # split backward (dense.split_backward)
        # keep the high-precision input for backward (and cast it there) instead of its quantised copy: where the
        # input is kept anyway (Megatron's ``set_save_original_input``; execution.fp8_linear.original_input_linears)
        self.save_original_input = False

    def use_weight_grad_store(self, store: WeightGradStore) -> None:
        """Split backward: defer the weight gradient GEMM (its casts too) while ``store`` defers."""
        self.store = store

    def cast(self, t: Tensor, cast: Any, contract: int, sharded: tuple[Group, Group]) -> tuple[Tensor, Tensor]:
        """Cast the 2-D ``t`` for a GEMM contracting its dim ``contract``; ``sharded`` = (groups of dim 0,
        dim 1): a scale reduces over the contraction dim (rowwise) or both dims (tensorwise)."""
        dims = (contract,) if cast.rowwise else None
        groups = (sharded[contract],) if cast.rowwise else sharded
        return quantize(t, cast.dtype, dims, self.recipe.pow2_scales, groups)

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        lead = x.shape[:-1]
        (w_in,), split = weight_inputs(self.store, w)
        y = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), w_in, self, split, None if split is None else split.anchor)
        y = y.view(*lead, w.shape[0])
        return y if b is None else y + b

    def describe(self) -> str:
        r = self.recipe
        return f"torchao fp8 (x {_dtype(r.input.dtype)}, w {_dtype(r.weight.dtype)}, dy {_dtype(r.grad_output.dtype)})"


def _dtype(dtype: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype))


def original_input_linears(model: nn.Module) -> set[int]:
    """ids of the linears whose FP8 GEMM keeps its high-precision input for backward, not a quantised copy: where
    that input is kept anyway or freed and refilled by a recompute (Megatron-Core's ``set_save_original_input``):

    - an attention's output projection without an output gate: its input is the core attention's output, which
      the fused attention kernels keep (Megatron: ``linear_proj`` under FP8, attention.py / multi_latent_attention.py);
    - the shared experts' gate/up: their input, the post-attention norm's output, is kept by the router's gating
      GEMM (a view of it without SP at tp > 1);
    - under ``layernorm`` recompute, the linears that take the discarded norm output (those of the block's attention
      and FFN whose input is the hidden size, other than the output projection: q/k/v or MLA's down projections,
      gate/up, the shared experts' gate/up; Megatron's ``set_for_recompute_input_layernorm`` and
      ``linear_fc1`` / ``set_for_recompute_pre_mlp_layernorm``).
    """
    keep: set[int] = set()
    for block in model.modules():
        if not isinstance(block, TransformerBlock):
            continue
        attn, ffn = block.self_attn, block.mlp
        out = getattr(attn, "o_proj", None)
        if isinstance(attn, (GQAAttention, MLAttention)) and isinstance(out, RowParallelLinear) and not getattr(
                getattr(attn, "config", None), "output_gate", False):
            keep.add(id(out))
        shared = getattr(ffn, "shared_experts", None)
        if isinstance(ffn, MoELayer) and shared is not None:
            keep.update(id(m) for m in (shared.gate_proj, shared.up_proj) if m is not None)
        for part, region in ((attn, block.regions.attn_norm), (ffn, block.regions.mlp_norm)):
            if part is None or not recomputes(region):
                continue
            for module in part.modules():
                if (isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module is not out
                        and module.in_features == block.hidden):
                    keep.add(id(module))
    return keep


def convert_linears_to_fp8(model: nn.Module, config: FP8Config, tp_group: Group = None) -> list[str]:
    """Give every column/row-parallel linear of ``model`` not excluded by ``config`` an FP8 GEMM.

    ``tp_group``: the tensor/sequence-parallel group (the sequence shard of replicated layers).
    Returns the qualified names converted (none when FP8 is off). Parameters are untouched.
    """
    if not config.enabled:
        return []
    block = config.block_scaled
    recipe = Float8Recipe.from_config(config) if config.backend is FP8Backend.TORCHAO and not block else None
    converted = []
    originals = original_input_linears(model)
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if any(fragment in name for fragment in config.exclude_modules):
            continue
        w = module.weight
        if config.backend is FP8Backend.TE:
            module.configure(gemm=TELinearGemm(w.shape[1], w.shape[0], w.dtype, config))
            converted.append(name)
            continue
        if isinstance(module, RowParallelLinear):
            groups = {"in_group": module.tp_group}
        elif group_size(module.tp_group) > 1:
            groups = {"out_group": module.tp_group}
        else:  # replicated: on the sequence shard when its weight is marked sequence-parallel
            groups = {"token_group": tp_group if is_sequence_parallel(w) else None}
        if block:
            gemm = BlockScaledLinearGemm(config, **groups)
            gemm.check_shapes(name, w.shape[1], w.shape[0])
        else:
            gemm = Float8LinearGemm(recipe, **groups)
        gemm.save_original_input = id(module) in originals
        module.configure(gemm=gemm)
        if config.param_gather:
            mark_fp8_param(w, config, groups)
        converted.append(name)
    return converted


def fp8_linear_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the linears with an FP8 GEMM, names of those in high precision)."""
    fp8, high = [], []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            (high if module.local_gemm in (F.linear, fused_linear) else fp8).append(name)
    return fp8, high


__all__ = ["Float8LinearGemm", "convert_linears_to_fp8", "fp8_linear_names", "original_input_linears"]
