"""Block-scaled recipes on CUDA: torchao's kernels take the GEMMs where they run, with the emulation's numerics.

- blockwise (sm90+, torchao's Triton kernels): a bf16 linear whose dims are multiples of 128 runs through
  ``fp8_blockwise_mm``, the grouped experts through ``_to_fp8_blockwise_then_scaled_grouped_mm``;
- MXFP8 (sm100): through ``_to_mxfp8_then_scaled_mm`` / ``_to_mxfp8_then_scaled_grouped_mm``.

Each agrees with moefold's emulation of the same casts (``_BlockScaledLinear`` / ``_BlockScaledGroupedMM``, which
the CPU tests check against torchao's references) within 1e-2 relative: the quantisation is the same and the
kernels accumulate in fp32 in their own order before the bf16 output (a cast in other tiles or orientation is
~4e-2 away). In a rehearsal these are skipped (the kernels are CUDA-only); tests/moe/test_block_gemm.py runs the
MXFP8 calls through torchao's emulated kernels on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moefold.dense.linear import ColumnParallelLinear
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.moe.block_gemm import BlockScaledGroupedGemm, _BlockScaledGroupedMM
from moefold.precision.block_linear import _BlockScaledLinear
from moefold.precision.fp8 import FP8Config
from tests.gpu.rehearsal import capability, cuda_only

pytest.importorskip("torchao", reason="the block-scaled recipes need torchao (docs/gpus.md: the GPU check)")
RECIPES = {"blockwise": (lambda cap: cap >= (9, 0), "sm90+"), "mxfp8": (lambda cap: cap[0] == 10, "sm100")}


def _kernels(recipe: str) -> None:
    cuda_only(f"torchao's {recipe} kernels")
    runs, need = RECIPES[recipe]
    if not runs(capability()):
        pytest.skip(f"torchao's {recipe} kernels need {need}; this GPU is {capability()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fwd_bwd(fn, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xi, wi)
    y.backward(g)
    return y.detach(), xi.grad, wi.grad


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_linear_kernel_agrees_with_the_emulation(recipe, device):
    _kernels(recipe)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(512, 384, None, bias=False, dtype=torch.bfloat16, device=device)
    convert_linears_to_fp8(nn.ModuleDict({"p": layer}), FP8Config("e4m3", recipe))
    gemm = layer.local_gemm
    x = torch.randn(256, 512, device=device, dtype=torch.bfloat16)
    g = torch.randn(256, 384, device=device, dtype=torch.bfloat16)
    w = layer.weight.detach()
    assert gemm._torchao_kernel(x, w) is not None, f"torchao's {recipe} linear kernel was not chosen"
    kernel = _fwd_bwd(lambda a, b: gemm(a, b), x, w, g)
    emulated = _fwd_bwd(lambda a, b: _BlockScaledLinear.apply(a, b, gemm), x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), kernel, emulated):
        assert _rel(a, b) < 1e-2, (recipe, name, _rel(a, b))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("padded", [True, False], ids=["router-padding", "ragged"])
def test_grouped_kernel_agrees_with_the_emulation(recipe, padded, device):
    _kernels(recipe)
    torch.manual_seed(1)
    config = FP8Config("e4m3", recipe, router_padding=padded)
    counts = torch.tensor([128, 0, 256, 128] if padded else [100, 0, 300, 17], device=device)
    x = torch.randn(int(counts.sum()), 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(4, 256, 512, device=device, dtype=torch.bfloat16) * 0.05
    g = torch.randn(x.shape[0], 256, device=device, dtype=torch.bfloat16)
    gemm = BlockScaledGroupedGemm(config)
    assert gemm._torchao_grouped(x, w) is not None, f"torchao's {recipe} grouped kernel was not chosen"
    kernel = _fwd_bwd(lambda a, b: gemm(a, b, counts), x, w, g)
    emulated = _fwd_bwd(lambda a, b: _BlockScaledGroupedMM.apply(a, b, counts, None, gemm), x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), kernel, emulated):
        assert _rel(a, b) < 1e-2, (recipe, name, _rel(a, b))
