"""Block-scaled recipes (``--fp8-recipe blockwise | mxfp8``, ``--fp4-format e2m1``), torchao backend, world 1:

- the casts are torchao's, bit for bit: ``to_mx`` (RCEIL) for MXFP8, ``nvfp4_quantize`` (two-level) for NVFP4,
  and for DeepSeek's blockwise FP8 torchao's own torch references (``torch_blockwise_scale_act_quant_lhs`` /
  ``_rhs`` / ``torch_blockwise_scale_weight_quant``, compiled from the installed torchao's source: their module
  imports triton, absent on CPU), data and inverse scales;
- an MXFP8 linear equals torchao's own ``mx_mm`` (``KernelPreference.EMULATED``) bit for bit, forward and backward;
- every GEMM of a linear (y, dx, dw) consumes the reference casts of its operands in the recipe's blocks and
  orientation (1 x b along the contraction dim; weights 128x128 / 16x16), so its error obeys the format's bound;
- on outlier-heavy inputs (a few tokens 3e4 x larger) every block recipe is far closer to high precision
  than the per-tensor recipe (measured ~10x);
- the grouped experts equal, expert by expert, the same recipe's linear on that expert's rows (values and
  gradients; tiles restart at each expert's first row), with empty experts too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moefold.dense.linear import ColumnParallelLinear
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig
from moefold.precision.block_cast import FORMATS, quantize
from moefold.precision.block_linear import BlockScaledLinearGemm
from moefold.precision.fp8 import FP8Config
from tests.fp8_reference import rel_err, torchao_blockwise_references

E4M3 = torch.float8_e4m3fn
RECIPES = {"blockwise": FP8Config("e4m3", "blockwise"), "mxfp8": FP8Config("e4m3", "mxfp8"),
           "nvfp4": FP8Config(fp4="e2m1")}


# ------------------------------------------------------------------------------ references
def ref_blockwise(t: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """torchao's own torch references (``tests.fp8_reference.torchao_blockwise_references``), dequantised:
    1 x 128 tiles (``torch_blockwise_scale_act_quant_lhs``), 128 x 1 (``_rhs``), 128 x 128 (``_weight_quant``)."""
    refs = torchao_blockwise_references()
    R, C = t.shape
    t = t.contiguous()
    if (br, bc) == (1, 128):
        q, inv = refs.lhs(t, 128)
        return (q.float().view(R, C // 128, 128) * inv.unsqueeze(-1)).view(R, C)
    if (br, bc) == (128, 1):
        q, inv = refs.rhs(t, 128)
        return (q.float().view(R // 128, 128, C) * inv.unsqueeze(1)).view(R, C)
    assert (br, bc) == (128, 128), (br, bc)
    q, inv = refs.weight(t, 128)
    return (q.float().view(R // 128, 128, C // 128, 128) * inv[:, None, :, None]).view(R, C)


def ref_mx(t: torch.Tensor, rows: bool = True) -> torch.Tensor:
    """torchao's to_mx (RCEIL, 32 per block along the last dim; ``rows=False``: along dim 0), dequantised."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    x = t if rows else t.t().contiguous()
    scale, data = to_mx(x.contiguous(), E4M3, 32, ScaleCalculationMode.RCEIL)
    dq = to_dtype(data, scale, E4M3, 32, torch.float32)
    return dq if rows else dq.t()


def ref_nvfp4_rows(t: torch.Tensor) -> torch.Tensor:
    """torchao's nvfp4_quantize (1x16 along the last dim, per-tensor scale from the amax), dequantised."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    ts = per_tensor_amax_to_scale(t.abs().amax().float())
    scales, packed = nvfp4_quantize(t.contiguous(), 16, ts)
    vals = f4_unpacked_to_f32(unpack_uint4(packed)).view(t.shape[0], -1, 16)
    return (vals * (scales.float() * ts).unsqueeze(-1)).reshape(t.shape)


def reference_cast(t: torch.Tensor, recipe: str, is_weight: bool, contract: int) -> torch.Tensor:
    if recipe == "blockwise":
        return ref_blockwise(t, 128, 128) if is_weight else (ref_blockwise(t, 1, 128) if contract == 1
                                                              else ref_blockwise(t, 128, 1))
    if recipe == "mxfp8":
        return ref_mx(t, rows=contract == 1)
    if is_weight:   # 16x16 blocks: no CPU function in torchao (its 2-D kernel is Triton); the same math per block
        return quantize(t, FORMATS["nvfp4"], (16, 16)).dq
    return ref_nvfp4_rows(t) if contract == 1 else ref_nvfp4_rows(t.t().contiguous()).t()


# ------------------------------------------------------------------------------ casts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_casts_equal_torchao_bit_for_bit(dtype):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import pack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    torch.manual_seed(0)
    x = (torch.randn(128, 256) * torch.logspace(-4, 3, 256)).to(dtype)
    scale, data = to_mx(x, E4M3, 32, ScaleCalculationMode.RCEIL)
    c = quantize(x, FORMATS["mxfp8"], (1, 32))
    assert torch.equal(c.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(c.scale, scale.view(torch.uint8))
    scales, packed = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax().float()))
    c = quantize(x, FORMATS["nvfp4"], (1, 16))
    assert torch.equal(pack_uint4(c.data), packed) and torch.equal(c.scale.view(torch.uint8), scales.view(torch.uint8))
    refs = torchao_blockwise_references()
    for block, (q, inv) in (((1, 128), refs.lhs(x, 128)), ((128, 1), refs.rhs(x, 128)),
                            ((128, 128), refs.weight(x, 128))):
        c = quantize(x, FORMATS["blockwise"], block)
        assert torch.equal(c.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(c.scale, inv), block
        assert torch.equal(c.dq, ref_blockwise(x, *block))


def test_ragged_blocks_cover_the_rest():
    """A dim that is not a multiple of the block (DeepSeek-V3's kv_a_proj: 576 rows) ends in a partial block
    with its own scale (``weight_scale_inv`` of ceil(576 / 128) = 5 rows)."""
    w = torch.randn(200, 300)
    c = quantize(w, FORMATS["blockwise"], (128, 128))
    assert c.scale.shape == (2, 3)
    padded = torch.nn.functional.pad(w, (0, 84, 0, 56))   # zeros leave every block's amax unchanged
    assert torch.equal(c.dq, ref_blockwise(padded, 128, 128)[:200, :300])


# ------------------------------------------------------------------------------ linears
def _linear(recipe: str, K: int = 256, N: int = 384):
    torch.manual_seed(1)
    layer = ColumnParallelLinear(K, N, None, bias=False)
    assert convert_linears_to_fp8(nn.ModuleDict({"p": layer}), RECIPES[recipe]) == ["p"]
    return layer


def _fwd_bwd(layer, x, g):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad.clone()


def test_mxfp8_linear_equals_torchao_mx_mm_emulated():
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice
    from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode
    from torchao.quantization.quantize_.common import KernelPreference

    layer = _linear("mxfp8")
    x, g = torch.randn(64, 256), torch.randn(64, 384)
    y, gx, gw = _fwd_bwd(layer, x, g)
    xr, wr = x.clone().requires_grad_(), layer.weight.detach().clone().requires_grad_()
    yr = mx_mm.apply(xr, wr, E4M3, E4M3, E4M3, 32, KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH,
                     MXFP8Dim1CastKernelChoice.TORCH, Mode.RCEIL, False)
    yr.backward(g)
    assert torch.equal(y, yr.detach()) and torch.equal(gx, xr.grad) and torch.equal(gw, wr.grad)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_linear_gemms_consume_the_reference_casts(monkeypatch, recipe):
    calls = []
    real = BlockScaledLinearGemm.mm
    monkeypatch.setattr(BlockScaledLinearGemm, "mm", staticmethod(
        lambda a, b, dtype: calls.append((a.clone(), b.clone())) or real(a, b, dtype)))
    layer = _linear(recipe)
    torch.manual_seed(2)
    x, g = torch.randn(256, 256), torch.randn(256, 384)
    y, gx, gw = _fwd_bwd(layer, x, g)
    w = layer.weight.detach()
    want = [(reference_cast(x, recipe, False, 1), reference_cast(w, recipe, True, 1).t()),
            (reference_cast(g, recipe, False, 1), reference_cast(w, recipe, True, 0)),
            (reference_cast(g, recipe, False, 0).t(), reference_cast(x, recipe, False, 0))]
    assert len(calls) == 3
    for (a, b), (ra, rb) in zip(calls, want):
        assert torch.equal(a, ra) and torch.equal(b, rb), recipe
    errors = [rel_err(y, x @ w.T), rel_err(gx, g @ w), rel_err(gw, g.T @ x)]
    bound = 0.06 if recipe != "nvfp4" else 0.2   # e4m3: 2^-4 per operand; e2m1: 2^-2, ~0.15 measured
    print(recipe, [f"{e:.3g}" for e in errors])
    assert max(errors) < bound


def test_block_recipes_beat_per_tensor_on_outliers():
    """A few tokens 3e4 x larger than the rest (massive activations): one per-tensor scale is theirs, and the
    other tokens' outputs lose most of their bits; 1 x b tiles scale each token on its own."""
    torch.manual_seed(3)
    x = torch.randn(128, 256)
    x[:4] *= 3e4
    w = torch.randn(384, 256) * 0.02
    errs = {}
    for name, config in {**RECIPES, "tensorwise": FP8Config("e4m3", "tensorwise")}.items():
        layer = ColumnParallelLinear(256, 384, None, bias=False)
        with torch.no_grad():
            layer.weight.copy_(w)
        convert_linears_to_fp8(nn.ModuleDict({"p": layer}), config)
        errs[name] = rel_err(layer(x)[4:], (x @ w.T)[4:])   # the ordinary tokens
        errs[name + " without outliers"] = rel_err(layer(x[4:]), x[4:] @ w.T)
    print({k: f"{v:.3g}" for k, v in errs.items()})
    for name in ("blockwise", "mxfp8"):   # FP8 against FP8's per-tensor recipe
        assert errs[name] < errs["tensorwise"] / 3, errs
    for name in RECIPES:                  # and no recipe's ordinary tokens notice the outliers
        assert errs[name] < 1.25 * errs[name + " without outliers"], errs
    assert errs["tensorwise"] > 3 * errs["tensorwise without outliers"], errs


# ------------------------------------------------------------------------------ experts
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_experts_equal_the_linear_per_expert(recipe):
    torch.manual_seed(4)
    config = RECIPES[recipe]
    ex = build_experts(4, 128, ExpertsConfig(64, fp8=config, activation="gelu"))
    counts = torch.tensor([40, 0, 7, 33])
    x = torch.randn(int(counts.sum()), 128, requires_grad=True)
    out = ex(x, counts)
    g = torch.randn_like(out)
    out.backward(g)
    gemm = BlockScaledLinearGemm(config)
    start = 0
    for i, m in enumerate(counts.tolist()):
        xi = x.detach()[start:start + m].clone().requires_grad_()
        w1 = ex.w13.detach()[i, 0].clone().requires_grad_()
        w2 = ex.w2.detach()[i].clone().requires_grad_()
        yi = gemm(torch.nn.functional.gelu(gemm(xi, w1)), w2)
        yi.backward(g[start:start + m])
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.detach()[start:start + m], yi.detach(), **tol)
        torch.testing.assert_close(x.grad[start:start + m], xi.grad, **tol)
        torch.testing.assert_close(ex.w13.grad[i, 0], w1.grad if m else torch.zeros_like(w1), **tol)
        torch.testing.assert_close(ex.w2.grad[i], w2.grad if m else torch.zeros_like(w2), **tol)
        start += m
