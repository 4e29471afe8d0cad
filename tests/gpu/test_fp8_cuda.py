"""FP8 (``--fp8-backend torchao``) on CUDA: what the CPU tests cannot run.

- the FP8 linear equals torchao's ``Float8Linear`` on the GPU (tensorwise, bf16) and runs unaligned
  dims (K and N padded to 16 for torch's kernel) with the CPU path's result;
- the grouped expert GEMM really uses ``torch._scaled_grouped_mm`` on sm90/sm100 and agrees with the
  per-expert path (same casts; only the accumulation differs);
- a decoder training step in bf16 with FP8 GEMMs and FP8 dispatch stays close to bf16.

Skipped without torchao (carry its wheel to a GPU machine: docs/gpus.md, "The GPU check"). In a rehearsal
(tests/gpu/rehearsal.py) everything runs on the CPU (torch's emulated ``_scaled_mm``), the grouped
kernel through the CPU emulation of ``torch._scaled_grouped_mm`` that tests/moe/test_fp8_gemm.py checks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moefold.moe.fp8_gemm as fp8_gemm
from moefold.dense.linear import ColumnParallelLinear
from moefold.execution import build_decoder
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny
from moefold.moe.fp8_gemm import Float8GroupedGemm
from moefold.precision.fp8 import FP8Config
from tests.gpu.rehearsal import REHEARSAL, capability

pytest.importorskip("torchao", reason="--fp8-backend torchao needs torchao (docs/gpus.md: the GPU check)")


def _fp8_units() -> None:
    if capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, this GPU has {capability()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear(in_f: int, out_f: int, recipe: str, device: str) -> ColumnParallelLinear:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(in_f, out_f, None, dtype=torch.bfloat16, device=device)
    convert_linears_to_fp8(nn.ModuleDict({"p": layer}), FP8Config("e4m3" if recipe == "rowwise" else "hybrid", recipe))
    return layer


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


def test_linear_equals_torchao_and_pads_unaligned_dims(device):
    _fp8_units()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layer = _linear(256, 512, "tensorwise", device)
    ref = nn.Sequential(nn.Linear(256, 512, bias=False, dtype=torch.bfloat16, device=device))
    with torch.no_grad():
        ref[0].weight.copy_(layer.weight)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
    g = torch.randn(128, 512, device=device, dtype=torch.bfloat16)
    for got, want in zip(_fwd_bwd(layer, x, g), _fwd_bwd(ref[0], x, g)):
        torch.testing.assert_close(got, want, atol=0, rtol=1e-2)
    for recipe in ("tensorwise", "rowwise"):   # K = 40, N = 24: not multiples of 16
        gpu = _fwd_bwd(_linear(40, 24, recipe, device), x[:, :40], g[:, :24])
        cpu = _fwd_bwd(_linear(40, 24, recipe, "cpu"), x[:, :40].cpu(), g[:, :24].cpu())
        for a, b in zip(gpu, cpu):
            assert _rel(a.cpu(), b) < 1e-2


@pytest.mark.parametrize(("fmt", "recipe"), [("e4m3", "rowwise"), ("hybrid", "tensorwise"), ("e4m3", "tensorwise")])
def test_grouped_kernel_agrees_with_the_per_expert_path(monkeypatch, fmt, recipe, device):
    _fp8_units()
    major = capability()[0]
    calls = []
    real = fp8_gemm._scaled_grouped_mm
    if REHEARSAL:  # the CPU has no grouped FP8 kernel: the emulation tests/moe/test_fp8_gemm.py checks
        from tests.moe.test_fp8_gemm import _emulated_scaled_grouped_mm

        real = _emulated_scaled_grouped_mm([])
        monkeypatch.setattr(fp8_gemm, "grouped_kernel_supported", lambda x, K, M: K % 16 == 0 and M % 16 == 0)
    monkeypatch.setattr(fp8_gemm, "_scaled_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    counts = [40, 0, 100, 17]
    x = torch.randn(sum(counts), 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(4, 512, 256, device=device, dtype=torch.bfloat16) * 0.05
    g = torch.randn(sum(counts), 512, device=device, dtype=torch.bfloat16)
    outs = []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = Float8GroupedGemm(FP8Config(fmt, recipe), grouped=grouped)(xi, wi, torch.tensor(counts, device=device))
        y.backward(g)
        outs.append((y.detach(), xi.grad, wi.grad))
    if major in (9, 10):
        assert len(calls) == (2 if fmt == "e4m3" else 1), "the grouped kernel was not used"
    for name, a, b in zip(("y", "dx", "dw"), *outs):
        assert _rel(a, b) < 1e-2, name


def test_decoder_step_bf16_fp8_close_to_bf16(device):
    _fp8_units()
    config = deepseek_v3_tiny().with_(num_layers=2, hidden_size=128, moe_ffn_hidden_size=64)
    ids = torch.randint(0, 512, (2, 64), device=device)
    losses = []
    for fp8 in (FP8Config(), FP8Config("hybrid", dispatch=True)):
        with torch.device(device):
            model = build_decoder(config, options=ModelOptions(fp8=fp8, dtype="bf16"))
        model.init_weights(0)
        out = model(ids, ids)
        out.loss.backward()
        losses.append(out.loss.item())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert abs(losses[0] - losses[1]) < 0.05 * losses[0], losses
