"""FP8 column/row-parallel linears (``--fp8-backend torchao``), world 1:

- equal torchao's own ``Float8Linear`` (``convert_to_float8_training``) bit for bit, forward and backward;
- every GEMM (y, dx, dw) consumes exactly (bit for bit) the casts of an independent quantise-dequantise
  reference, computes their product (to fp32 summation order) and stays within the error bound the
  formats give (tests/fp8_reference.py);
- ``convert_linears_to_fp8`` converts exactly the linears it should and leaves parameters alone;
- the Transformer Engine backend runs each linear through a persistent ``te.Linear`` in TE's autocast
  (protocol, through a stand-in).

Layouts (tp2 with SP, ep2, tp2 x ep2) are checked on the whole model in tests/models/test_fp8_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.execution import build_decoder
from moefold.execution.fp8_linear import convert_linears_to_fp8, fp8_linear_names
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny, qwen3_moe_tiny
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_region import fp8_autocast
from tests.fp8_reference import E4M3, E5M2, GemmRecorder, cast_bound, check_gemm, gemm_bound, ref_cast, rel_err

CASES = [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("rowwise", "e4m3"), ("rowwise", "hybrid")]


def _fp8_layer(cls, recipe: str, fmt: str, dtype=torch.float32, bias: bool = False):
    torch.manual_seed(0)
    layer = cls(96, 48, None, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_(0, 0.1)
    model = nn.ModuleDict({"proj": layer})
    assert convert_linears_to_fp8(model, FP8Config(fmt, recipe)) == ["proj"]
    return layer


def _run(layer, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad.clone()


@pytest.mark.parametrize(("cls", "recipe", "dtype"), [
    (ColumnParallelLinear, "tensorwise", torch.float32), (ColumnParallelLinear, "tensorwise", torch.bfloat16),
    (RowParallelLinear, "tensorwise", torch.float32), (RowParallelLinear, "rowwise", torch.bfloat16)])
def test_equals_torchao_float8_linear(cls, recipe, dtype):
    """torchao's recipes as torchao runs them: tensorwise = e4m3 forward, e5m2 gradients (hybrid);
    rowwise = e4m3 everywhere, power-of-2 scales. (torchao rounds an fp32 model's row-wise GEMM outputs
    to bf16 on every device; moefold only where the kernel demands it, on CUDA, so rowwise is compared
    in bf16.)"""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fmt = "hybrid" if recipe == "tensorwise" else "e4m3"
    layer = _fp8_layer(cls, recipe, fmt, dtype, bias=True)
    ref = nn.Sequential(nn.Linear(96, 48, dtype=dtype))
    with torch.no_grad():
        ref[0].weight.copy_(layer.weight)
        ref[0].bias.copy_(layer.bias)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(4, 8, 96, dtype=dtype)
    grad = torch.randn(4, 8, 48, dtype=dtype)
    y, gx, gw = _run(layer, x, grad)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(grad)
    assert torch.equal(y, yr.detach()) and torch.equal(gx, xr.grad) and torch.equal(gw, ref[0].weight.grad)
    assert torch.equal(layer.bias.grad, ref[0].bias.grad)


@pytest.mark.parametrize(("recipe", "fmt"), CASES)
def test_gemms_equal_qdq_reference_and_stay_within_the_format_bound(monkeypatch, recipe, fmt):
    import moefold.execution.fp8_linear as fp8_linear

    layer = _fp8_layer(ColumnParallelLinear, recipe, fmt)
    recorded = GemmRecorder(monkeypatch, fp8_linear)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 96)  # channels over 4 decades
    grad = torch.randn(64, 48, generator=g) * 1e-3
    y, gx, gw = _run(layer, x, grad)
    w = layer.weight.detach()
    rowwise, pow2 = recipe == "rowwise", recipe == "rowwise"
    gdt = E5M2 if fmt == "hybrid" else E4M3
    out = torch.float32
    # (name, a [M, K], its dtype, b [K, N], its dtype, the result): each operand scaled along K (rowwise)
    gemms = [("y", x, E4M3, w.t(), E4M3, y), ("dx", grad, gdt, w, E4M3, gx), ("dw", grad.t(), gdt, x, E4M3, gw)]
    report = {}
    assert len(recorded.calls) == 3
    for (name, a, adt, b, bdt, got), call in zip(gemms, recorded.calls):
        qa, ia = ref_cast(a, adt, (1,) if rowwise else None, pow2)
        qb, ib = ref_cast(b, bdt, (0,) if rowwise else None, pow2)
        check_gemm(call, qa, qb, got)
        exact = a.float() @ b.float()
        bound = gemm_bound(a, cast_bound(a, ia, adt), b, cast_bound(b, ib, bdt), got, out)
        worst = ((got.float() - exact).abs() / bound).max().item()
        assert worst <= 1.0 + 1e-6, f"{name}: error reaches {worst:.3f} of the {fmt} bound"
        report[name] = (rel_err(got, exact), worst)
    # the bound is not vacuous: the errors use a good part of it
    assert max(w for _, w in report.values()) > 0.05, report
    print(f"{recipe} {fmt}: " + ", ".join(f"{k} rel err {r:.2e} ({w:.0%} of bound)" for k, (r, w) in report.items()))


def test_convert_picks_the_linears_and_leaves_the_weights():
    fp8 = FP8Config("hybrid")
    for recipe, n_linear in ((qwen3_moe_tiny, 8), (deepseek_v3_tiny, 25)):  # attention, dense MLP, shared experts, MTP
        config = recipe().with_(num_layers=2)
        ref = MoEDecoder(config)
        model = build_decoder(config, options=ModelOptions(fp8=fp8))
        assert list(model.state_dict()) == list(ref.state_dict())
        assert all(p.dtype == torch.float32 for p in model.parameters())
        converted, high = fp8_linear_names(model)
        assert high == ["output_head.proj"], high   # the head stays in high precision by default
        assert len(converted) == n_linear and not any("router" in n for n in converted), converted
    model = build_decoder(config, options=ModelOptions(fp8=FP8Config("hybrid", exclude_modules=("layers.0.", "mtp"))))
    converted, high = fp8_linear_names(model)
    assert "output_head.proj" in converted
    assert all(n.startswith("layers.1.") for n in converted if n != "output_head.proj"), converted
    assert fp8_linear_names(MoEDecoder(config))[0] == []   # FP8 off: nothing converted


@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "nvfp4"])
def test_te_backend_runs_a_persistent_te_linear_in_autocast(monkeypatch, recipe):
    """Protocol (stand-in TE, tests/moe/te_standin.py): one meta-device ``te.Linear`` per layer for the whole
    run, run on the layer's own weight inside the caller's TE autocast region with the run's recipe
    (DelayedScaling, Float8BlockScaling, NVFP4BlockScaling on a B200); outside a region it refuses to run (TE would
    silently compute in high precision)."""
    from tests.moe import te_standin

    pt = te_standin.install(monkeypatch)
    if recipe == "nvfp4":
        monkeypatch.setitem(te_standin.DEVICE, "capability", (10, 0))
    config = (FP8Config(fp4="e2m1", backend="te") if recipe == "nvfp4" else
              FP8Config("hybrid" if recipe == "delayed" else "e4m3", recipe, backend="te"))
    layer = ColumnParallelLinear(32, 32, None, bias=True)
    ref = ColumnParallelLinear(32, 32, None, bias=True)
    ref.load_state_dict(layer.state_dict())
    convert_linears_to_fp8(nn.ModuleDict({"p": layer}), config)
    built = pt.Linear.instances
    assert len(built) == 1 and built[0].weight.is_meta and list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(4, 8, 32)
    with pytest.raises(RuntimeError, match=r"TELinearGemm: --fp8-backend te GEMMs must run inside"):
        layer(x)
    for _ in range(2):
        with fp8_autocast(config):
            got = _run(layer, x, torch.ones(4, 8, 32))
        for g, want in zip(got, _run(ref, x, torch.ones(4, 8, 32))):
            torch.testing.assert_close(g, want)
    assert len(built) == 1 and len(built[0].calls) == 2
    assert built[0].calls[0] == config.te_recipe()
    assert type(config.te_recipe()).__name__ == {"delayed": "DelayedScaling", "blockwise": "Float8BlockScaling",
                                                 "nvfp4": "NVFP4BlockScaling"}[recipe]
    assert f"Transformer Engine {config.fp4 or config.format} {recipe}" in repr(layer)
