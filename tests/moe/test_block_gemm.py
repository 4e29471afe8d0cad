"""Block-scaled grouped expert GEMMs (``moe.block_gemm``) against torchao's own MoE training code, on CPU.

torchao's ``moe_training`` MXFP8 grouped GEMM (``_to_mxfp8_then_scaled_grouped_mm``, what TorchTitan's MXFP8 MoE
training calls) runs on a CPU with ``KernelPreference.EMULATED`` (its ``to_mx`` casts, a dequantised grouped GEMM).
moefold's grouped experts in ``--fp8-recipe mxfp8`` equal it, output and both gradients, in bf16, to the last bit but
for GEMM summation order: torchao multiplies the dequantised operands in a bf16 grouped GEMM, moefold in an fp32 one,
so an output may sit one bf16 rounding away (``_same``: at most 1% of the elements, each within one bf16 ulp; a
tiling that differs from torchao's (checked: tiles not restarted at each expert) moves ~20% of them):

- token groups that are multiples of 32 (what ``--moe-router-padding-for-quantization`` lays out), torchao
  unpadded;
- ragged groups (an empty expert, groups of 7 and 33 rows), torchao padding each group to 32 rows
  (``pad_token_groups_for_grouped_mm``) and moefold restarting its 32-row tiles at each expert's first row;
- the whole ``GroupedExperts`` module (w13 -> GELU -> w2) against the two torchao GEMMs chained.
- the calls moefold makes into torchao on a Blackwell GPU (``_torchao_grouped`` / ``_torchao_linear``), run with
  the kernel preference switched to EMULATED: valid for the installed torchao, and equal to moefold's emulation
  (checked: the router-padding flag passed the wrong way round fails).

(torchao's blockwise grouped GEMM quantises its activations with a Triton kernel even when emulated, and its NVFP4
grouped GEMM has no autograd function yet: those are checked against the casts' references in
tests/precision/test_block_linear.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moefold.moe.block_gemm import BlockScaledGroupedGemm
from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig
from moefold.precision.fp8 import FP8Config, import_torchao

MXFP8 = FP8Config("e4m3", "mxfp8")


def _torchao_mxfp8(x, w, counts, pad):
    """torchao's differentiable MXFP8 grouped GEMM of ``x [N, K]`` and ``w [e, M, K]`` (emulated kernels)."""
    import_torchao()
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    offs = torch.cumsum(counts, 0).to(torch.int32)
    return _to_mxfp8_then_scaled_grouped_mm(x, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16,
                                            kernel_preference=KernelPreference.EMULATED,
                                            pad_token_groups_for_grouped_mm=pad)


def _rows(counts: torch.Tensor, k: int) -> torch.Tensor:
    """bf16 token rows, expert i's of magnitude 2^(6 - 4i) (times 2^-2 .. 2^2 per row): MXFP8's power-of-2 scales
    then depend on which rows share a tile, and a tile that strays over an expert's boundary changes them (on rows
    of one magnitude every tiling gives the same scales, and a test could not tell tilings apart)."""
    expert = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    exponent = 6 - 4 * expert + torch.randint(-2, 3, expert.shape)
    return (torch.randn(expert.numel(), k) * torch.exp2(exponent.float())[:, None]).to(torch.bfloat16)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for bf16 output rounding after a different fp32 summation order (module docstring)."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    assert (diff <= 2.0 ** -7 * want.abs() + 2.0 ** -16 * want.abs().max()).all(), diff.max()
    assert (diff > 0).float().mean() <= 0.01, (diff > 0).float().mean()


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _equals_moefold(torchao_gemm, x, w, g, counts) -> None:
    """``torchao_gemm(x, w)`` and moefold's MXFP8 grouped GEMM on copies of the same leaves: output and both
    gradients ``_same``."""
    xr, wr = _leaves(x, w)
    yr = torchao_gemm(xr, wr)
    yr.backward(g)
    xm, wm = _leaves(x, w)
    ym = BlockScaledGroupedGemm(MXFP8)(xm, wm, counts)
    ym.backward(g)
    for got, want in ((ym, yr), (xm.grad, xr.grad), (wm.grad, wr.grad)):
        _same(got, want)


@pytest.mark.parametrize("counts", [[64, 0, 32, 96], [40, 0, 7, 33]], ids=["aligned", "ragged"])
def test_mxfp8_grouped_gemm_equals_torchao_moe_training(counts):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    x, g = _rows(counts, 128), _rows(counts, 64)
    w = torch.randn(4, 64, 128, dtype=torch.bfloat16) * 0.05
    aligned = bool((counts % 32 == 0).all())
    _equals_moefold(lambda a, b: _torchao_mxfp8(a, b, counts, pad=not aligned), x, w, g, counts)


def test_mxfp8_grouped_experts_equal_torchao_moe_training():
    torch.manual_seed(1)
    experts = build_experts(4, 128, ExpertsConfig(64, fp8=MXFP8, activation="gelu"), dtype=torch.bfloat16)
    with torch.no_grad():
        experts.w13.normal_(0, 0.05)
        experts.w2.normal_(0, 0.05)
    counts = torch.tensor([40, 0, 7, 33])
    x, g = _rows(counts, 128), _rows(counts, 128)
    xm = _leaves(x)[0]
    out = experts(xm, counts)
    out.backward(g)
    xr, w1, w2 = _leaves(x, experts.w13.reshape(4, 64, 128), experts.w2)
    y = _torchao_mxfp8(F.gelu(_torchao_mxfp8(xr, w1, counts, pad=True)), w2, counts, pad=True)
    y.backward(g)
    for got, want in ((out, y), (xm.grad, xr.grad), (experts.w13.grad.reshape(4, 64, 128), w1.grad),
                      (experts.w2.grad, w2.grad)):
        _same(got, want)


def test_the_gpu_kernel_calls_equal_the_emulation(monkeypatch):
    """What moefold hands the GEMMs to on a Blackwell GPU (``moe.block_gemm._torchao_grouped``,
    ``precision.block_linear._torchao_linear``: torchao's MXFP8 functions with moefold's arguments), run here with
    torchao's kernel preference switched to EMULATED (the only change): the calls are valid for the installed
    torchao and give what moefold's own emulation gives, the grouped call with and without router padding."""
    import_torchao()
    import torchao.prototype.moe_training.mxfp8_grouped_mm as grouped_mod
    import torchao.prototype.moe_training.mxfp8_linear as linear_mod
    from torchao.quantization.quantize_.common import KernelPreference

    from moefold.moe.block_gemm import _torchao_grouped
    from moefold.precision.block_linear import BlockScaledLinearGemm, _torchao_linear

    real_grouped, real_linear = grouped_mod._to_mxfp8_then_scaled_grouped_mm, linear_mod._to_mxfp8_then_scaled_mm
    monkeypatch.setattr(grouped_mod, "_to_mxfp8_then_scaled_grouped_mm", lambda *a, **k: real_grouped(
        *a, **{**k, "kernel_preference": KernelPreference.EMULATED}))
    monkeypatch.setattr(linear_mod, "_to_mxfp8_then_scaled_mm", lambda x, w, _pref, *a, **k: real_linear(
        x, w, KernelPreference.EMULATED, *a, **k))
    torch.manual_seed(2)
    for counts, padded in (([64, 0, 32, 96], True), ([40, 0, 7, 33], False)):
        counts = torch.tensor(counts)
        x, g = _rows(counts, 128), _rows(counts, 64)
        w = torch.randn(4, 64, 128, dtype=torch.bfloat16) * 0.05
        kernel = _torchao_grouped.__wrapped__("mxfp8", (10, 0), padded)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        _equals_moefold(lambda a, b: kernel(a, b.transpose(-2, -1), offs), x, w, g, counts)   # as __call__ calls it
    x, w, g = _rows(torch.tensor([64]), 128), torch.randn(96, 128, dtype=torch.bfloat16) * 0.05, _rows(
        torch.tensor([64]), 96)
    kernel = _torchao_linear.__wrapped__("mxfp8", (10, 0))
    outs = []
    for run in (kernel, lambda a, b: BlockScaledLinearGemm(MXFP8)(a, b)):
        xi, wi = _leaves(x, w)
        y = run(xi, wi)
        y.backward(g)
        outs.append((y, xi.grad, wi.grad))
    for got, want in zip(*outs):
        _same(got, want)
