"""FP8 grouped expert GEMMs (``moe.fp8_gemm``, ``--fp8-backend torchao``):

- the per-expert path (CPU) equals, bit for bit, an emulation of the grouped path: the same code with
  ``torch._scaled_grouped_mm`` replaced by its documented semantics, after torch's own shape/dtype/layout
  checks of that op (its meta kernel) accept every argument the CUDA path would pass (with fp32
  activations: equal once rounded to bf16, the grouped kernel's only output);
- forward, dx and dw consume exactly (bit for bit) the casts of an independent quantise-dequantise
  reference with per-expert scales, compute their product (to fp32 summation order), and stay within
  the error bound the formats give;
- ``GroupedExperts`` with FP8 (grouped_mm and loop backends): identical, names and state_dict unchanged,
  no rows and empty experts handled.
"""

from __future__ import annotations

import pytest
import torch

import moefold.moe.fp8_gemm as fp8_gemm
import moefold.precision.fp8_cast as fp8_cast
from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig
from moefold.moe.fp8_gemm import Float8GroupedGemm
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8 import FP8Config
from tests.fp8_reference import E4M3, E5M2, GemmRecorder, cast_bound, check_gemm, gemm_bound, ref_cast, rel_err

COUNTS = [5, 0, 19, 8]           # an empty expert, uneven sizes
E, K, M = len(COUNTS), 32, 48
CASES = [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("rowwise", "e4m3"), ("rowwise", "hybrid")]


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    N = sum(COUNTS)
    x = torch.randn(N, K, generator=g) * torch.logspace(-2, 1, K)
    x[: COUNTS[0]] *= 100.0      # expert 0's tokens are far larger: per-expert scales matter
    w = torch.randn(E, M, K, generator=g) * 0.05
    grad = torch.randn(N, M, generator=g) * 1e-3
    return x.to(dtype), w.to(dtype), grad.to(dtype)


def _run(gemm, x, w, grad, counts_host=True):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gemm(x, w, torch.tensor(COUNTS), counts_host=COUNTS if counts_host else None)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


def _emulated_scaled_grouped_mm(calls: list):
    def emulate(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        # torch's own argument checks (the meta kernel implements _scaled_grouped_mm_cuda's): e4m3 operands,
        # a row-major, b column-major, 16-byte strides, fp32 scales [N] / [e, M], int32 offsets, bf16 out
        meta = [t.to("meta") if t is not None else None for t in (a, b, scale_a, scale_b, offs)]
        for t, ref in zip(meta[:2], (a, b)):
            assert t.stride() == ref.stride()
        out = torch._scaled_grouped_mm(*meta, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        assert out.shape == (a.shape[0], b.shape[2]) and out.dtype == torch.bfloat16
        calls.append(tuple(meta))
        # the semantics: per group i, rows offs[i-1]:offs[i] of (a * scale_a) @ (b[i] * scale_b[i]) with
        # row / column scales, computed by torch's CPU scaled GEMM (it dequantises, multiplies in fp32;
        # fp8_cast.scaled_mm does the same where torch's CPU kernel takes per-tensor scales only)
        res, start = [], 0
        for i, end in enumerate(offs.tolist()):
            res.append(fp8_cast.scaled_mm(a[start:end], scale_a[start:end, None], b[i], scale_b[i][None, :],
                                          out_dtype))
            start = end
        return torch.cat(res)
    return emulate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("recipe", "fmt"), CASES)
def test_per_expert_path_equals_emulated_grouped_path_bit_for_bit(monkeypatch, recipe, fmt, dtype):
    config = FP8Config(fmt, recipe)
    x, w, grad = _inputs(0, dtype)
    per_expert = _run(Float8GroupedGemm(config, grouped=False), x, w, grad)
    calls: list = []
    monkeypatch.setattr(fp8_gemm, "_scaled_grouped_mm", _emulated_scaled_grouped_mm(calls))
    monkeypatch.setattr(fp8_gemm, "grouped_kernel_supported", lambda x, K, M: True)
    grouped = _run(Float8GroupedGemm(config, grouped=True), x, w, grad, counts_host=False)
    # the grouped kernel takes e4m3 only: the forward always, dx only when the gradient is e4m3 too
    assert len(calls) == (2 if fmt == "e4m3" else 1)
    for name, a, b in zip(("y", "dx", "dw"), per_expert, grouped):
        assert torch.equal(a.bfloat16(), b.bfloat16()), name   # the same fp32 GEMM result, rounded alike
        if dtype == torch.bfloat16 or name == "dw" or (name == "dx" and fmt == "hybrid"):
            assert torch.equal(a, b), name                     # and identical where both wrote the same dtype


@pytest.mark.parametrize(("recipe", "fmt"), CASES)
def test_gemms_equal_qdq_reference_and_stay_within_the_format_bound(monkeypatch, recipe, fmt):
    x, w, grad = _inputs(1)
    gemms = GemmRecorder(monkeypatch, fp8_gemm)
    y, dx, dw = _run(Float8GroupedGemm(FP8Config(fmt, recipe), grouped=False), x, w, grad)
    n = sum(1 for c in COUNTS if c)
    calls = {"y": iter(gemms.calls[:n]), "dx": iter(gemms.calls[n:2 * n]), "dw": iter(gemms.calls[2 * n:])}
    assert len(gemms.calls) == 3 * n
    rowwise = pow2 = recipe == "rowwise"
    gdt = E5M2 if fmt == "hybrid" else E4M3
    rows = list(torch.arange(sum(COUNTS)).split(COUNTS))
    worst: dict[str, float] = {}

    def token_cast(t, dtype, dims):
        """per row (rowwise, over dims) or per expert (tensorwise: the expert's rows, all columns)."""
        if rowwise:
            return ref_cast(t, dtype, dims, pow2)
        parts = [ref_cast(t[r], dtype, None, pow2) if len(r) else (t[r], t.new_ones(())) for r in rows]
        return (torch.cat([p[0] for p in parts]),
                torch.cat([p[1].expand(len(r), 1) for p, r in zip(parts, rows)]))

    def check(name, a, da_cast, b, db_cast, got):
        qa, ia = da_cast
        qb, ib = db_cast
        check_gemm(next(calls[name]), qa, qb, got)
        exact = a.float() @ b.float()
        bound = gemm_bound(a, cast_bound(a, ia, da_dtype[name]), b, cast_bound(b, ib, db_dtype[name]), got,
                           torch.float32)
        worst[name] = max(worst.get(name, 0.0), ((got.float() - exact).abs() / bound).max().item())

    da_dtype = {"y": E4M3, "dx": gdt, "dw": gdt}
    db_dtype = {"y": E4M3, "dx": E4M3, "dw": E4M3}
    xq = token_cast(x, E4M3, (1,))
    gq = token_cast(grad, gdt, (1,))
    for i, r in enumerate(rows):
        if not len(r):
            assert torch.equal(dw[i], torch.zeros_like(dw[i]))
            continue
        wq = ref_cast(w[i], E4M3, (1,) if rowwise else None, pow2)             # forward: over K
        check("y", x[r], (xq[0][r], xq[1][r]), w[i].t(), (wq[0].t(), wq[1].t()), y[r])
        wq_dx = ref_cast(w[i], E4M3, (0,) if rowwise else None, pow2)          # dx: over M
        check("dx", grad[r], (gq[0][r], gq[1][r]), w[i], wq_dx, dx[r])
        # dw = dy_i^T x_i: contracted over expert i's rows, per (expert, channel) or per expert
        gt = ref_cast(grad[r].t(), gdt, (1,) if rowwise else None, pow2)
        xt = ref_cast(x[r], E4M3, (0,) if rowwise else None, pow2)
        check("dw", grad[r].t(), gt, x[r], xt, dw[i])
    assert all(v <= 1.0 + 1e-6 for v in worst.values()), worst
    hp = {"y": torch.cat([x[r] @ w[i].t() for i, r in enumerate(rows)])}
    print(f"{recipe} {fmt}: y rel err {rel_err(y, hp['y']):.2e}; worst share of the bound " +
          ", ".join(f"{k} {v:.0%}" for k, v in worst.items()))


def test_fp8_experts_module_backends_agree_and_handle_empty_input():
    fp8 = FP8Config("hybrid")
    ref = build_experts(E, K, ExpertsConfig(24, gemm_backend="loop"))
    init_parameters(ref, seed=3)
    mods = [build_experts(E, K, ExpertsConfig(24, gemm_backend=b, fp8=fp8)) for b in ("grouped_mm", "loop")]
    for mod in mods:
        mod.load_state_dict(ref.state_dict())
        assert list(mod.state_dict()) == ["w13", "w2"] and "fp8 hybrid tensorwise (torchao)" in repr(mod)
    x, _, _ = _inputs()
    outs = []
    for mod in (*mods, ref):
        xi = x.clone().requires_grad_()
        y = mod(xi, torch.tensor(COUNTS), tuple(COUNTS))
        y.sum().backward()
        outs.append((y.detach(), xi.grad, mod.w13.grad, mod.w2.grad))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)                  # grouped_mm (per expert on CPU) == loop
    assert 1e-3 < rel_err(outs[0][0], outs[2][0]) < 0.1   # FP8, not the high-precision result
    # no rows at all: zero gradients that still reach the weights
    mod = mods[0]
    mod.zero_grad()
    y = mod(x[:0].requires_grad_(), torch.zeros(E, dtype=torch.long), (0,) * E)
    y.sum().backward()
    assert y.shape == (0, K) and mod.w13.grad.abs().sum() == 0 and mod.w2.grad is not None
    # the same through the FP8 function itself (what runs when a token group's all-reduces must happen)
    x0, w0 = x[:0].clone().requires_grad_(), torch.randn(E, M, K, requires_grad=True)
    y0 = fp8_gemm._Float8GroupedMM.apply(x0, w0, torch.zeros(E, dtype=torch.long), None, Float8GroupedGemm(fp8),
                                         None, None)
    y0.sum().backward()
    assert y0.shape == (0, M) and x0.grad.shape == (0, K) and torch.equal(w0.grad, torch.zeros_like(w0))
